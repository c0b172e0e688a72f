"""Smaller things a careless user hit (issue 21, item 10), each on a real local reservation."""

from __future__ import annotations

import math
import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from monarch_cli.jobs import Job, JobError

from ..conftest import write_script
from .conftest import spmd


def test_a_fifo_as_the_state_file_is_refused_not_waited_on(tmp_path: Path) -> None:
    fifo = tmp_path / "s.pkl"
    os.mkfifo(fifo)
    done = subprocess.run(
        [sys.executable, "-m", "monarch_cli", "status", "--state", str(fifo)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 2
    assert (
        done.stderr == f"monarch: error: job state path {fifo} is not a regular file; point --state at a state file\n"
    )


def test_straggler_grace_must_be_a_number_of_seconds(job: Job) -> None:
    for bad in (math.nan, -1.0):
        with pytest.raises(JobError, match="--straggler-grace takes seconds"):
            job.run_spmd(["python", "-c", "pass"], straggler_grace=bad)


def test_local_state_dir_agents_dir_and_agent_logs_are_private(job: Job) -> None:
    state_dir = job.path.parent
    for d in (state_dir, state_dir / "agents"):
        assert stat.S_IMODE(d.stat().st_mode) == 0o700, d
    logs = list((state_dir / "agents").glob("*.log"))
    assert logs and all(stat.S_IMODE(p.stat().st_mode) == 0o600 for p in logs)


def test_an_elastic_node_range_runs_on_the_hosts_reserved(job: Job, tmp_path: Path) -> None:
    script = write_script(tmp_path, "w.py", "import os\nprint(os.environ['WORLD_SIZE'], os.environ['GROUP_RANK'])\n")
    run = spmd(job, script, nproc=1, flags=["--nnodes=1:4"])
    assert run.result.exit_code == 0, run.text()
    assert sorted(run.lines()) == [b"[rank0] 2 0", b"[rank1] 2 1"]
    with pytest.raises(JobError, match="needs at least 3 hosts; 2 are reserved"):
        spmd(job, script, nproc=1, flags=["--nnodes=3:4"])
