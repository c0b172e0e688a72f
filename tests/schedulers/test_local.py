"""The local scheduler through the job API: reservations that go stale or get corrupted,
reuse and replacement, nothing left running after stop, and torchx AppDefs.
"""

from __future__ import annotations

import dataclasses
import io
import os
import signal
import threading
import time
from pathlib import Path

import psutil
import pytest

from monarch_cli.jobs import Job, JobError, StaleReservation, dryrun, job_load, serve
from monarch_cli.jobs.state import NoReservation, StateError

from ..conftest import wait_until, write_script
from ..jobs.conftest import living, reservation_pids, spmd

OK = "import os\nprint('ok', os.environ['RANK'])\n"


def agent_pids(state: Path) -> list[int]:
    """The agents' pids as the state file records them."""
    return [h.pid for h in job_load(state).state.hosts]


# ------------------------------------------------------------------------ stale state
def kill_agents_from_outside(job: Job) -> None:
    """SIGKILL the agents by the pids in the state file, as if the allocation ended."""
    old = reservation_pids(job)
    assert len(old) >= 4  # two agents and their zygotes
    for pid in agent_pids(job.path):
        os.kill(pid, signal.SIGKILL)
    assert wait_until(lambda: not living(old), 10), living(old)  # zygotes follow their agent


@pytest.mark.slow
def test_killed_agents_make_a_stale_reservation_that_serve_renews(tmp_path: Path) -> None:
    state = tmp_path / ".monarch" / "job_state.pkl"
    script = write_script(tmp_path, "ok.py", OK)
    job = serve(None, hosts=2, state=state)
    try:
        kill_agents_from_outside(job)
        job = job_load(state)  # a later command reattaches
        status = job.status()
        assert status["alive"] is False
        assert "gone" in status["stale"] and "serve --replace" in status["stale"]
        assert [h["alive"] for h in status["hosts"]] == [False, False]

        started = time.monotonic()
        with pytest.raises(StaleReservation, match="serve --replace"):
            spmd(job, script)
        assert time.monotonic() - started < 6
        with pytest.raises(StaleReservation):
            job.exec("true")

        fresh = serve(None, hosts=2, state=state, replace=True)
        assert fresh.state.reservation_id != job.state.reservation_id
        assert fresh.status()["alive"] is True
        job = fresh
        assert spmd(job, script).result.exit_code == 0

        # Without --replace too: a stale reservation has nothing left to lose.
        kill_agents_from_outside(job)
        again = serve(None, hosts=2, state=state)
        assert again.state.reservation_id != job.state.reservation_id
        job = again
        assert spmd(job, script).result.exit_code == 0
    finally:
        current = job_load_or_none(state)  # whatever a failed assertion left recorded
        if current is not None:
            current.stop()
        job.scheduler.release(job.state)


def test_a_corrupt_state_file_is_a_state_error(tmp_path: Path) -> None:
    state = tmp_path / ".monarch" / "job_state.pkl"
    state.parent.mkdir()
    state.write_bytes(b"\x80\x04this is not a job state\x00\xff")
    with pytest.raises(StateError) as info:
        job_load(state)
    assert str(state) in str(info.value)
    with pytest.raises(StateError):
        serve(None, hosts=1, state=state)  # not overwritten without being asked
    job = serve(None, hosts=1, state=state, replace=True)
    try:
        assert job_load(state).state.reservation_id == job.state.reservation_id
        assert job.status()["alive"] is True
    finally:
        job.stop()
    with pytest.raises(NoReservation):
        job_load(state)


def test_serve_reuses_a_matching_reservation_and_replaces_only_when_asked(tmp_path: Path) -> None:
    state = tmp_path / "job_state.pkl"
    first = serve(None, hosts=1, state=state)
    jobs = [first]
    try:
        again = serve(["torchrun", "--nproc-per-node=1", "train.py"], hosts=1, state=state)
        assert again.state.reservation_id == first.state.reservation_id
        assert job_load(state).state.default_command == ["torchrun", "--nproc-per-node=1", "train.py"]
        assert job_load(state).state.default_cwd == os.getcwd()  # where its relative paths resolve
        serve(["torchrun", "--nproc-per-node=1", "train.py"], hosts=1, state=state, cwd=tmp_path)
        assert job_load(state).state.default_cwd == str(tmp_path)  # the same command, served from elsewhere

        with pytest.raises(JobError) as info:
            serve(None, hosts=2, state=state)
        message = str(info.value)
        assert "1 host(s), not 2" in message and "--replace" in message
        assert first.status()["alive"] is True  # refused: the old one is untouched

        old_agents = agent_pids(state)
        second = serve(None, hosts=2, state=state, replace=True)
        jobs.append(second)
        assert second.state.reservation_id != first.state.reservation_id
        assert [h.name for h in second.state.hosts] == ["local0", "local1"]
        assert wait_until(lambda: not living(old_agents), 10), living(old_agents)
    finally:
        current = job_load_or_none(state)
        if current is not None:
            current.stop()
        for j in jobs:
            j.scheduler.release(j.state)  # no-op for agents already gone


def test_agents_of_another_monarch_cli_version_are_refused_in_one_line(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Client and agents must run the same version (their messages are not versioned): a run
    says which host runs which, serve will not reuse them without --replace, stop still works."""
    import shutil
    import subprocess
    import sys

    import monarch_cli

    other = tmp_path / "other"  # a copy of this package that says it is another version
    shutil.copytree(
        Path(monarch_cli.__file__).parent, other / "monarch_cli", ignore=shutil.ignore_patterns("__pycache__")
    )
    version = other / "monarch_cli" / "version.py"
    version.write_text(
        version.read_text().replace(f'__version__ = "{monarch_cli.__version__}"', '__version__ = "0.0.1-other"')
    )
    assert "0.0.1-other" in version.read_text()
    state = tmp_path / "job_state.pkl"
    script = write_script(tmp_path, "train.py", "print('ran')\n")
    with monkeypatch.context() as mp:  # the agents start with the other copy first on their path
        mp.chdir(tmp_path)  # (`python -m` puts the directory it starts in first: not the repository's)
        mp.setenv("PYTHONPATH", os.pathsep.join(filter(None, [str(other), os.environ.get("PYTHONPATH")])))
        job = serve(["torchrun", "--nproc-per-node=1", str(script)], hosts=1, state=state)
    try:
        with pytest.raises(JobError) as info:
            job.run_spmd()
        assert str(info.value).startswith(
            f"host local0 runs monarch-cli 0.0.1-other, this client {monarch_cli.__version__}"
        )
        cli = subprocess.run(
            [sys.executable, "-m", "monarch_cli", "run-spmd", "--state", str(state)],
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert cli.returncode != 0 and "Traceback" not in cli.stderr
        assert len(cli.stderr.strip().splitlines()) == 1 and "runs monarch-cli 0.0.1-other" in cli.stderr
        with pytest.raises(JobError) as refused:
            serve(["torchrun", "--nproc-per-node=1", str(script)], hosts=1, state=state)
        assert "0.0.1-other" in str(refused.value) and "--replace" in str(refused.value)
    finally:
        agents = agent_pids(state)
        job_load(state).stop()
    assert wait_until(lambda: not living(agents), 10), living(agents)


def job_load_or_none(state: Path):
    try:
        return job_load(state)
    except StateError:
        return None


# ----------------------------------------------------------------- nothing left behind
BACKGROUND = """
import os, subprocess, sys, time
child = subprocess.Popen(["sleep", "100"])  # not waited for: outlives the rank
with open(os.path.join(sys.argv[1], "%s-%d-%d" % (sys.argv[2], os.getpid(), child.pid)), "w"):
    pass
print("spawned", child.pid, flush=True)
if sys.argv[2] == "hang":
    time.sleep(100)
"""


def recorded_pids(directory: Path, kind: str) -> dict[str, list[int]]:
    ranks, children = [], []
    for p in directory.glob(f"{kind}-*"):
        _, rank, child = p.name.split("-")
        ranks.append(int(rank))
        children.append(int(child))
    return {"ranks": ranks, "children": children}


@pytest.mark.slow
def test_stop_leaves_no_process_behind(tmp_path: Path) -> None:
    state = tmp_path / ".monarch" / "job_state.pkl"
    marks = tmp_path / "marks"
    marks.mkdir()
    script = write_script(tmp_path, "background.py", BACKGROUND)
    job = serve(None, hosts=2, state=state)
    stopped = False
    try:
        # 1. A finished run whose ranks left a background child running.
        done = spmd(job, script, str(marks), "done")
        assert done.result.exit_code == 0, done.text()
        finished = recorded_pids(marks, "done")
        assert len(finished["children"]) == 4
        # As with torchrun, the end of the run takes the ranks' process groups along.
        assert wait_until(lambda: not living(finished["children"]), 10), living(finished["children"])

        # 2. A run still in progress when the reservation is stopped.
        results: list = []
        runner = threading.Thread(target=lambda: results.append(spmd(job, script, str(marks), "hang")), daemon=True)
        runner.start()
        assert wait_until(lambda: len(recorded_pids(marks, "hang")["children"]) == 4, 30)
        hanging = recorded_pids(marks, "hang")
        everything = reservation_pids(job) | set(hanging["ranks"]) | set(hanging["children"])
        assert set(hanging["ranks"]) <= reservation_pids(job)

        job.stop()
        stopped = True
        assert wait_until(lambda: not living(everything), 10), living(everything)
        left = [
            p.info
            for p in psutil.process_iter(["pid", "cmdline"])
            if p.info["pid"] in everything and " ".join(p.info["cmdline"] or []).startswith("monarch ")
        ]
        assert left == []
        with pytest.raises(NoReservation):
            job_load(state)

        # The interrupted run ends, saying it was stopped, instead of hanging.
        runner.join(timeout=20)
        assert not runner.is_alive(), "run_spmd did not return after the reservation was stopped"
        result = results[0].result
        assert result.exit_code == 254 and result.stopped_by and result.stopped_by.startswith("monarch stop (pid ")
        assert all(r.how == "reservation stopped" for r in result.ranks), [r.how for r in result.ranks]
    finally:
        if not stopped:
            job.stop()


# --------------------------------------------------------------------- torchx AppDefs
# torchx is not installed here: these dataclasses stand in for torchx.specs.Role and
# torchx.specs.AppDef, with the attributes monarch reads (duck typing, as with the real ones).
@dataclasses.dataclass
class Role:
    name: str
    image: str
    entrypoint: str
    args: list[str] = dataclasses.field(default_factory=list)
    num_replicas: int = 1


@dataclasses.dataclass
class AppDef:
    name: str
    roles: list[Role] = dataclasses.field(default_factory=list)


def trainer(replicas: int, *args: str) -> AppDef:
    role = Role("trainer", "local", "torchrun", ["--nproc-per-node=2", "train.py", *args], num_replicas=replicas)
    return AppDef("train", [role])


def test_appdef_replicas_become_hosts(tmp_path: Path) -> None:
    plan = dryrun(trainer(3, "--lr", "0.1"), state=tmp_path / "job_state.pkl")
    assert plan.scheduler == "local"
    assert "start 3 host agent(s)" in plan.summary
    assert "default command: torchrun --nproc-per-node=2 train.py --lr 0.1" in plan.render()
    commands = [line for line in plan.steps if "monarch_cli.runtime.agent" in line]
    assert len(commands) == 3
    assert all(f"--name local{i}" in line for i, line in enumerate(commands))
    assert not (tmp_path / "job_state.pkl").exists()  # a dry run starts and writes nothing

    explicit = dryrun(trainer(3), hosts=2, state=tmp_path / "job_state.pkl")
    assert "start 2 host agent(s)" in explicit.summary


def test_appdef_with_several_roles_is_refused(tmp_path: Path) -> None:
    app = trainer(2)
    app.roles.append(Role("ps", "local", "python", ["ps.py"]))
    with pytest.raises(JobError, match="2 roles"):
        dryrun(app, state=tmp_path / "job_state.pkl")


def test_appdef_bad_command_is_refused_before_starting_anything(tmp_path: Path) -> None:
    app = AppDef("bad", [Role("trainer", "local", "torchrun", ["--nnode=2", "train.py"])])
    with pytest.raises(JobError, match="did you mean --nnodes"):
        serve(app, state=tmp_path / "job_state.pkl")
    assert not (tmp_path / "job_state.pkl").exists()


def test_serve_an_appdef_and_run_its_command(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    write_script(tmp_path, "train.py", OK)
    app = AppDef("train", [Role("trainer", "local", "torchrun", ["--nproc-per-node=2", "train.py"], num_replicas=1)])
    job = serve(app, state=tmp_path / ".monarch" / "job_state.pkl")
    try:
        assert [h.name for h in job.state.hosts] == ["local0"]
        out = io.BytesIO()
        result = job.run_spmd(stdout=out, stderr=io.BytesIO())  # the AppDef's command is the default
        assert result.exit_code == 0
        assert sorted(out.getvalue().splitlines()) == [b"[rank0] ok 0", b"[rank1] ok 1"]
    finally:
        job.stop()


def test_appdef_shaped_like_torchx_dist_ddp(tmp_path: Path) -> None:
    # What torchx.components.dist.ddp(script="train.py", j="2x2") returns (torchx 0.7), as plain data.
    command = (
        "torchrun --rdzv_backend c10d --rdzv_endpoint ${TORCHX_RANK0_HOST:=localhost}:29500 "
        "--rdzv_id ${app_id} --nnodes 2 --nproc_per_node 2 --tee 3 --role '' train.py"
    )
    app = AppDef("train", [Role("train", "local", "bash", ["-c", command], num_replicas=2)])
    plan = dryrun(app, state=tmp_path / "job_state.pkl")
    assert "start 2 host agent(s)" in plan.summary
    assert (
        "default command: torchrun --rdzv_backend c10d --rdzv_endpoint localhost:29500 --rdzv_id monarch"
        in plan.render()
    )


def test_torchx_scheduler_names_reach_the_local_backend() -> None:
    from monarch_cli.schedulers import get_scheduler

    assert get_scheduler("local_cwd").name == get_scheduler("local").name == "local"
    with pytest.raises(JobError, match="unknown scheduler 'aws_batch'; available: .*local_cwd"):
        get_scheduler("aws_batch")
