"""Failures: dying procs, supervision, and meshes that must not outlive their owners."""

from __future__ import annotations

import json
import os
import signal
import time

import psutil
import pytest

from monarch_cli import Actor, HostMesh, SupervisionError, configure, endpoint, this_host
from monarch_cli.config import settings
from monarch_cli.runtime.launch.start import launch_agent
from monarch_cli.runtime.mailbox.mailbox import Mailbox

from ..conftest import alive, all_gone, spawn_python, wait_until


class Mortal(Actor):
    @endpoint
    def pid(self) -> int:
        return os.getpid()

    @endpoint
    def die(self, how: str) -> None:
        if how == "sigkill":
            os.kill(os.getpid(), signal.SIGKILL)
        elif how == "segfault":
            import ctypes

            ctypes.string_at(0)
        elif how == "exit":
            os._exit(3)
        time.sleep(60)

    @endpoint
    def sleep(self, seconds: float) -> None:
        time.sleep(seconds)


@pytest.mark.parametrize(
    "how, expected",
    [
        ("sigkill", "killed by signal 9 (SIGKILL)"),
        ("segfault", "killed by signal 11 (SIGSEGV)"),
        ("exit", "exited with code 3"),
    ],
)
def test_dying_proc_fails_every_pending_call_quickly_and_says_why(how, expected):
    procs = this_host().spawn_procs(per_host={"gpus": 2})
    mesh = procs.spawn("mortal", Mortal)
    victim = mesh.slice(gpus=1)
    pid = victim.pid.call_one().get(timeout=10)
    dying = victim.die.call_one(how)
    queued = victim.sleep.call_one(0)  # waits behind the dying call
    t0 = time.monotonic()
    for fut in (dying, queued):
        with pytest.raises(SupervisionError) as info:
            fut.get(timeout=10)
        message = str(info.value)
        assert expected in message
        assert "actor 'mortal'" in message and f"pid {pid}" in message
        assert procs._members[1].proc_id in message and procs._members[1].host in message
        assert info.value.failure.pid == pid
    assert time.monotonic() - t0 < 8.0  # told by supervision, not by the 10 s call timeout
    # Later calls fail at once; the survivor is untouched.
    with pytest.raises(SupervisionError):
        victim.pid.call_one().get(timeout=1)
    assert mesh.slice(gpus=0).pid.call_one().get(timeout=5) != pid
    assert any(expected in f.describe() for f in procs.failures)
    procs.stop().get()


class Owner(Actor):
    """Spawns a child mesh and supervises it."""

    def __init__(self, handle: bool) -> None:
        self.handle = handle
        self.seen: list = []
        self.child = this_host().spawn_procs(per_host={"n": 1}).spawn("child", Mortal)

    def __supervise__(self, failure) -> bool:
        self.seen.append(failure.describe())
        return self.handle

    @endpoint
    def kill_child(self) -> None:
        self.child.die.broadcast("exit")

    @endpoint
    def seen_failures(self) -> list:
        return self.seen


def test_supervise_handles_a_child_failure():
    procs = this_host().spawn_procs(per_host={"n": 1})
    owner = procs.spawn("owner", Owner, True)
    before = len(Mailbox.get().unhandled)
    owner.kill_child.call_one().get(timeout=10)
    assert wait_until(lambda: owner.seen_failures.call_one().get(timeout=5), 5)
    assert "exited with code 3" in owner.seen_failures.call_one().get(timeout=5)[0]
    time.sleep(0.3)
    assert len(Mailbox.get().unhandled) == before  # handled: nothing reached the controller
    procs.stop().get()


def test_unhandled_child_failure_propagates_to_the_controller(capfd):
    procs = this_host().spawn_procs(per_host={"n": 1})
    owner = procs.spawn("owner", Owner, False)
    owner.kill_child.call_one().get(timeout=10)
    assert wait_until(lambda: procs.failures, 5)
    reason = procs.failures[0].reason
    assert "did not handle a failure" in reason and "exited with code 3" in reason
    with pytest.raises(SupervisionError, match="did not handle"):
        owner.seen_failures.call_one().get(timeout=5)
    assert "monarch: unhandled failure" in capfd.readouterr().err
    procs.stop().get()


CONTROLLER = """
import json, os, sys, time
from monarch_cli import Actor, HostMesh, configure, endpoint, this_host
configure(heartbeat_interval=0.2, heartbeat_timeout={timeout})
class P(Actor):
    @endpoint
    def pid(self):
        return os.getpid()
agent = sys.argv[1] if len(sys.argv) > 1 else None
hosts = HostMesh.connect([agent]) if agent else this_host()
procs = hosts.spawn_procs(per_host={{"gpus": 3}})
pids = procs.spawn("p", P).pid.call().get(timeout=20).values()
print(json.dumps(pids), flush=True)
time.sleep(600)
"""


def _children_of_agents() -> set:
    found = set()
    for p in psutil.process_iter(["cmdline"]):
        cmd = " ".join(p.info["cmdline"] or [])
        if cmd.startswith(("monarch agent ", "monarch fork-server ", "monarch warm ", "monarch spare ")):
            found.add(p.pid)
    return found


@pytest.mark.slow
def test_killed_controller_leaves_no_processes_behind():
    before = _children_of_agents()
    ctl = spawn_python(CONTROLLER.format(timeout=2.0))
    pids = json.loads(ctl.stdout.readline())
    runtime_pids = _children_of_agents() - before
    assert len(pids) == 3 and all(alive(p) for p in pids) and runtime_pids  # agent + zygote
    ctl.kill()
    ctl.wait()
    assert wait_until(lambda: all_gone(pids + list(runtime_pids)), 10), "procs or agent outlived the controller"


@pytest.mark.slow
def test_long_lived_agent_reaps_procs_of_a_vanished_controller(keys):
    agent, address = launch_agent(keys, name="survivor")
    try:
        ctl = spawn_python(CONTROLLER.format(timeout=1.5), address, env={"MONARCH_KEYS": keys.encode()})
        pids = json.loads(ctl.stdout.readline())
        assert all(alive(p) for p in pids)
        ctl.kill()  # no goodbye: the agent must notice the silence
        ctl.wait()
        assert wait_until(lambda: all_gone(pids), 10), "agent kept a dead controller's procs"
        assert agent.poll() is None  # the agent itself stays up for the next client
        assert HostMesh.connect([address]).spawn_procs(per_host={"n": 1}) is not None
    finally:
        agent.stdin.close()
        agent.wait(10)


@pytest.mark.slow
def test_agent_killed_under_a_pending_call(keys):
    old = (settings().heartbeat_interval, settings().heartbeat_timeout)
    configure(heartbeat_interval=0.2, heartbeat_timeout=1.0)
    agent, address = launch_agent(keys, name="doomed")
    try:
        procs = HostMesh.connect([address]).spawn_procs(per_host={"gpus": 2})
        mesh = procs.spawn("mortal", Mortal)
        pids = mesh.pid.call().get(timeout=10).values()
        pending = mesh.sleep.call(30)
        agent.kill()
        with pytest.raises(SupervisionError, match="stopped answering|killed by signal"):
            pending.get(timeout=5)
        assert wait_until(lambda: all_gone(pids), 5), "procs outlived their agent"
    finally:
        configure(heartbeat_interval=old[0], heartbeat_timeout=old[1])
        agent.wait(10)


@pytest.mark.slow
def test_a_killed_fork_server_fails_its_procs_with_the_cause_and_is_replaced(keys):
    agent, address = launch_agent(keys, name="forky")
    try:
        procs = HostMesh.connect([address]).spawn_procs(per_host={"gpus": 2})
        mesh = procs.spawn("mortal", Mortal)
        pids = list(mesh.pid.call().get(timeout=10).values())
        pending = mesh.sleep.call(30)
        (server,) = [
            c for c in psutil.Process(agent.pid).children() if c.cmdline()[0].startswith("monarch fork-server")
        ]
        server.kill()
        with pytest.raises(SupervisionError, match=r"fork server on forky died \(signal SIGKILL\)"):
            pending.get(timeout=10)
        assert wait_until(lambda: all_gone(pids), 5)
        again = HostMesh.connect([address]).spawn_procs(per_host={"n": 1}).spawn("m", Mortal)
        assert again.pid.call_one().get(timeout=20) not in pids
    finally:
        agent.stdin.close()
        agent.wait(10)
