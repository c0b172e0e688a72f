"""A run whose client is killed with SIGKILL (kill -9, the OOM killer) ends for every reader.

Real everything: `monarch serve` and `monarch run-spmd` are the CLI in subprocesses, the MCP
server is `python -m monarch_cli mcp` driven by the SDK's stdio client, the dashboard's pages
are its views over the real store. The client is killed while its rank runs; the next command
must say the run ended, not show it running for ever.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import anyio
import pytest

from monarch_cli.jobs import run_owner

from ..conftest import REPO, write_script
from .test_mcp import connected

pytestmark = pytest.mark.slow

LONG = """
print("working", flush=True)
import time
time.sleep(600)
"""


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != "MONARCH_STATE"}
    env["PYTHONPATH"] = str(REPO)
    return env


def _monarch(project: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "monarch_cli", *args],
        cwd=project,
        env=_env(),
        capture_output=True,
        text=True,
        timeout=240,
        stdin=subprocess.DEVNULL,
    )


def _start_and_kill(project: Path) -> str:
    """`monarch run-spmd` until its rank prints, then SIGKILL to the client; the run's id."""
    before = set((project / ".monarch" / "logs").glob("*"))
    client = subprocess.Popen(
        [sys.executable, "-m", "monarch_cli", "run-spmd", "--", "python", "long.py"],
        cwd=project,
        env=_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        stdin=subprocess.DEVNULL,
    )
    assert client.stdout is not None
    line = client.stdout.readline()  # the rank runs (pytest's timeout bounds this wait)
    assert b"working" in line, line
    client.send_signal(signal.SIGKILL)
    client.wait()
    (run_dir,) = set((project / ".monarch" / "logs").glob("*")) - before
    return run_dir.name


def _ended_in_store(project: Path, run_id: str) -> dict[str, object]:
    done = _monarch(project, "sql", "--json", f"SELECT ended_at, exit_code FROM runs WHERE run_id = '{run_id}'")
    assert done.returncode == 0, done.stderr
    (row,) = json.loads(done.stdout)
    return row


def test_a_client_killed_with_sigkill_leaves_no_run_running(tmp_path: Path) -> None:
    project = tmp_path / "project"
    write_script(project, "long.py", LONG)
    served = _monarch(project, "serve", "--hosts", "1")
    assert served.returncode == 0, served.stderr
    try:
        # MCP first: wait_run answers at once that the run is lost, with its one line
        first = _start_and_kill(project)

        async def session() -> tuple[float, str, dict[str, object]]:
            async with connected(project, tmp_path / "server.log") as agent:
                started = time.monotonic()
                lost = await agent.refused("wait_run", {"run_id": first, "wait_s": 120})
                took = time.monotonic() - started
                rows = await agent.ok("sql", {"query": f"SELECT ended_at FROM runs WHERE run_id = '{first}'"})
                return took, lost, rows

        took, lost, rows = anyio.run(session)
        assert "ended without a result" in lost and took < 30, (took, lost)
        assert rows["rows"][0]["ended_at"] is not None
        record = json.loads((project / ".monarch" / "logs" / first / "runner.json").read_text())
        assert record["state"] == "lost"  # rewritten: later readers need not ask the process table
        assert _ended_in_store(project, first)["ended_at"] is not None
        logs = _monarch(project, "logs", first, "--json")
        assert "ended without a result" in json.loads(logs.stdout)["ended"], logs.stdout

        # the dashboard, first to look at another killed run: its list shows it ended
        second = _start_and_kill(project)
        from monarch_cli.dashboard.views import Views

        shown = {r["run_id"]: r for r in Views(project / ".monarch" / "job_state.pkl").runs()}
        assert shown[second]["ended_at"] is not None and shown[second]["exit_code"] is None, shown[second]
        follow = _monarch(project, "logs", second, "--follow")  # ends, instead of following for ever
        assert follow.returncode != 0 and "ended without a result" in follow.stderr, follow.stderr
    finally:
        stopped = _monarch(project, "stop")
        assert stopped.returncode == 0, stopped.stderr


def _other_hosts_run(state: Path) -> Path:
    """A run's log directory as a client on another host writes it (a shared state directory)."""
    log = state / "logs" / "20261128-000000000-abcd"
    log.mkdir(parents=True)
    record = {"pid": 4242, "start": "boot:1", "host": "node-7", "state": run_owner.RUNNING}
    (log / run_owner.RUNNER_FILE).write_text(json.dumps(record))
    return log


def test_a_run_whose_client_on_another_host_stopped_renewing_is_lost_here(tmp_path: Path) -> None:
    """A reader on the login node cannot look up a compute node's pid: the record's lease decides."""
    log = _other_hosts_run(tmp_path / ".monarch")
    assert run_owner.settle(log, tmp_path / ".monarch")["state"] == run_owner.RUNNING  # renewed just now
    stale = time.time() - run_owner.LEASE_S - 5
    os.utime(log / run_owner.RUNNER_FILE, (stale, stale))
    lost = run_owner.settle(log, tmp_path / ".monarch")
    assert lost is not None and lost["state"] == run_owner.LOST and "on node-7" in lost["error"], lost
    assert json.loads((log / run_owner.RUNNER_FILE).read_text())["state"] == run_owner.LOST  # for every later reader


def test_a_running_client_renews_its_lease_until_the_result(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(run_owner, "RENEW_S", 0.05)
    log = tmp_path / "run"
    log.mkdir()
    run_owner.claim(log)
    record = log / run_owner.RUNNER_FILE
    first = record.stat().st_mtime_ns
    deadline = time.monotonic() + 30
    while record.stat().st_mtime_ns == first:
        assert time.monotonic() < deadline, "the runner never renewed its lease"
        time.sleep(0.01)
    (log / run_owner.RESULT_FILE).write_text("{}")
    renewers = [t for t in threading.enumerate() if t.name == "monarch-run-lease"]
    for t in renewers:
        t.join(timeout=30)
    assert not any(t.is_alive() for t in renewers), "the lease outlived the run's result"
