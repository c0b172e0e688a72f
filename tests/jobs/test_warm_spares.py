"""Spares: after a run, each host's warm process forks that many rank children ahead, idle,
and the next run's ranks are handed to them instead of each waiting for a fork of the
(hundreds of MB) warm process, one after the other. What a user would notice if it went
wrong: a re-run's ranks with another run's arguments, environment or random state, a run
broken by a spare that died while idle, or spare processes left behind by ``stop``.
"""

from __future__ import annotations

import json
import signal
import time
from pathlib import Path

import psutil
import pytest

from monarch_cli.jobs import Job, serve

from ..conftest import write_script
from .conftest import living, reservation_pids, spmd, wait_warm

pytestmark = pytest.mark.slow

_SCRIPT = """
import json, os, random, sys
import email.mime.text  # learned by the warm processes: not imported by torch
print("RANKINFO " + json.dumps({"pid": os.getpid(), "rank": int(os.environ["RANK"]), "argv": sys.argv[1:],
      "cwd": os.getcwd(), "mark": os.environ.get("SPARE_MARK"), "random": random.random()}))
"""


def _spares(job: Job) -> dict[int, list[int]]:
    """Each host's warm process -> the idle spares it holds now."""
    found: dict[int, list[int]] = {}
    for host in job.status()["hosts"]:
        warm = host["warm"]
        if not warm or not warm.get("pid"):
            continue
        try:
            children = psutil.Process(warm["pid"]).children()
        except psutil.NoSuchProcess:
            continue
        found[warm["pid"]] = [
            c.pid for c in children if _title(c).startswith(f"monarch spare {job.state.reservation_id} host ")
        ]
    return found


def _title(p: psutil.Process) -> str:
    try:
        return " ".join(p.cmdline())
    except psutil.Error:  # gone, or a rank that just exited (a zombie until its warm process reaps it)
        return ""


def _alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def _wait_spares(job: Job, per_host: int, timeout: float = 60.0) -> dict[int, list[int]]:
    deadline = time.monotonic() + timeout
    while True:
        spares = _spares(job)
        if len(spares) == len(job.state.hosts) and all(len(s) == per_host for s in spares.values()):
            return spares
        assert time.monotonic() < deadline, f"spares never settled at {per_host} per host: {spares}"
        time.sleep(0.1)


def _infos(out: bytes) -> list[dict]:
    return [json.loads(line.split(b"RANKINFO ", 1)[1]) for line in out.splitlines() if b"RANKINFO " in line]


@pytest.fixture(scope="module")
def settled(job: Job, tmp_path_factory: pytest.TempPathFactory) -> tuple[Job, Path]:
    """A reservation whose warm processes have learned the script (none is replaced any more)."""
    script = write_script(tmp_path_factory.mktemp("spares"), "spares.py", _SCRIPT)
    assert spmd(job, script).result.exit_code == 0
    wait_warm(job)
    assert spmd(job, script).result.exit_code == 0  # the warm process runs now fork from
    return job, script


def test_a_rerun_runs_in_the_spares_forked_after_the_last_run_with_its_own_arguments(settled) -> None:
    job, script = settled
    spares = _wait_spares(job, per_host=2)  # 2 ranks per host last time: 2 spares per host
    idle = {pid for pids in spares.values() for pid in pids}
    assert [h["warm"]["spares"] for h in job.status()["hosts"]] == [2, 2]  # what `monarch status` shows

    out = spmd(job, script, "--lr", "0.1", nproc=2)
    assert out.result.exit_code == 0, out.text()
    infos = _infos(out.out)
    assert sorted(i["rank"] for i in infos) == [0, 1, 2, 3]
    assert {i["pid"] for i in infos} == idle  # every rank was a spare, none was forked for the run
    assert all(i["argv"] == ["--lr", "0.1"] for i in infos), infos
    assert len({i["random"] for i in infos}) == 4  # each its own random state, as in a fresh interpreter

    # The next run has spares of its own, new processes; a smaller run uses fewer of them.
    again = _wait_spares(job, per_host=2)
    assert not idle & {pid for pids in again.values() for pid in pids}
    one = spmd(job, script, nproc=1)
    assert one.result.exit_code == 0, one.text()
    assert {i["pid"] for i in _infos(one.out)} <= {pid for pids in again.values() for pid in pids}


def test_a_spare_killed_while_idle_does_not_break_the_next_run(settled) -> None:
    job, script = settled
    spmd(job, script, nproc=2)
    spares = _wait_spares(job, per_host=2)
    warm_pids = set(spares)
    victim = next(iter(spares.values()))[0]
    psutil.Process(victim).send_signal(signal.SIGKILL)
    # Dead, not dying: the kernel closes a process's sockets only after tearing down its memory,
    # and a rank handed to a spare in that window dies with it (as a rank killed at its start).
    deadline = time.monotonic() + 30
    while _alive(victim):
        assert time.monotonic() < deadline, f"spare {victim} survived SIGKILL"
        time.sleep(0.02)

    run = spmd(job, script, nproc=2)
    assert run.result.exit_code == 0, run.text()
    infos = _infos(run.out)
    assert sorted(i["rank"] for i in infos) == [0, 1, 2, 3]
    assert victim not in {i["pid"] for i in infos}
    assert "lost" not in run.text() and not any(r.lost for r in run.result.ranks)
    # The warm processes were not replaced for it, and keep serving runs from spares.
    assert set(_wait_spares(job, per_host=2)) == warm_pids


def test_stop_leaves_no_spare_behind(tmp_path: Path) -> None:
    job = serve(None, hosts=1, state=tmp_path / ".monarch" / "job_state.pkl")
    try:
        script = write_script(tmp_path, "spares.py", _SCRIPT)
        assert spmd(job, script, nproc=3).result.exit_code == 0
        wait_warm(job)
        assert spmd(job, script, nproc=3).result.exit_code == 0
        spares = _wait_spares(job, per_host=3)
        pids = reservation_pids(job)
        assert {p for s in spares.values() for p in s} <= pids
    finally:
        job.stop()
    deadline = time.monotonic() + 30
    while living(pids):
        assert time.monotonic() < deadline, f"left after stop: {living(pids)}"
        time.sleep(0.1)


def test_a_warm_process_that_learned_after_the_last_run_has_its_spares_before_the_next_run(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """After the first run of a script, the idle warm process imports what it imported (in
    place) and lets its idle spares go (forked before those imports): the next run forks from it,
    so it must have new spares by then (else that run's ranks each wait for a fork of a process of
    hundreds of MB), and they must hold what was learned."""
    monkeypatch.setenv("MONARCH_CACHE_DIR", str(tmp_path / "cache"))  # nothing learned before: a swap will come
    job = serve(None, hosts=1, state=tmp_path / ".monarch" / "job_state.pkl")
    try:
        first = job.status()["hosts"][0]["warm"]["pid"]
        script = write_script(tmp_path, "spares.py", _SCRIPT)
        assert spmd(job, script, nproc=2).result.exit_code == 0
        (warm,) = wait_warm(job)
        assert warm["pid"] == first and warm["learned_held"] > 0, "the run taught nothing"
        spares = _wait_spares(job, per_host=2)
        assert list(spares) == [warm["pid"]]
        run = spmd(job, script, nproc=2)
        assert run.result.exit_code == 0
        assert sorted(i["pid"] for i in _infos(run.out)) == sorted(spares[warm["pid"]])  # the ranks were those spares
    finally:
        job.stop()
