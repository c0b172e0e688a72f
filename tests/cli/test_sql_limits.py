"""`monarch sql` bounds what a query may cost: rows shown, seconds run, and Ctrl-C stops it."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from monarch_cli.telemetry import TelemetryWriter, db_path

ENDLESS = "WITH RECURSIVE c(x) AS (SELECT 1 UNION ALL SELECT x + 1 FROM c)"


@pytest.fixture
def state(tmp_path: Path) -> Path:
    path = tmp_path / ".monarch" / "job_state.pkl"
    path.parent.mkdir(mode=0o700)
    writer = TelemetryWriter(db_path(path.parent), "run-1")
    writer.output(0, 1, b"one line\n")
    writer.close()
    assert writer.error is None
    return path


def _sql(state: Path, *args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "MONARCH_STATE": str(state)}
    return subprocess.run(
        [sys.executable, "-m", "monarch_cli", "sql", *args], capture_output=True, text=True, env=env, timeout=timeout
    )


def test_an_endless_query_shows_the_first_rows_and_says_so(state: Path) -> None:
    done = _sql(state, f"{ENDLESS} SELECT x FROM c", "--csv")
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines()[1:4] == ["1", "2", "3"] and len(done.stdout.splitlines()) == 10_001
    assert done.stderr == "monarch: showing the first 10000 rows; --max-rows raises the limit\n"
    few = _sql(state, f"{ENDLESS} SELECT x FROM c", "--json", "--max-rows", "3")
    assert few.returncode == 0 and few.stdout.count('"x"') == 3


def test_a_query_past_its_time_limit_is_stopped_in_one_line(state: Path) -> None:
    done = _sql(state, f"{ENDLESS} SELECT count(*) FROM c", "--timeout", "1")
    assert done.returncode == 2 and done.stdout == ""
    assert done.stderr == "monarch: error: sql: stopped after 1 s; --timeout raises the limit\n"
    bad = _sql(state, "SELECT 1", "--timeout", "nan")
    assert bad.returncode == 2 and "positive number" in bad.stderr


def test_ctrl_c_stops_a_running_query(state: Path) -> None:
    proc = subprocess.Popen(
        [sys.executable, "-m", "monarch_cli", "sql", f"{ENDLESS} SELECT count(*) FROM c", "--timeout", "600"],
        env={**os.environ, "MONARCH_STATE": str(state)},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        p = psutil.Process(proc.pid)
        deadline = time.monotonic() + 60
        while sum(p.cpu_times()[:2]) < 1.0:  # well into the query, past start-up
            assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
            time.sleep(0.05)
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=30)
    finally:
        proc.kill()
    assert proc.returncode == 130, err
    assert err == "monarch: error: sql: interrupted (Ctrl-C)\n" and out == ""
