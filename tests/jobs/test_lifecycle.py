"""The host agent's side of process lifecycle, with real processes: a warm process killed
mid-run, ranks' descendants in sessions of their own, agents found without (or outliving)
their state file, refused runs that must not leak, per-host liveness, process titles.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import psutil
import pytest

from monarch_cli.jobs import Job, JobError, job_load, serve

from ..conftest import REPO, alive, wait_until, write_script
from .conftest import living, reservation_pids, spmd

# Each rank records its pid, then starts three descendants that leave its process group:
# one in its own session, one orphaned at once by a double fork, one with a scrubbed
# environment; each writes its pid to a file before becoming `sleep`.
ESCAPERS = r"""
import os, subprocess, sys, time
marks = sys.argv[1]
rank = os.environ["RANK"]
open(os.path.join(marks, f"rank.{rank}"), "w").write(str(os.getpid()))
mark = lambda kind: os.path.join(marks, f"{kind}.{rank}")
subprocess.Popen(["setsid", "sh", "-c", f"echo $$ > {mark('session')}; exec sleep 300"])
subprocess.Popen(["sh", "-c", f"setsid sh -c 'echo $$ > {mark('orphan')}; exec sleep 300' & exit 0"])
subprocess.Popen(["env", "-i", "/usr/bin/setsid", "sh", "-c", f"echo $$ > {mark('scrubbed')}; exec sleep 300"])
# (a busy machine may take seconds to start them: the rank outlives their marks, whatever the load)
while not all(os.path.exists(mark(k)) and open(mark(k)).read().strip() for k in ("session", "orphan", "scrubbed")):
    time.sleep(0.05)
time.sleep(float(sys.argv[2]))
"""
KINDS = ("session", "orphan", "scrubbed")


def marked(marks: Path, kind: str) -> dict[int, int]:
    """rank -> pid, from the files the ranks (or their descendants) wrote."""
    found = {}
    for f in marks.glob(f"{kind}.*"):
        text = f.read_text().strip()
        if text:
            found[int(f.suffix[1:])] = int(text)
    return found


def escapers(marks: Path, ranks: int) -> list[int]:
    assert wait_until(lambda: all(len(marked(marks, k)) == ranks for k in KINDS), 30)
    pids = [pid for k in KINDS for pid in marked(marks, k).values()]
    assert all(alive(p) for p in pids)
    assert all(os.getsid(p) != os.getsid(r) for p in pids for r in marked(marks, "rank").values())
    return pids


def children_titled(pid: int, prefix: str) -> list[psutil.Process]:
    return [c for c in psutil.Process(pid).children() if " ".join(c.cmdline()).startswith(prefix)]


@pytest.mark.slow
def test_a_killed_warm_process_ends_the_run_naming_it_and_a_new_one_serves_the_next(job: Job, tmp_path: Path):
    script = write_script(tmp_path, "sleepy.py", ESCAPERS)
    results: list = []
    runner = threading.Thread(target=lambda: results.append(spmd(job, script, str(tmp_path), "120")), daemon=True)
    runner.start()
    escapers(tmp_path, 4)  # every rank is running
    agent1 = job.state.hosts[1].pid
    # The warm process the ranks were forked from (a learning host may be warming the next one).
    (warm,) = [w for w in children_titled(agent1, "monarch warm ") if w.children()]
    killed_at = time.monotonic()
    warm.kill()
    runner.join(timeout=30)
    assert not runner.is_alive(), "the run hangs after its warm process died"
    run = results[0]
    assert time.monotonic() - killed_at < 15
    assert run.result.exit_code != 0
    how = {e.rank: e.how for e in run.result.ranks}
    for rank in (2, 3):  # local1's ranks: killed with their warm process, and said so
        assert "warm process on local1 died (signal SIGKILL)" in how[rank], how
    assert all(h["ranks_running"] == 0 for h in job.status()["hosts"])
    assert spmd(job, write_script(tmp_path, "ok.py", "print('ok')\n")).result.exit_code == 0
    assert warm.pid not in [w.pid for w in children_titled(agent1, "monarch warm ")]  # a new one served it


@pytest.mark.slow
def test_descendants_in_sessions_of_their_own_end_with_the_run(job: Job, tmp_path: Path):
    script = write_script(tmp_path, "escape.py", ESCAPERS)
    results: list = []
    runner = threading.Thread(target=lambda: results.append(spmd(job, script, str(tmp_path), "2")), daemon=True)
    runner.start()
    pids = escapers(tmp_path, 4)
    runner.join(timeout=60)
    assert results[0].result.exit_code == 0
    assert wait_until(lambda: not living(pids), 10), living(pids)


@pytest.mark.slow
def test_stop_ends_descendants_in_sessions_of_their_own(tmp_path: Path):
    job = serve(None, hosts=1, state=tmp_path / ".monarch" / "job_state.pkl", preload="")
    try:
        script = write_script(tmp_path, "escape.py", ESCAPERS)
        threading.Thread(target=lambda: spmd(job, script, str(tmp_path), "120", nproc=1), daemon=True).start()
        pids = escapers(tmp_path, 1) + list(reservation_pids(job))
    finally:
        job.stop()
    assert wait_until(lambda: not living(pids), 10), living(pids)


def monarch(*args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    return subprocess.run(
        [sys.executable, "-m", "monarch_cli", *args], capture_output=True, text=True, timeout=60, env=env
    )


@pytest.mark.slow
def test_stop_force_on_a_corrupt_state_file_stops_its_agents(tmp_path: Path):
    state = tmp_path / ".monarch" / "job_state.pkl"
    job = serve(None, hosts=2, state=state, preload="")
    pids = reservation_pids(job)
    assert len(pids) >= 4  # two agents, each with its warm process (the plain fork server waits for a first need)
    # Corrupt, but still naming the reservation: only `stop --force` can end these agents.
    state.write_bytes(b"\x80\x04 garbage " + job.state.reservation_id.encode())
    with pytest.raises(JobError, match="corrupt"):
        job_load(state)
    done = monarch("stop", "--force", "--state", str(state), "--json")
    assert done.returncode == 0, done.stderr
    assert '"agents_stopped"' in done.stdout and str(job.state.hosts[0].pid) in done.stdout
    assert not state.exists()
    assert wait_until(lambda: not living(pids), 3), living(pids)


@pytest.mark.slow
def test_agents_of_a_forgotten_reservation_exit_on_their_own(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    # Nothing learned by earlier tests: the warm process is not replaced by a re-warmed one
    # while we watch, so the processes found now are the reservation's for its whole life.
    monkeypatch.setenv("MONARCH_CACHE_DIR", str(tmp_path / "cache"))
    state = tmp_path / ".monarch" / "job_state.pkl"
    job = serve(None, hosts=1, state=state, preload="")
    pids = reservation_pids(job)
    try:
        time.sleep(4)  # the agent has seen its state file record it (checked every 2 s)
        assert len(living(pids)) == len(pids), "agents must stay while their state file records them"
        state.unlink()  # e.g. `rm -rf .monarch`
        assert wait_until(lambda: not living(pids), 20), living(pids)
    finally:
        job.scheduler.release(job.state)


def _listening(pid: int) -> int:
    return len([c for c in psutil.Process(pid).net_connections("tcp") if c.status == psutil.CONN_LISTEN])


def test_too_many_nodes_is_refused_without_leaking_a_socket(job: Job, tmp_path: Path):
    script = write_script(tmp_path, "ok.py", "print('ok')\n")
    agent0 = psutil.Process(job.state.hosts[0].pid)
    spmd(job, script)  # whatever a first run opens for good is open before counting
    fds, listening = agent0.num_fds(), _listening(agent0.pid)
    for _ in range(5):
        with pytest.raises(JobError, match="--nnodes 3"):
            spmd(job, script, flags=["--nnodes=3"])
    assert _listening(agent0.pid) == listening and agent0.num_fds() <= fds


@pytest.mark.slow
def test_status_tells_a_dead_host_from_a_live_one(tmp_path: Path):
    state = tmp_path / ".monarch" / "job_state.pkl"
    job = serve(None, hosts=2, state=state, preload="")
    try:
        os.kill(job.state.hosts[1].pid, signal.SIGKILL)
        status = job_load(state).status()
        assert [h["alive"] for h in status["hosts"]] == [True, False]
        assert status["alive"] is False and "local1" in status["stale"] and "local0" not in status["stale"]
    finally:
        job.stop()


@pytest.mark.slow
def test_a_killed_agents_private_files_are_removed_by_the_next_agent(tmp_path: Path):
    """SIGKILL leaves an agent no chance to clean up: the next agent of this user does it."""
    job = serve(None, hosts=1, state=tmp_path / "a" / ".monarch" / "job_state.pkl", preload="")
    private = job.hostset().infos[0]["telemetry_dir"]
    assert os.path.isdir(private) and os.stat(private).st_mode & 0o077 == 0
    os.kill(job.state.hosts[0].pid, signal.SIGKILL)
    assert wait_until(lambda: not alive(job.state.hosts[0].pid), 5)
    assert os.path.isdir(private)
    job.scheduler.release(job.state)
    again = serve(None, hosts=1, state=tmp_path / "b" / ".monarch" / "job_state.pkl", preload="")
    try:
        assert not os.path.exists(private)
        assert os.path.isdir(again.hostset().infos[0]["telemetry_dir"])  # its own is left alone
    finally:
        again.stop()


def test_processes_are_titled_by_what_they_are(job: Job, tmp_path: Path):
    script = write_script(tmp_path, "train.py", "import time, sys; time.sleep(float(sys.argv[1]))\n")
    rid = job.state.reservation_id
    run = threading.Thread(target=lambda: spmd(job, script, "3", "--lr", "0.1"), daemon=True)
    run.start()
    agent0 = job.state.hosts[0].pid

    def cmdline(pid: int) -> str:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode().strip()

    def ranks() -> list[str]:
        return sorted(
            cmdline(p.pid)
            for p in psutil.Process(agent0).children(recursive=True)
            if cmdline(p.pid).startswith("monarch rank")
        )

    assert wait_until(lambda: len(ranks()) == 2, 30)
    assert ranks() == ["monarch rank 0: train.py 3 --lr 0.1", "monarch rank 1: train.py 3 --lr 0.1"]
    assert cmdline(agent0) == f"monarch agent {rid} host local0"
    titles = sorted(cmdline(c.pid) for c in psutil.Process(agent0).children())
    # Warm ranks only: the plain fork server (~15 MB) has not been started.
    assert titles == [f"monarch warm {rid} host local0"]
    run.join(timeout=30)
    # A cold run needs it: it starts then, and stays for the next one.
    quick = write_script(tmp_path, "quick.py", "print('cold')\n")
    assert spmd(job, quick, cold=True).result.exit_code == 0
    titles = sorted(cmdline(c.pid) for c in psutil.Process(agent0).children())
    assert titles == [f"monarch fork-server {rid} host local0", f"monarch warm {rid} host local0"]
