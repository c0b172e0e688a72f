"""Smaller things a careless user hit (issue 21, item 10), each on a real local reservation."""

from __future__ import annotations

import io
import math
import os
import signal
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from monarch_cli.jobs import Job, JobError, serve

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


def test_reading_a_state_file_in_a_missing_directory_creates_nothing(tmp_path: Path) -> None:
    state = tmp_path / "missing" / "dir" / "s.pkl"
    for command in (["status"], ["run-spmd", "--state", str(state), "--", "python", "-c", "pass"]):
        done = subprocess.run(
            [sys.executable, "-m", "monarch_cli", *command, *(["--state", str(state)] if len(command) == 1 else [])],
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert (
            done.returncode == 2
            and done.stderr == f"monarch: error: no reservation at {state}; start one with `monarch serve`\n"
        )
    assert not (tmp_path / "missing").exists()


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


@pytest.mark.slow
def test_a_dead_agents_run_is_the_lost_hosts_not_a_peers_gloo_error(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Host 1's agent is killed mid-run: rank 0 on host 0 fails at once in gloo ("connection closed by
    peer"), seconds before the heartbeat says host 1 is gone; the run is still headlined as host 1's."""
    from monarch_cli.cli.runs import render_result

    script = write_script(
        tmp_path,
        "loop.py",
        """
        import time, torch, torch.distributed as dist
        dist.init_process_group("gloo")
        print("up", flush=True)
        t = torch.zeros(1)
        while True:
            dist.all_reduce(t)
            time.sleep(0.05)
        """,
    )
    j = serve(None, hosts=2, state=tmp_path / ".monarch" / "s.pkl")
    try:

        class KillWhenUp(io.BytesIO):
            def write(self, data: bytes) -> int:  # type: ignore[override]
                n = super().write(data)
                if self.getvalue().count(b"up") >= 2 and not killed:
                    killed.append(j.state.hosts[1].pid)
                    os.kill(j.state.hosts[1].pid, signal.SIGKILL)
                return n

        killed: list[int] = []
        out = KillWhenUp()
        result = j.run_spmd(["torchrun", "--nproc-per-node=1", str(script)], stdout=out, stderr=out)
    finally:
        j.stop()
    text = out.getvalue().decode(errors="replace")
    assert killed, text
    assert "[rank0] Traceback" in text and "gloo" in text  # rank 0 did fail first, in gloo
    first = result.first_failure
    assert first is not None and first.host == "local1" and first.lost, result.ranks
    assert result.exit_code == 255
    capsys.readouterr()
    render_result(result)
    headline = capsys.readouterr().err.splitlines()[0]
    assert "host local1 stopped answering" in headline and "rank 0" not in headline, headline


def test_sbatch_scripts_and_batch_records_are_private(tmp_path: Path) -> None:
    """A batch script and its record name the command and its arguments: yours only (they were
    0644 in a directory made with the default mode)."""
    from monarch_cli.jobs import slurm_batch

    script = slurm_batch.write_batch_script(
        ["torchrun", "train.py", "--token-file", "x"], [], tmp_path / "job_state.pkl"
    )
    slurm_batch._write_json(tmp_path / "batch.json", {"command": ["train.py"]})
    assert stat.S_IMODE(script.stat().st_mode) == 0o600
    assert stat.S_IMODE(script.parent.stat().st_mode) == 0o700
    assert stat.S_IMODE((tmp_path / "batch.json").stat().st_mode) == 0o600
