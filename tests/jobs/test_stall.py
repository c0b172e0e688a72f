"""The progress watchdog (issue 21, item 3): ranks that stop making progress while their hosts answer.

A real hung collective: two ranks on two local hosts join gloo, then rank 1 stops itself
(SIGSTOP); rank 0 waits in all_reduce, which gloo would let run for 30 minutes. Every agent
still answers its heartbeats, so only the absence of output and steps tells.
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from monarch_cli.errors import OptionError
from monarch_cli.jobs import Job

from ..conftest import write_script
from .conftest import spmd

pytestmark = pytest.mark.slow

HUNG = """
import os, signal, torch, torch.distributed as dist
dist.init_process_group("gloo")
print("up", flush=True)
if dist.get_rank() == 1:
    os.kill(os.getpid(), signal.SIGSTOP)  # a stopped peer
dist.all_reduce(torch.zeros(1))  # rank 0 waits here
print("never", flush=True)
"""

BUSY = """
import time
for i in range(8):
    print("step", i, flush=True)
    time.sleep(0.5)
"""


def test_a_hung_collective_ends_the_run_with_one_line_and_diagnose_says_suspect(job: Job, tmp_path: Path) -> None:
    script = write_script(tmp_path, "hung.py", HUNG)
    started = time.monotonic()
    run = spmd(job, script, nproc=1, flags=["--max-restarts=0"], grace=1.0, stall_timeout=3.0)
    took = time.monotonic() - started
    result = run.result
    assert result.exit_code != 0 and b"never" not in run.out, run.text()
    assert result.ending.startswith("stalled: no output and no step from any rank for 3 s while every host answered")
    assert result.ending.endswith("; ranks stopped"), result.ending
    assert took < 60, took  # not gloo's 30 minutes
    d = job.diagnose()
    assert (d.verdict, d.exit_code, d.run_id) == ("suspect", 1, result.run_id), d
    assert d.summary.startswith("stalled: no output"), d


def test_ranks_that_print_are_not_stalled_and_the_watchdog_is_off_by_default(
    job: Job, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    busy = write_script(tmp_path, "busy.py", BUSY)
    run = spmd(job, busy, nproc=1, stall_timeout=2.0)  # 4 s of work, a line every 0.5 s
    assert run.result.exit_code == 0 and run.result.ending == "", run.text()
    quiet = write_script(tmp_path, "quiet.py", "import time\ntime.sleep(3)\nprint('loaded', flush=True)\n")
    run = spmd(job, quiet, nproc=1)  # silent for 3 s: no limit unless one is asked for
    assert run.result.exit_code == 0 and b"loaded" in run.out, run.text()
    monkeypatch.setenv("MONARCH_STALL_TIMEOUT", "soon")
    with pytest.raises(OptionError, match=r"^MONARCH_STALL_TIMEOUT: expected a number of seconds, got 'soon'$"):
        spmd(job, quiet, nproc=1)
