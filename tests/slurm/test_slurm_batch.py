"""`monarch sbatch` on a real 2-node Slurm cluster: unattended runs, exit status, signals, status/logs."""

from __future__ import annotations

import json
import re
import time
from pathlib import Path

import pytest

from ..conftest import write_script
from .conftest import ALLREDUCE, Served, job_state, slurm, wait_for

pytestmark = [pytest.mark.slow, pytest.mark.slurm, pytest.mark.timeout(1800)]

FAILING = """
    import os, sys
    rank = int(os.environ["RANK"])
    print(f"rank {rank} of {os.environ['WORLD_SIZE']} says hello", flush=True)
    sys.exit(3 if rank == 2 else 0)
"""

CHECKPOINT = """
    import os, signal, sys, time
    rank = int(os.environ["RANK"])
    got = []
    signal.signal(signal.SIGUSR1, lambda s, f: got.append(s))
    print(f"rank {rank} ready", flush=True)
    deadline = time.time() + 120
    while not got and time.time() < deadline:
        time.sleep(0.05)
    print(f"rank {rank} got {'SIGUSR1' if got else 'nothing'}: checkpointing", flush=True)
    sys.exit(0 if got else 1)
"""


def test_batch_exit_status_is_the_runs_and_status_logs_find_the_job(slurm_cluster, tmp_path):
    job = Served(tmp_path, tmp_path / ".monarch" / "job_state.pkl")
    ok_script = write_script(tmp_path, "allreduce.py", ALLREDUCE)
    ok = job(
        "sbatch", "-N", "2", "--time=10", "--wait", "--", "torchrun", "--nproc-per-node=2", str(ok_script), timeout=600
    )
    assert ok.returncode == 0, ok.stdout + ok.stderr
    ok_id = ok.stdout.strip()
    assert ok_id.isdigit(), ok.stdout
    output = (tmp_path / f"slurm-{ok_id}.out").read_text()
    sums = sorted(l for l in output.splitlines() if " sum " in l)
    assert [l.split()[0] for l in sums] == ["[rank0]", "[rank1]", "[rank2]", "[rank3]"], output
    assert all(l.endswith("sum 10") for l in sums) and {l.split()[6] for l in sums} == set(slurm_cluster[:2])

    bad_script = write_script(tmp_path, "fail.py", FAILING)
    bad = job("sbatch", "-N", "2", "--wait", "--", "torchrun", "--nproc-per-node=2", str(bad_script), timeout=600)
    assert bad.returncode == 3, bad.stdout + bad.stderr
    bad_id = bad.stdout.strip()
    assert "ExitCode=3:0" in slurm("scontrol", "show", "job", bad_id)

    status = job("status", "--job", bad_id, "--json")
    info = json.loads(status.stdout)
    assert status.returncode == 1 and info["phase"] == "finished" and info["exit_code"] == 3
    assert info["first_failure"] == 2 and info["slurm"]["state"] == "FAILED"
    human = job("status", "--job", bad_id)
    assert "exit 3" in human.stdout and "rank 2 failed first" in human.stdout, human.stdout
    assert job("status", "--job", ok_id).returncode == 0

    rank2 = job("logs", "--job", bad_id, "--rank", "2")  # rank 0 may also have a c10d DNS warning
    assert rank2.returncode == 0 and rank2.stdout == "rank 2 of 4 says hello\n"
    every = job("logs", "--job", bad_id)
    lines = sorted(l for l in every.stdout.splitlines() if "[c10d]" not in l)  # see docs/slurm.md, test cluster
    assert lines[0] == "[rank0] rank 0 of 4 says hello" and len(lines) == 4, every.stdout
    unknown = job("status", "--job", "999999")
    assert unknown.returncode != 0 and "no monarch batch job 999999" in unknown.stderr


def _submit_and_wait_ready(job: Served, script: Path) -> str:
    sub = job("sbatch", "-N", "2", "--time=10", "--", "torchrun", "--nproc-per-node=2", str(script))
    assert sub.returncode == 0, sub.stderr
    job_id = sub.stdout.strip()
    out = job.cwd / f"slurm-{job_id}.out"
    wait_for(
        lambda: out.exists() and all(f"rank {r} ready" in out.read_text() for r in range(4)),
        180,
        f"the ranks of job {job_id} to be ready",
    )
    return job_id


@pytest.mark.parametrize("how", ["batch-shell", "all-steps"])
def test_slurm_signal_reaches_every_rank(slurm_cluster, tmp_path, how):
    """`--signal=B:USR1@T` signals the batch shell (monarch relays it); without B:, Slurm signals the steps."""
    job = Served(tmp_path, tmp_path / ".monarch" / "job_state.pkl")
    job_id = _submit_and_wait_ready(job, write_script(tmp_path, "ckpt.py", CHECKPOINT))
    started = time.monotonic()
    slurm("scancel", "--signal=USR1", *(["--batch"] if how == "batch-shell" else []), job_id)
    wait_for(lambda: job_state(job_id) in ("COMPLETED", "FAILED"), 120, f"job {job_id} to end")
    output = (tmp_path / f"slurm-{job_id}.out").read_text()
    assert job_state(job_id) == "COMPLETED", output
    for rank in range(4):
        assert re.search(rf"^\[rank{rank}\]\s+rank {rank} got SIGUSR1: checkpointing$", output, re.M), output
    assert time.monotonic() - started < 60


def test_status_of_a_pending_batch_job_and_of_no_job(slurm_cluster, tmp_path):
    job = Served(tmp_path, tmp_path / ".monarch" / "job_state.pkl")
    sub = job("sbatch", "-N", "1", "--begin=now+600", "--", "python", "never_runs.py")
    assert sub.returncode == 0, sub.stderr
    job_id = sub.stdout.strip()
    try:
        info = json.loads(job("status", "--job", job_id, "--json").stdout)
        assert info["alive"] and info["slurm"]["state"] == "PENDING" and info["slurm"]["reason"] == "BeginTime"
        human = job("status", "--job", job_id)
        assert human.returncode == 0 and "not started" in human.stdout and "PENDING (BeginTime)" in human.stdout
    finally:
        slurm("scancel", job_id)
    bad = job("logs", "--job", "abc")
    assert bad.returncode != 0 and "a Slurm job id" in bad.stderr and "Traceback" not in bad.stderr
