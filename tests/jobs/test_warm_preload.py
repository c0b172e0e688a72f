"""Warm processes learn what ranks import: installed modules are preloaded for the next runs,
the user's workspace never is, offenders (a library that refuses forks, failing imports) are
left out quietly while a module that merely starts a thread is held (its fork trial passes), a
changed installed file means a fresh warm process, and ``--cold`` bypasses it all.

The "installed" packages live in a site directory on PYTHONPATH outside the workspace, as a
library checked out elsewhere would; each one writes a line to $WARM_MARKS when it is
imported, saying whether a rank or the warm process (no $RANK) imported it.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest

from monarch_cli.jobs import Job, serve

from ..conftest import write_script
from .conftest import spmd, wait_warm

pytestmark = pytest.mark.slow

MARK = """
import os
with open(os.environ["WARM_MARKS"], "a") as _f:
    _f.write("%s %s\\n" % (__name__, "rank" if "RANK" in os.environ else "warm"))
"""

SCRIPT = """
import warmmark, warmthread, warmrefuse, warmfail, wsmod
print("version", warmmark.VERSION, "threads ok", warmthread.STARTED)
"""
#: A library that refuses to be forked after it started its thread (as gRPC does without its
#: fork support): a child forked after it dies at once.
REFUSE = (
    "import threading, time\n"
    "threading.Thread(target=time.sleep, args=(3600,), daemon=True).start()\n"
    "if 'RANK' not in os.environ:\n"
    "    os.register_at_fork(after_in_child=lambda: os._exit(3))\n"
)


@pytest.fixture(scope="module")
def setup(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Job, Path, Path, Path]]:
    base = tmp_path_factory.mktemp("warm")
    site, work = base / "site", base / "work"
    write_script(site, "warmmark/__init__.py", MARK + "VERSION = 1\n")
    write_script(
        site,
        "warmthread.py",
        MARK + "import threading, time\n"
        "threading.Thread(target=time.sleep, args=(3600,), daemon=True).start()\nSTARTED = True\n",
    )
    write_script(site, "warmrefuse.py", MARK + REFUSE)
    write_script(site, "warmfail.py", MARK + "if 'RANK' not in os.environ:\n    raise ImportError('only in a rank')\n")
    write_script(work, "wsmod.py", MARK)
    write_script(work, "train.py", SCRIPT)
    marks = base / "marks.txt"
    with pytest.MonkeyPatch.context() as mp:
        # Agents and ranks share these (PYTHONPATH is read at start-up: it must match for warm runs).
        mp.setenv("PYTHONPATH", os.pathsep.join(filter(None, [os.environ.get("PYTHONPATH"), str(site)])))
        mp.setenv("WARM_MARKS", str(marks))
        mp.setenv("MONARCH_CACHE_DIR", str(base / "cache"))
        mp.setenv("MONARCH_LEARN_PRELOAD", "1")  # the default, whatever this environment says
        mp.chdir(work)
        job = serve(None, hosts=1, state=base / ".monarch" / "job_state.pkl")
        try:
            yield job, work, site, marks
        finally:
            job.stop()


def take_marks(marks: Path) -> list[str]:
    lines = marks.read_text().splitlines() if marks.exists() else []
    marks.write_text("")
    return lines


def run(job: Job, work: Path, cold: bool = False) -> tuple[str, list[str]]:
    notices: list[str] = []
    r = spmd(job, work / "train.py", nproc=2, cold=cold, notices=notices)
    assert r.result.exit_code == 0, r.text()
    return r.text(), notices


def test_installed_modules_are_preloaded_and_the_workspace_never(setup) -> None:
    job, work, site, marks = setup
    take_marks(marks)
    first, _ = run(job, work)
    everything = ["warmmark rank", "warmthread rank", "warmrefuse rank", "warmfail rank", "wsmod rank"]
    assert sorted(take_marks(marks)) == sorted(everything * 2)
    warm = wait_warm(job)[0]
    assert warm["learned_held"] > 0 and warm["modules"] > 0 and warm["rss_bytes"] > 0
    # A warm process imported warmmark and warmthread (whose thread did not stop a child forked
    # after it from working: held); warmrefuse's fork trial failed (that process was dropped
    # and a new one started without it) and warmfail failed, so both are left out and
    # recorded, each with why; nothing of the workspace came near it.
    zygote_marks = take_marks(marks)
    assert "warmmark warm" in zygote_marks and "warmrefuse warm" in zygote_marks, zygote_marks
    assert "wsmod warm" not in zygote_marks
    assert "warmthread" not in warm["excluded"], warm["excluded"]
    assert warm["excluded"]["warmrefuse"] == "it starts a thread, and a process forked after it exited with status 3"
    assert "fails to import" in warm["excluded"]["warmfail"]
    # The re-warmed process says what it is in ps, as the first one did.
    title = " ".join(psutil.Process(warm["pid"]).cmdline())
    assert title.startswith(f"monarch warm {job.state.reservation_id} host "), title

    second, notices = run(job, work)
    got = take_marks(marks)
    assert "warmmark rank" not in got, got  # it came with the fork
    assert sorted(got) == sorted(["warmrefuse rank", "warmfail rank", "wsmod rank"] * 2)  # imported as usual
    assert notices == []
    # The run says nothing about any of it: only the script's own output.
    assert second.count("version 1 threads ok True") == 2 and "warm" not in second.lower(), second


def test_a_changed_installed_module_means_a_fresh_warm_process(setup) -> None:
    job, work, site, marks = setup
    run(job, work)
    wait_warm(job)
    take_marks(marks)
    time.sleep(0.01)
    (site / "warmmark" / "__init__.py").write_text(MARK + "VERSION = 2\n")
    text, notices = run(job, work)
    assert "version 2" in text and "version 1" not in text, text
    assert len(notices) == 1 and "warmmark/__init__.py changed" in notices[0], notices
    assert "warmmark rank" in take_marks(marks)  # the fresh warm process did not hold the old one
    # ...and it learns again: the next runs preload the new version.
    wait_warm(job)
    take_marks(marks)
    text, notices = run(job, work)
    assert "version 2" in text and notices == [] and "warmmark rank" not in take_marks(marks)


def test_cold_bypasses_the_warm_process(setup) -> None:
    job, work, site, marks = setup
    run(job, work)
    wait_warm(job)
    take_marks(marks)
    run(job, work, cold=True)
    everything = ["warmmark rank", "warmthread rank", "warmrefuse rank", "warmfail rank", "wsmod rank"]
    assert sorted(take_marks(marks)) == sorted(everything * 2)


def test_forget_preload(setup) -> None:
    job, work, site, marks = setup
    run(job, work)
    wait_warm(job)
    forgotten = job.forget_preload()
    assert list(forgotten) == ["local0"] and forgotten["local0"] > 0
    warm = job.status()["hosts"][0]["warm"]
    assert warm["learned"] == 0 and warm["learned_held"] == 0 and warm["excluded"] == {}
    take_marks(marks)
    run(job, work)
    assert "warmmark rank" in take_marks(marks)


def test_warm_and_status_commands(setup) -> None:
    """`monarch status` shows each host's warm process; `monarch warm --json` details it,
    `monarch warm --forget --json` forgets what was learned."""
    import json
    import subprocess
    import sys

    job, work, site, marks = setup
    run(job, work)
    wait_warm(job)

    def monarch(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run(
            [sys.executable, "-m", "monarch_cli", *args, "--state", str(job.path)],
            capture_output=True,
            text=True,
            timeout=60,
            cwd=work,
        )

    status = monarch("status")
    assert status.returncode == 0 and "learned)" in status.stdout and "MiB" in status.stdout, status.stdout
    shown = json.loads(monarch("warm", "--json").stdout)["hosts"][0]
    assert shown["name"] == "local0" and shown["warm"]["learned_held"] > 0 and "warmrefuse" in shown["warm"]["excluded"]
    human = monarch("warm").stdout
    assert "left out: warmrefuse (it starts a thread, and a process forked after it exited with status 3)" in human, (
        human
    )
    forgot = monarch("warm", "--forget", "--json")
    assert forgot.returncode == 0 and json.loads(forgot.stdout)["forgotten"]["local0"] > 0, forgot.stderr


def test_what_was_learned_stays_with_its_reservation(setup, tmp_path: Path) -> None:
    """Learning is scoped: a new reservation elsewhere (another workspace, no served command)
    starts from the explicit preload only, not from what this one's runs taught its host."""
    job, work, site, marks = setup
    run(job, work)
    wait_warm(job)
    again = serve(None, hosts=1, state=tmp_path / ".monarch" / "job_state.pkl")
    try:
        assert again.wait_warm(60)
        warm = again.status()["hosts"][0]["warm"]
        assert warm["learned"] == 0 and warm["learned_held"] == 0, warm
    finally:
        again.stop()


def test_learning_can_be_turned_off(setup, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """With MONARCH_LEARN_PRELOAD=0 the warm process keeps the explicit preload only: a run
    teaches it nothing and nothing learned is loaded."""
    _, work, _, marks = setup
    monkeypatch.setenv("MONARCH_LEARN_PRELOAD", "0")
    plain = serve(None, hosts=1, state=tmp_path / ".monarch" / "job_state.pkl")
    try:
        take_marks(marks)
        run(plain, work)
        time.sleep(2)  # time enough for a re-warm, were one started
        warm = plain.status()["hosts"][0]["warm"]
        assert warm["learning"] is False and warm["learned_held"] == 0 and not warm["warming"], warm
        assert not [m for m in take_marks(marks) if m.endswith(" warm")]  # nothing imported warmmark
    finally:
        plain.stop()


DDP_TEARDOWN = """
import torch, torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

def main():
    dist.init_process_group("gloo")
    model = DDP(nn.Linear(8, 1))
    for _ in range(3):
        model(torch.randn(4, 8)).sum().backward()
    ref = torch.cat([p.detach().flatten() for p in model.parameters()]).clone()
    dist.broadcast(ref, src=0)
    dist.destroy_process_group()  # the model (its reducer holds the group) is freed on return

main()
print("clean exit", flush=True)
"""


@pytest.mark.slow
def test_ddp_scripts_that_destroy_the_group_before_the_model_exit_warm(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The common DDP ending (destroy the group, return, the model goes) hung in gloo's teardown
    in ~1 of 3 runs forked from a learned warm process (a torch race; see runtime/rank/start.py)."""
    monkeypatch.setenv("MONARCH_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setenv("MONARCH_LEARN_PRELOAD", "1")
    script = write_script(tmp_path, "ddp_end.py", DDP_TEARDOWN)
    job = serve(None, hosts=1, state=tmp_path / ".monarch" / "job_state.pkl")
    try:
        spmd(job, script)  # teaches the warm process DDP's imports
        wait_warm(job)
        for attempt in range(10):
            done = subprocess.run(
                [
                    sys.executable,
                    "-m",
                    "monarch_cli",
                    "run-spmd",
                    "--state",
                    str(job.path),
                    "--",
                    "torchrun",
                    "--nproc-per-node=2",
                    str(script),
                ],
                capture_output=True,
                text=True,
                timeout=60,
                cwd=tmp_path,
            )
            assert done.returncode == 0 and done.stdout.count("clean exit") == 2, (attempt, done.stdout, done.stderr)
    finally:
        job.stop()


SLOW_IN_WARM = """
import os, time
if "RANK" not in os.environ:  # the warm process that learned it takes a while to import it
    time.sleep(float(os.environ.get("SLOW_WARM_SECONDS", "0")))
"""


def test_a_run_asked_while_the_warm_process_learns_in_place_still_starts(tmp_path: Path) -> None:
    """Between runs the idle warm process imports what the last run taught it itself (8 s here);
    a run asked meanwhile queues its forks behind that import and starts once it is done, from
    the same process, which then holds the module. (The race this test once caught, ranks asked
    of a warm process being retired as the next became ready, needs a second process, which is
    now built only while ranks of the current one are alive: see the spares tests.)"""
    site, work = tmp_path / "site", tmp_path / "work"
    write_script(site, "slowwarm.py", SLOW_IN_WARM)
    teach = write_script(work, "teach.py", "import slowwarm\nprint('taught')\n")
    later = write_script(work, "later.py", "print('later run ran')\n")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("PYTHONPATH", os.pathsep.join(filter(None, [os.environ.get("PYTHONPATH"), str(site)])))
        mp.setenv("MONARCH_CACHE_DIR", str(tmp_path / "cache"))
        mp.setenv("MONARCH_LEARN_PRELOAD", "1")
        mp.setenv("SLOW_WARM_SECONDS", "8")
        mp.chdir(work)
        job = serve(None, hosts=1, state=tmp_path / ".monarch" / "job_state.pkl")
        try:
            assert spmd(job, teach, nproc=1).result.exit_code == 0

            def warm() -> dict:
                return job.status()["hosts"][0]["warm"]

            deadline = time.monotonic() + 30
            while not warm()["warming"]:  # it imports slowwarm in place (8 s)
                assert time.monotonic() < deadline, warm()
                time.sleep(0.05)
            pid = warm()["pid"]
            run = spmd(job, later, nproc=1)  # asked while it imports
            assert run.result.exit_code == 0 and b"later run ran" in run.out, run.text()
            assert job.wait_warm(60), warm()
            assert warm()["pid"] == pid and warm()["learned_held"] >= 1, warm()
        finally:
            job.stop()
