"""The telemetry store keeps a bounded sample of a chatty run's lines; the rank logs keep them all."""

from __future__ import annotations

import sqlite3
from pathlib import Path

import pytest

from monarch_cli.jobs import Job
from monarch_cli.telemetry import db_path

from ..conftest import write_script
from .conftest import spmd


def test_a_chatty_run_stores_its_first_and_last_lines_only(
    job: Job, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("MONARCH_TELEMETRY_LINES", "1000")
    script = write_script(
        tmp_path,
        "chatty.py",
        """
        import os, sys
        rank = int(os.environ["RANK"])
        out = sys.stdout
        for i in range(100_000):
            out.write(f"rank {rank} line {i}\\n")
        out.write("x" * 5_000_000)  # one huge line, no newline
        out.flush()
        """,
    )
    run = spmd(job, script, nproc=1)
    assert run.result.exit_code == 0
    for rank in range(2):  # the rank logs keep everything
        assert run.log(rank).count(b"\n") >= 100_000
    conn = sqlite3.connect(db_path(job.path.parent))
    try:
        rows = conn.execute(
            "SELECT rank, line FROM logs WHERE run_id = ? ORDER BY rowid", (run.result.run_id,)
        ).fetchall()
        (left_out,) = conn.execute(
            "SELECT detail FROM events WHERE run_id = ? AND kind = 'lines_left_out'", (run.result.run_id,)
        ).fetchone()
        (lines,) = conn.execute("SELECT sum(lines) FROM ranks WHERE run_id = ?", (run.result.run_id,)).fetchone()
    finally:
        conn.close()
    assert len(rows) == 1000
    first = [line for _, line in rows[:500]]
    assert all(line.startswith("rank ") for line in first) and {f"rank {r} line 0" for r in (0, 1)} & set(first)
    last = [line for _, line in rows[500:]]
    huge = [line for line in last if line.startswith("xxx")]
    assert len(huge) == 2, last[-5:]
    assert all(len(line) == 4097 and line.endswith("…") for line in huge)
    assert {f"rank {r} line 99999" for r in (0, 1)} <= set(last)
    assert left_out == f"{200_002 - 1000} lines in the rank logs only" and lines == 200_002
