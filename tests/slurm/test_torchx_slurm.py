"""``--scheduler torchx:slurm``: torchx's own Slurm scheduler against the real test cluster.

torchx writes and submits the sbatch script (one heterogeneous job, one ``srun`` per replica);
we find the replicas' nodes through torchx's describe and the agents on their fixed ports.
"""

from __future__ import annotations

import json

import pytest

from ..conftest import write_script
from .conftest import ALLREDUCE, monarch, slurm, wait_for

pytestmark = [pytest.mark.slow, pytest.mark.slurm, pytest.mark.timeout(1200)]


def _our_jobs() -> list[str]:
    return [line for line in slurm("squeue", "-h", "-o", "%i %j").splitlines() if "monarch-agent" in line]


def test_torchx_slurm_serve_run_rerun_stop_leaves_squeue_empty(slurm_cluster, tmp_path) -> None:
    write_script(tmp_path, "allreduce.py", ALLREDUCE)
    state = str(tmp_path / ".monarch" / "job_state.pkl")
    served = monarch(
        "serve", "--scheduler", "torchx:slurm", "--hosts", "2", "--state", state, "--json", "--time", "10",
        "--", "torchrun", "--nproc-per-node=1", "allreduce.py", cwd=tmp_path, timeout=600,
    )  # fmt: skip
    assert served.returncode == 0, served.stderr
    try:
        info = json.loads(served.stdout)
        assert sorted(h["name"] for h in info["hosts"]) == slurm_cluster[:2]  # torchx describe's node names
        for attempt in range(2):
            run = monarch("run-spmd", "--state", state, "--no-color", cwd=tmp_path, timeout=600)
            assert run.returncode == 0, (attempt, run.stderr)
            sums = sorted(line for line in run.stdout.splitlines() if " sum " in line)
            assert len(sums) == 2 and all(line.endswith("sum 3") for line in sums), run.stdout
            assert {line.split()[6] for line in sums} == set(slurm_cluster[:2])  # one rank on each node
        status = json.loads(monarch("status", "--state", state, "--json", cwd=tmp_path).stdout)
        assert status["torchx"]["app_handle"].startswith("slurm://") and status["torchx"]["state"] == "RUNNING"
        assert _our_jobs()
    finally:
        stopped = monarch("stop", "--state", state, cwd=tmp_path, timeout=300)
    assert stopped.returncode == 0, stopped.stderr
    wait_for(lambda: not _our_jobs(), 120, "squeue to be empty of the reservation's torchx job")
