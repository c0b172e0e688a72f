"""The first multi-host run of a reservation checks that every host reaches rank 0's rendezvous
port, and says which cannot in one line instead of a gloo timeout blamed on a rank."""

from __future__ import annotations

import io
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from monarch_cli.jobs import Job, JobError, serve

pytestmark = pytest.mark.slow

ALLREDUCE = (
    "import torch, torch.distributed as dist\n"
    "dist.init_process_group('gloo')\n"
    "t = torch.ones(1)\n"
    "dist.all_reduce(t)\n"
    "print('sum', int(t.item()), flush=True)\n"
    "dist.destroy_process_group()\n"
)


@pytest.fixture
def fresh_pair(tmp_path: Path) -> Iterator[Job]:
    j = serve(None, hosts=2, state=tmp_path / ".monarch" / "job_state.pkl")
    yield j
    j.stop()


def test_a_host_that_cannot_reach_the_rendezvous_port_is_named_before_any_rank_starts(
    fresh_pair: Job, tmp_path: Path
) -> None:
    script = tmp_path / "allreduce.py"
    script.write_text(ALLREDUCE)
    unroutable = "192.0.2.1"  # TEST-NET-1: no host answers there
    started = time.monotonic()
    with pytest.raises(JobError) as failed:
        fresh_pair.run_spmd(
            ["torchrun", "--nnodes=2", "--nproc-per-node=1", f"--master-addr={unroutable}", str(script)],
            stdout=io.BytesIO(),
            stderr=io.BytesIO(),
        )
    line = str(failed.value)
    assert "\n" not in line
    assert line.startswith(f"host local1 cannot reach local0's rendezvous port {unroutable}:"), line
    assert time.monotonic() - started < 60  # the probe's few seconds, not a rendezvous timeout

    # Nothing was left behind: the reservation runs the same script on its own address, and rank
    # 0's store takes the probe's connection in its stride.
    out = io.BytesIO()
    result = fresh_pair.run_spmd(
        ["torchrun", "--nnodes=2", "--nproc-per-node=1", str(script)], stdout=out, stderr=io.BytesIO()
    )
    assert result.exit_code == 0 and out.getvalue().count(b"sum 2") == 2, out.getvalue()
