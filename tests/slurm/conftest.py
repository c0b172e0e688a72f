"""A real Slurm cluster for these tests, started by ``scripts/slurm-cluster.sh`` (nothing mocked).

The session fixture installs Slurm with apt when it is missing and starts a 2-node cluster
(each node a slurmd in its own network namespace, see docs/slurm.md). If that is not
possible, every test here FAILS with the script's message: a machine that cannot run
these tests must not pass them by skipping. Set MONARCH_KEEP_SLURM=1 to leave a cluster
that this session started running afterwards.
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from ..conftest import REPO, wait_until

SCRIPT = REPO / "scripts" / "slurm-cluster.sh"
NODES = 2


@pytest.fixture(scope="session")
def slurm_cluster() -> Iterator[list[str]]:
    """The test cluster's node names, once every node is idle."""
    if os.geteuid() != 0:
        pytest.fail(
            "the Slurm tests need root: they install Slurm (apt) and start a test cluster "
            "with network namespaces (scripts/slurm-cluster.sh)",
            pytrace=False,
        )
    was_up = subprocess.run(["bash", str(SCRIPT), "status"], capture_output=True, text=True).returncode == 0
    started = subprocess.run(["bash", str(SCRIPT), "start", str(NODES)], capture_output=True, text=True, timeout=1500)
    if started.returncode != 0:
        pytest.fail(
            f"could not start the Slurm test cluster with {SCRIPT.name} start: "
            f"{(started.stderr or started.stdout).strip()[-3000:]}",
            pytrace=False,
        )
    nodes = subprocess.run(["sinfo", "-h", "-N", "-p", "debug", "-o", "%N"], capture_output=True, text=True)
    names = sorted(set(nodes.stdout.split()))
    if len(names) < NODES:
        pytest.fail(f"the Slurm test cluster has {names}, expected {NODES} nodes", pytrace=False)
    yield names
    if not was_up and not os.environ.get("MONARCH_KEEP_SLURM"):
        subprocess.run(["bash", str(SCRIPT), "stop"], capture_output=True, timeout=120)


def clean_env(**extra: str) -> dict[str, str]:
    """This environment without any Slurm job context (the tests run outside allocations)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "MONARCH_"))}
    env.update(extra)
    env["PYTHONPATH"] = str(REPO)
    env["NO_COLOR"] = "1"
    return env


def monarch(
    *args: str, cwd: Path, timeout: float = 180, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess:
    """The real CLI in a subprocess, as a user runs it."""
    return subprocess.run(
        [sys.executable, "-m", "monarch_cli", *args],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env or clean_env(),
        stdin=subprocess.DEVNULL,
    )


def slurm(*args: str, check: bool = True) -> str:
    done = subprocess.run(list(args), capture_output=True, text=True, timeout=60)
    if check:
        assert done.returncode == 0, f"{args}: {done.stderr}"
    return done.stdout


def job_state(job_id: str) -> str:
    return slurm("squeue", "-h", "-t", "all", "-j", job_id, "-o", "%T", check=False).strip()


def wait_for(predicate, timeout: float, what: str, interval: float = 0.25) -> None:
    assert wait_until(predicate, timeout, interval), f"timed out after {timeout} s waiting for {what}"


@dataclasses.dataclass
class Served:
    """A `monarch serve --scheduler slurm` reservation made through the CLI."""

    cwd: Path
    state: Path

    def __call__(self, *args: str, timeout: float = 180) -> subprocess.CompletedProcess:
        return monarch(args[0], "--state", str(self.state), *args[1:], cwd=self.cwd, timeout=timeout)

    def status(self) -> dict:
        done = monarch("status", "--json", "--state", str(self.state), cwd=self.cwd)
        return json.loads(done.stdout)


ALLREDUCE = """
    import os, socket, torch, torch.distributed as dist
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    t = torch.tensor([float(rank + 1)])
    dist.all_reduce(t)
    print(f"rank {rank}/{world} node {os.environ['GROUP_RANK']} host {socket.gethostname()} sum {int(t.item())}",
          flush=True)
    dist.destroy_process_group()
"""
