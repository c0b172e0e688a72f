"""Many ranks on one host: the agent and its fork server must not deadlock on their socket pair."""

from __future__ import annotations

import gc
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from monarch_cli.jobs import Job, serve

from .conftest import spmd

pytestmark = pytest.mark.slow

RANKS = 256


@pytest.fixture(scope="module")
def one_host(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Job]:
    j = serve(None, hosts=1, state=tmp_path_factory.mktemp("many") / ".monarch" / "job_state.pkl")
    yield j
    j.stop()


def test_256_ranks_on_one_host_run_and_the_reservation_survives(one_host: Job, tmp_path: Path) -> None:
    script = tmp_path / "hello.py"
    script.write_text("import os\nprint('hello from', os.environ['RANK'], flush=True)\n")
    _collector_given_back()  # (by an earlier test's runs)
    thresholds = gc.get_threshold()
    for _ in range(2):  # the second run proves the agent still answers after the first
        run = spmd(one_host, script, nproc=RANKS)
        assert run.result.exit_code == 0 and [e.exitcode for e in run.result.ranks] == [0] * RANKS, run.text()[-2000:]
        said = {line.split()[-1] for line in run.lines() if b"hello from" in line}
        assert said == {str(r).encode() for r in range(RANKS)}
    assert one_host.status()["hosts"][0]["warm"] is not None
    # A run collects less often while it is in progress (jobs/spmd.py): the process gets its
    # collector back as it was a few seconds after the last run ends.
    _collector_given_back()
    assert gc.get_threshold() == thresholds and gc.get_freeze_count() == 0


def _collector_given_back() -> None:
    deadline = time.monotonic() + 60
    while gc.get_freeze_count() and time.monotonic() < deadline:
        time.sleep(0.1)
