"""How runs end when ranks fail, hang or are interrupted, and that the reservation keeps
working afterwards. Ctrl-C is tested through a real driver process, as a terminal sends it.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest

from monarch_cli.jobs import Job

from ..conftest import REPO, wait_until, write_script
from .conftest import ConsoleReader, living, spmd

OK = "import os\nprint('ok', os.environ['RANK'])\n"


def rank_processes(job: Job) -> list[str]:
    """Processes under the reservation's agents other than their zygotes and the warm processes'
    idle spares (i.e. ranks)."""
    found = []
    for host in job.state.hosts:
        for p in psutil.Process(host.pid).children(recursive=True):
            try:
                cmd = " ".join(p.cmdline())
                zygote = cmd.startswith(("monarch warm ", "monarch fork-server ", "monarch spare "))
                if not zygote and p.status() != psutil.STATUS_ZOMBIE:
                    found.append(f"{p.pid}: {cmd}")
            except psutil.NoSuchProcess:
                pass
    return found


@pytest.fixture(autouse=True)
def still_serving(job: Job, tmp_path: Path) -> Iterator[None]:
    """After every failure, nothing of the run is left and the reservation runs the next one."""
    yield
    assert wait_until(lambda: not rank_processes(job), 5), rank_processes(job)
    run = spmd(job, write_script(tmp_path, "ok_after.py", OK))
    assert run.result.exit_code == 0, run.text()
    assert sorted(run.lines()) == [f"[rank{r}] ok {r}".encode() for r in range(4)]


@pytest.mark.slow
def test_nonzero_exit_sets_the_status_and_stops_the_others_after_the_grace(job: Job, tmp_path: Path) -> None:
    script = write_script(
        tmp_path,
        "fail.py",
        """
        import os, sys, time
        if os.environ["RANK"] == "1":
            print("rank 1 gives up", flush=True)
            sys.exit(3)
        time.sleep(60)
    """,
    )
    run = spmd(job, script)  # the default grace: 3 s, then SIGTERM
    result = run.result
    assert result.exit_code == 3
    assert result.first_failure is not None and result.first_failure.rank == 1
    assert result.first_failure.how == "exit 3" and result.first_failure.tail == ["rank 1 gives up"]
    assert result.ranks[0] is result.first_failure  # listed first
    others = [r for r in result.ranks if r.rank != 1]
    assert [(r.rank, r.how, r.status) for r in others] == [(r, "killed by SIGTERM", 143) for r in (0, 2, 3)]
    assert all(r.duration >= 2.5 for r in others), "the other ranks were stopped before the grace ran out"
    assert run.elapsed < 30, f"the run took {run.elapsed:.1f} s to end after a failure"  # not the 60 s sleep


def test_rank_killed_by_a_signal(job: Job, tmp_path: Path) -> None:
    script = write_script(
        tmp_path,
        "killed.py",
        """
        import os, signal
        if os.environ["RANK"] == "2":
            print("about to die", flush=True)
            os.kill(os.getpid(), signal.SIGKILL)
        print("fine")
    """,
    )
    result = spmd(job, script).result
    assert result.exit_code == 137
    failure = result.first_failure
    assert failure is not None and failure.rank == 2
    assert failure.signal == signal.SIGKILL and failure.exitcode is None
    assert "SIGKILL" in failure.how
    assert failure.tail == ["about to die"]
    assert [r.ok for r in result.ranks if r.rank != 2] == [True, True, True]


def test_uncaught_exception_gives_status_1_and_the_traceback(job: Job, tmp_path: Path) -> None:
    script = write_script(
        tmp_path,
        "boom.py",
        """
        import os

        def train():
            raise ValueError("boom from rank " + os.environ["RANK"])

        if os.environ["RANK"] == "3":
            train()
    """,
    )
    run = spmd(job, script)
    result = run.result
    assert result.exit_code == 1
    failure = result.first_failure
    assert failure is not None and failure.rank == 3 and failure.how == "exit 1"
    assert failure.tail[-1] == "ValueError: boom from rank 3"
    assert any(line.startswith("  File ") and line.endswith("in train") for line in failure.tail)
    log = run.log(3).decode()
    assert log.startswith("Traceback (most recent call last):\n")
    # As python prints it: from the script's first frame on, no launcher or runpy frames.
    assert f'File "{script}", line 7, in <module>' in log.splitlines()[1]
    assert "runpy" not in log and "monarch_cli" not in log
    assert b"[rank3] Traceback (most recent call last):" in run.err
    assert b"[rank3] ValueError: boom from rank 3" in run.err
    assert [r.ok for r in result.ranks if r.rank != 3] == [True, True, True]


@pytest.mark.slow
def test_rank_ignoring_sigterm_beside_a_failed_one_is_killed(job: Job, tmp_path: Path) -> None:
    ready = tmp_path / "stubborn-ready"
    script = write_script(
        tmp_path,
        "hang.py",
        f"""
        import os, signal, sys, time
        rank = os.environ["RANK"]
        if rank == "1":
            signal.signal(signal.SIGTERM, signal.SIG_IGN)
            open({str(ready)!r}, "w").close()
            while True:
                time.sleep(0.05)
        if rank == "0":
            while not os.path.exists({str(ready)!r}):
                time.sleep(0.02)
            sys.exit(2)
        time.sleep(60)
    """,
    )
    run = spmd(job, script, grace=1.0)
    result = run.result
    assert result.exit_code == 2 and result.first_failure.rank == 0
    how = {r.rank: r.how for r in result.ranks}
    assert how == {0: "exit 2", 1: "killed by SIGKILL", 2: "killed by SIGTERM", 3: "killed by SIGTERM"}
    assert run.elapsed < 30, f"the run took {run.elapsed:.1f} s"  # not the 60 s sleep


def test_max_restarts_restarts_the_whole_group(job: Job, tmp_path: Path) -> None:
    script = write_script(
        tmp_path,
        "flaky.py",
        """
        import os, sys
        attempt = int(os.environ["TORCHELASTIC_RESTART_COUNT"])
        print("attempt", attempt, "of", os.environ["TORCHELASTIC_MAX_RESTARTS"], flush=True)
        if attempt == 0 and os.environ["RANK"] == "2":
            sys.exit(4)
    """,
    )
    run = spmd(job, script, flags=["--max-restarts=2"], grace=0.5)
    assert run.result.exit_code == 0, run.text()
    assert run.result.restarts == 1
    lines = sorted(run.lines())
    assert lines == sorted([f"[rank{r}] attempt {a} of 2".encode() for r in range(4) for a in (0, 1)])
    assert run.log(2) == b"attempt 0 of 2\nattempt 1 of 2\n"  # both attempts, in the run's one log


# ----------------------------------------------------------------------------- Ctrl-C
DRIVER = """
import sys
from monarch_cli.jobs import job_load

result = job_load(sys.argv[1]).run_spmd(sys.argv[2:])
print(f"DRIVER exit={result.exit_code} interrupted={result.interrupted}", flush=True)
sys.exit(result.exit_code)
"""


class Driver(ConsoleReader):
    """``job_load(state).run_spmd(...)`` in its own process, its console read line by line."""

    what = "the driver"

    def __init__(self, job: Job, script: Path) -> None:
        proc = subprocess.Popen(
            [
                sys.executable,
                "-u",
                "-c",
                DRIVER,
                str(job.path.resolve()),
                "torchrun",
                "--nproc-per-node=2",
                str(script),
            ],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            cwd=REPO,
            env={**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))},
        )
        super().__init__(proc, proc.stdout)


@pytest.mark.slow
def test_first_ctrl_c_reaches_the_ranks_as_sigint(job: Job, tmp_path: Path) -> None:
    script = write_script(
        tmp_path,
        "interruptible.py",
        """
        import sys, time
        try:
            print("ready", flush=True)
            time.sleep(60)
        except KeyboardInterrupt:
            print("got SIGINT", flush=True)
            sys.exit(5)
    """,
    )
    with Driver(job, script) as driver:
        driver.wait_for("ready", 4, timeout=30)
        sent = time.monotonic()
        driver.proc.send_signal(signal.SIGINT)
        assert driver.finish(timeout=10) == 5
        assert time.monotonic() - sent < 5
        assert sorted(line for line in driver.seen if "got SIGINT" in line) == [
            f"[rank{r}] got SIGINT" for r in range(4)
        ]
        assert "DRIVER exit=5 interrupted=True" in driver.seen
        assert not any("Traceback" in line for line in driver.seen), driver.seen


@pytest.mark.slow
def test_second_ctrl_c_kills_ranks_that_ignore_sigint(job: Job, tmp_path: Path) -> None:
    script = write_script(
        tmp_path,
        "stubborn.py",
        """
        import signal, time
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        print("ready", flush=True)
        time.sleep(60)
    """,
    )
    with Driver(job, script) as driver:
        driver.wait_for("ready", 4, timeout=30)
        driver.proc.send_signal(signal.SIGINT)
        time.sleep(1.0)
        assert driver.proc.poll() is None, "the ranks ignore SIGINT: one Ctrl-C must not end the run"
        sent = time.monotonic()
        driver.proc.send_signal(signal.SIGINT)
        assert driver.finish(timeout=10) == 137
        assert time.monotonic() - sent < 5
        assert "DRIVER exit=137 interrupted=True" in driver.seen


@pytest.mark.slow
def test_a_vanished_driver_takes_its_ranks_along(job: Job, tmp_path: Path) -> None:
    """kill -9 of the controller: the agents stop hearing from it and kill its ranks."""
    pids = tmp_path / "pids"
    pids.mkdir()
    script = write_script(
        tmp_path,
        "orphan.py",
        f"""
        import os, time
        open(os.path.join({str(pids)!r}, str(os.getpid())), "w").close()
        print("ready", flush=True)
        time.sleep(60)
    """,
    )
    with Driver(job, script) as driver:
        driver.wait_for("ready", 4, timeout=30)
        ranks = [int(p.name) for p in pids.iterdir()]
        assert len(ranks) == 4
        driver.proc.kill()
        driver.finish(timeout=5)
        assert wait_until(lambda: not living(ranks), 15), living(ranks)
