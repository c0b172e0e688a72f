"""Telemetry on a real 2-node Slurm reservation: stacks captured by the agents on both
nodes, diagnose naming the stuck rank, rows in the store (the client's side, on the login host)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from ..conftest import write_script
from .conftest import Served, clean_env, wait_for

pytestmark = [pytest.mark.slow, pytest.mark.slurm, pytest.mark.timeout(900)]

HANG = """
    import os, sys, time, torch.distributed as dist
    dist.init_process_group("gloo")
    def stuck_in_data_loader(flag):
        while not os.access(flag, os.F_OK):  # a C call: a sampled stack has this function innermost
            time.sleep(0.02)
    print(f"ready {dist.get_rank()}", flush=True)
    if dist.get_rank() == 3:
        stuck_in_data_loader(sys.argv[1])
    dist.barrier()
    dist.destroy_process_group()
"""


def test_stack_diagnose_and_sql_on_slurm(slurm_cluster, tmp_path):
    script = write_script(tmp_path, "hang.py", HANG)
    flag = tmp_path / "release"
    job = Served(tmp_path, tmp_path / ".monarch" / "job_state.pkl")
    run = None
    try:
        served = job(
            "serve",
            "--scheduler",
            "slurm",
            "--nodes",
            "2",
            "--time",
            "30",
            "--",
            "torchrun",
            "--nproc-per-node=2",
            str(script),
            str(flag),
        )
        assert served.returncode == 0, served.stderr
        run = subprocess.Popen(
            [sys.executable, "-m", "monarch_cli", "run-spmd", "--state", str(job.state)],
            cwd=tmp_path,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=clean_env(),
            stdin=subprocess.DEVNULL,
        )

        def ready() -> bool:
            if run.poll() is not None:
                raise AssertionError(f"the run ended early: {run.stdout.read()} {run.stderr.read()}")
            done = job("sql", "--json", "SELECT count(*) AS n FROM logs WHERE line LIKE 'ready %'")
            return done.returncode == 0 and json.loads(done.stdout)[0]["n"] == 4

        wait_for(ready, 120, "4 ranks to print ready")
        stack = job("stack", "--json")
        assert stack.returncode == 0, stack.stderr
        report = json.loads(stack.stdout)
        assert [g["ranks"] for g in report["groups"]] == [[0, 1, 2], [3]], report["groups"]
        assert {r["host"] for r in report["ranks"]} == set(slurm_cluster[:2])
        diag = job("diagnose", "--json")
        assert diag.returncode == 1, diag.stdout + diag.stderr
        assert [s["rank"] for s in json.loads(diag.stdout)["suspects"]] == [3]
        hosts = job("sql", "--json", "SELECT DISTINCT host FROM ranks ORDER BY host")
        assert [h["host"] for h in json.loads(hosts.stdout)] == sorted(slurm_cluster[:2])
    finally:
        flag.write_text("")
        if run is not None:
            try:
                run.wait(120)
            except subprocess.TimeoutExpired:
                run.kill()
        job("stop")
    assert run.returncode == 0, run.stdout.read() + run.stderr.read()
