"""``run-spmd --keep-ranks``: ranks run in the same processes run after run, and each run still
starts from what a fresh interpreter would give it; a run that leaves what cannot be reset is not
kept (one line says why); a compiled script is not compiled again."""

from __future__ import annotations

import io
import re
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from monarch_cli.jobs import Job, serve

from ..conftest import write_script
from .conftest import Run, spmd

pytestmark = pytest.mark.slow

HELPER = "VALUE = {value}\nCOUNT = 0\n\ndef bump():\n    global COUNT\n    COUNT += 1\n    return COUNT\n"

#: Prints the state a run starts with, then changes every piece of it.
STATE = """
import atexit, logging, os, random, sys, warnings
import torch, torch.distributed as dist
from accelerate.state import PartialState
import helper

G = globals().get("G", 0) + 1
print("state " + " ".join([
    f"pid={os.getpid()}",
    f"G={G}",
    f"helper={helper.VALUE}/{helper.bump()}",
    f"dist={dist.is_initialized()}",
    f"handlers={len(logging.getLogger().handlers)}",
    f"level={logging.getLogger().level}",
    f"partial={PartialState._shared_state != {}}",
    f"seeded={random.random() == random.Random(1234).random()}",
    f"leak={'LEAK' in os.environ}",
    f"warnings_error={any(f[0] == 'error' for f in warnings.filters)}",
]), flush=True)
dist.init_process_group("gloo")
t = torch.ones(1) * (dist.get_rank() + 1)
dist.all_reduce(t)
PartialState()
logging.basicConfig(level=logging.DEBUG)
warnings.simplefilter("error")
os.environ["LEAK"] = "1"
random.seed(1234)
atexit.register(lambda: print("atexit ran", flush=True))
print("sum", t.item(), flush=True)
"""


@pytest.fixture
def job(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Job]:
    monkeypatch.setenv("MONARCH_LEARN_PRELOAD", "1")
    # Importing torch._dynamo in this process (other tests do) exports torch's default cache dir,
    # which the ranks would then get as the user's choice.
    monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR", raising=False)
    monkeypatch.delenv("TRITON_CACHE_DIR", raising=False)
    monkeypatch.chdir(tmp_path)
    job = serve(None, hosts=1, state=tmp_path / ".monarch" / "job_state.pkl")
    try:
        yield job
    finally:
        job.stop()


def _run(job: Job, script: Path, keep: bool, nproc: int = 2) -> Run:
    if not keep:
        return spmd(job, script, nproc=nproc)
    out, err = io.BytesIO(), io.BytesIO()
    started = time.monotonic()
    result = job.run_spmd(
        ["torchrun", f"--nproc-per-node={nproc}", str(script)], keep_ranks=True, stdout=out, stderr=err
    )
    return Run(result, out.getvalue(), err.getvalue(), time.monotonic() - started)


def states(run: Run) -> dict[str, dict[str, str]]:
    found = re.findall(r"\[(rank\d)\] state (.*)", run.text())
    return {rank: dict(kv.split("=", 1) for kv in line.split()) for rank, line in found}


def test_kept_ranks_run_again_in_the_same_processes_with_everything_reset(job: Job, tmp_path: Path) -> None:
    script = write_script(tmp_path, "state.py", STATE)
    helper = write_script(tmp_path, "helper.py", HELPER.format(value=1))
    seen = []
    for attempt in range(3):
        if attempt == 2:
            helper.write_text(HELPER.format(value=2))  # an edit takes effect in a kept rank
        run = _run(job, script, keep=True)
        assert run.result.exit_code == 0, run.text()
        assert run.text().count("sum 3.0") == 2 and run.text().count("atexit ran") == 2, run.text()
        seen.append(states(run))
    fresh = {"G": "1", "dist": "False", "handlers": "0", "level": "30", "partial": "False", "seeded": "False"}
    for attempt, by_rank in enumerate(seen):
        assert sorted(by_rank) == ["rank0", "rank1"], seen
        for rank, state in by_rank.items():
            assert {k: state[k] for k in fresh} == fresh, (attempt, rank, state)
            assert state["leak"] == "False" and state["warnings_error"] == "False", (attempt, rank, state)
            assert state["helper"] == ("2/1" if attempt == 2 else "1/1"), (attempt, rank, state)
            assert state["pid"] == seen[0][rank]["pid"], "not the same process: the rank was not kept"
    # A run that does not keep ranks gets fresh ones (a kept process is not a fresh fork).
    plain = _run(job, script, keep=False)
    assert plain.result.exit_code == 0, plain.text()
    assert {s["pid"] for s in states(plain).values()}.isdisjoint({s["pid"] for s in seen[0].values()})


LEAVES_A_THREAD = """
import os, threading, time
print("pid", os.getpid(), flush=True)
def spin():
    while True:
        time.sleep(0.05)
if os.environ.get("LEAVE") == "thread":
    threading.Thread(target=spin, name="spinner", daemon=True).start()
"""

CHANGES_PATH = """
import os, sys
print("pid", os.getpid(), flush=True)
sys.path.append(os.path.join(os.getcwd(), "extra"))
"""


def _pids(run: Run) -> set[str]:
    return set(re.findall(r"\] pid (\d+)", run.text()))


@pytest.mark.parametrize(
    ("script", "why"),
    [
        (LEAVES_A_THREAD, "a thread it started (spinner) is still running"),
        (CHANGES_PATH, "it changed sys.path"),
    ],
    ids=["thread", "sys.path"],
)
def test_a_run_that_leaves_what_cannot_be_reset_is_not_kept(
    job: Job, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, script: str, why: str
) -> None:
    monkeypatch.setenv("LEAVE", "thread")
    path = write_script(tmp_path, "leave.py", script)
    first = _run(job, path, keep=True, nproc=1)
    assert first.result.exit_code == 0, first.text()
    assert f"monarch: rank 0 is not kept for the next run: {why}" in first.text(), first.text()
    second = _run(job, path, keep=True, nproc=1)
    assert second.result.exit_code == 0 and _pids(second).isdisjoint(_pids(first)), second.text()


COMPILED = """
import time, torch
from torch._dynamo.utils import counters
started = time.perf_counter()

def f(x):
    return torch.sin(x) * 2 + x.cos()

y = torch.compile(f)(torch.arange(16, dtype=torch.float32))
print("graphs", counters["stats"]["unique_graphs"], "sum %.6f" % y.sum().item(), flush=True)
"""


def test_a_compiled_script_is_not_compiled_again_in_a_kept_rank(job: Job, tmp_path: Path) -> None:
    script = write_script(tmp_path, "compiled.py", COMPILED)
    runs = [_run(job, script, keep=True, nproc=1) for _ in range(3)]
    for run in runs:
        assert run.result.exit_code == 0, run.text()
    lines = [re.findall(r"graphs (\d+) sum (\S+)", run.text()) for run in runs]
    # One graph compiled in run 1; the kept rank's next runs find it (the count would grow with a
    # recompile), and compute the same.
    assert lines[0] == lines[1] == lines[2] == [("1", lines[0][0][1])], lines


CACHE_HIT = """
import os, stat, torch
from torch._dynamo.utils import counters

def f(x):
    return torch.sin(x) * 3 + x.cos()

torch.compile(f)(torch.arange(16, dtype=torch.float32))
cache = os.environ["TORCHINDUCTOR_CACHE_DIR"]
mode = stat.S_IMODE(os.stat(os.path.dirname(cache)).st_mode)
print("cache", os.path.basename(os.path.dirname(cache)).split("-")[1], oct(mode),
      "hits", counters["inductor"]["fxgraph_cache_hit"], flush=True)
"""


def test_fresh_ranks_share_one_private_compile_cache_per_reservation(job: Job, tmp_path: Path) -> None:
    """Without --keep-ranks, torch.compile's on-disk caches sit in one private directory of the
    reservation's, so a second fresh run of a compiled script finds what the first compiled."""
    script = write_script(tmp_path, "cached.py", CACHE_HIT)
    runs = [spmd(job, script, nproc=1) for _ in range(2)]
    lines = [re.findall(r"cache (\S+) (\S+) hits (\d+)", run.text()) for run in runs]
    assert all(run.result.exit_code == 0 for run in runs), [run.text() for run in runs]
    assert lines[0][0][:2] == lines[1][0][:2] == ("compile", "0o700"), lines
    assert lines[0][0][2] == "0" and int(lines[1][0][2]) >= 1, lines  # run 2 hit what run 1 compiled
