"""The user-facing actor API, on real agents and procs."""

from __future__ import annotations

import asyncio
import os
import threading
import time

import pytest

from monarch_cli import (
    Actor,
    ActorError,
    CallTimeout,
    HostMesh,
    MonarchError,
    ValueMesh,
    context,
    current_rank,
    current_size,
    endpoint,
    this_host,
    this_proc,
)
from monarch_cli.runtime.mailbox.mailbox import Mailbox


class Counter(Actor):
    def __init__(self, start: int = 0) -> None:
        self.value = start
        self.seen: list = []

    @endpoint
    def incr(self, n: int = 1) -> int:
        self.value += n
        return self.value

    @endpoint
    async def slow_incr(self, n: int, delay: float) -> int:
        await asyncio.sleep(delay)
        self.value += n
        return self.value

    @endpoint
    async def meet(self, mine: str, theirs: str, timeout: float) -> bool:
        """Leave ``mine``, then wait for ``theirs``: True only if the other call ran meanwhile."""
        open(mine, "w").close()
        deadline = time.monotonic() + timeout
        while not os.path.exists(theirs):
            if time.monotonic() > deadline:
                return False
            await asyncio.sleep(0.01)
        return True

    @endpoint
    def record(self, x: int) -> None:
        self.seen.append(x)

    @endpoint
    def history(self) -> list:
        return self.seen

    @endpoint
    def whoami(self) -> dict:
        ctx = context()
        return {
            "rank": dict(current_rank()),
            "flat": current_rank().rank,
            "size": current_size(),
            "name": ctx.actor_name,
            "pid": os.getpid(),
        }

    @endpoint
    def fail(self, message: str) -> None:
        raise ValueError(message)

    @endpoint
    def sleep(self, seconds: float) -> float:
        time.sleep(seconds)
        return seconds


@pytest.fixture(scope="module")
def procs():
    mesh = this_host().spawn_procs(per_host={"gpus": 4})
    yield mesh
    mesh.stop().get()


@pytest.fixture()
def counters(procs):
    mesh = procs.spawn("counter", Counter, 10)
    yield mesh
    mesh.stop().get()


def test_call_returns_a_value_mesh_with_one_result_per_actor(counters):
    result = counters.incr.call(5).get(timeout=10)
    assert isinstance(result, ValueMesh)
    assert result.values() == [15, 15, 15, 15]
    assert [dict(p) for p, _ in result.items()] == [{"gpus": i} for i in range(4)]


def test_spawn_passes_keyword_arguments_to_the_constructor(procs):
    mesh = procs.spawn("from_kwargs", Counter, start=100)
    try:
        assert mesh.incr.call(n=2).get(timeout=10).values() == [102] * 4
    finally:
        mesh.stop().get()


def test_actors_live_in_separate_processes_and_know_their_rank(counters):
    who = counters.whoami.call().get(timeout=10)
    assert len({w["pid"] for w in who.values()}) == 4
    assert os.getpid() not in {w["pid"] for w in who.values()}
    assert [w["rank"] for w in who.values()] == [{"gpus": i} for i in range(4)]
    assert all(w["size"] == {"gpus": 4} and w["name"] == "counter" for w in who.values())


def test_slice_and_call_one(counters):
    one = counters.slice(gpus=2)
    assert one.incr.call_one(1).get(timeout=10) == 11
    assert counters.incr.call(0).get(timeout=10).item(gpus=2) == 11
    assert counters.incr.call(0).get(timeout=10).item(gpus=1) == 10
    with pytest.raises(ValueError, match="exactly one actor"):
        counters.incr.call_one(1)
    pair = counters.slice(gpus=slice(0, 4, 2))
    assert pair.extent == {"gpus": 2}
    assert pair.whoami.call().get(timeout=10).values()[1]["rank"] == {"gpus": 2}


def test_broadcast_is_fire_and_forget_but_ordered(counters):
    for i in range(200):
        counters.record.broadcast(i)
    histories = counters.history.call().get(timeout=10)
    assert all(h == list(range(200)) for h in histories.values())


def test_choose_spreads_calls_and_stream_yields_as_completed(counters):
    pids = {counters.whoami.choose().get(timeout=10)["pid"] for _ in range(8)}
    assert len(pids) == 4
    futures = list(counters.sleep.stream(0.05))
    assert len(futures) == 4 and all(f.done() for f in futures)
    assert [f.get() for f in futures] == [0.05] * 4


def test_async_endpoints_and_await(counters, tmp_path):
    async def main():
        a = counters.slice(gpus=0).slow_incr.call_one(1, 0.1)
        b = counters.slice(gpus=1).slow_incr.call_one(2, 0.1)
        return await a, await b

    assert asyncio.run(main()) == (11, 12)

    async def meeting():  # each waits for the other: they can only both succeed side by side
        x, y = str(tmp_path / "x"), str(tmp_path / "y")
        a = counters.slice(gpus=0).meet.call_one(x, y, 20.0)
        b = counters.slice(gpus=1).meet.call_one(y, x, 20.0)
        return await a, await b

    assert asyncio.run(meeting()) == (True, True)  # the two ran concurrently, on different procs


def test_async_endpoint_keeps_per_actor_message_order(counters):
    one = counters.slice(gpus=3)
    slow = one.slow_incr.call_one(100, 0.2)
    fast = one.incr.call_one(1)  # must wait for the slow one: messages to an actor run in order
    assert slow.get(timeout=10) == 110
    assert fast.get(timeout=10) == 111


def test_endpoint_exception_becomes_actor_error_and_actor_stays_usable(counters):
    with pytest.raises(ActorError) as info:
        counters.slice(gpus=1).fail.call_one("bad input").get(timeout=10)
    err = info.value
    assert "ValueError: bad input" in str(err)
    assert "counter.fail" in str(err)
    assert "raise ValueError(message)" in err.remote_traceback
    assert isinstance(err.exception, ValueError)
    assert counters.slice(gpus=1).incr.call_one(1).get(timeout=10) == 11


def test_future_timeout(counters):
    with pytest.raises(CallTimeout):
        counters.slice(gpus=0).sleep.call_one(1.0).get(timeout=0.1)


def test_unknown_endpoint_is_a_clear_error(counters):
    with pytest.raises(AttributeError, match="not an endpoint"):
        counters.nope


def test_constructor_failure_raises_at_spawn(procs):
    class Broken(Actor):
        def __init__(self):
            raise RuntimeError("no GPU here")

    with pytest.raises(ActorError, match="no GPU here"):
        procs.spawn("broken", Broken)


def test_closures_and_local_classes_travel_by_value(procs):
    factor = 7

    class Local(Actor):
        @endpoint
        def apply(self, fn, x):
            return fn(x)

    mesh = procs.slice(gpus=0).spawn("local", Local)
    assert mesh.apply.call_one(lambda v: v * factor, 6).get(timeout=10) == 42


def test_stopped_actor_mesh_refuses_calls_clearly(procs):
    mesh = procs.spawn("short", Counter)
    mesh.stop().get()
    with pytest.raises(ActorError, match="was stopped or never spawned"):
        mesh.slice(gpus=0).incr.call_one(1).get(timeout=10)


def test_calls_from_many_threads(counters):
    one = counters.slice(gpus=0)
    results = []

    def worker():
        for _ in range(50):
            results.append(one.incr.call_one(1).get(timeout=10))

    threads = [threading.Thread(target=worker, daemon=True) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(results) == list(range(11, 211))


class Spawner(Actor):
    """An actor that spawns others beside itself and hands their mesh back."""

    @endpoint
    async def make_child(self):
        child = this_proc().spawn("child", Counter, 100)
        return child, await child.incr.call_one(1)

    @endpoint
    async def make_child_through_context(self):
        """``context().proc`` is this proc too (the proc registers itself with the actor module)."""
        child = context().proc.spawn("ctx_child", Counter, 7)
        return await child.incr.call_one(1)

    @endpoint
    async def use(self, mesh):
        return (await mesh.incr.call(1)).values()

    @endpoint
    def block_on_own_proc(self):
        child = this_proc().spawn("blocked", Counter)
        return child.incr.call_one(1).get(timeout=5)

    @endpoint
    def spawn_procs_of_its_own(self):
        procs = this_host().spawn_procs(per_host={"workers": 2})
        mesh = procs.spawn("grandchild", Counter)
        values = mesh.whoami.call().get(timeout=20).values()
        procs.stop().get()
        return [v["pid"] for v in values]


def test_actor_spawns_actors_and_passes_mesh_refs(procs, counters):
    spawner = procs.slice(gpus=0).spawn("spawner", Spawner)
    child, first = spawner.make_child.call_one().get(timeout=20)
    assert first == 101
    assert spawner.make_child_through_context.call_one().get(timeout=20) == 8
    # The child mesh reference, created inside an actor, is usable from the controller...
    assert child.incr.call_one(1).get(timeout=10) == 102
    # ...and a mesh passed in a message is usable by the actor that receives it.
    assert spawner.use.call_one(counters).get(timeout=10) == [11, 11, 11, 11]
    with pytest.raises(ActorError, match="make the endpoint `async def` and `await`"):
        spawner.block_on_own_proc.call_one().get(timeout=20)
    pids = spawner.spawn_procs_of_its_own.call_one().get(timeout=30)
    assert len(set(pids)) == 2


def test_multi_dimensional_mesh_across_two_hosts(agents):
    hosts = HostMesh.connect(agents)
    assert hosts.extent == {"hosts": 2}
    procs = hosts.spawn_procs(per_host={"gpus": 4})
    try:
        assert procs.extent == {"hosts": 2, "gpus": 4}
        mesh = procs.spawn("counter", Counter)
        who = mesh.whoami.call().get(timeout=20)
        assert who.item(hosts=1, gpus=3)["rank"] == {"hosts": 1, "gpus": 3}
        assert who.item(hosts=1, gpus=3)["flat"] == 7
        assert all(w["size"] == {"hosts": 2, "gpus": 4} for w in who.values())
        assert {p.host for p in procs._members} == {"host0", "host1"}
        column = mesh.slice(gpus=1)
        assert column.extent == {"hosts": 2}
        assert [w["rank"] for w in column.whoami.call().get(timeout=10).values()] == [
            {"hosts": 0, "gpus": 1},
            {"hosts": 1, "gpus": 1},
        ]
    finally:
        procs.stop().get()


def _note_unpickled_in(path: str) -> str:
    with open(path, "a") as f:
        f.write(f"{os.getpid()}\n")
    return path


class _Tripwire:
    """Notes the pid of every process that unpickles it."""

    def __init__(self, path: str) -> None:
        self.path = path

    def __reduce__(self):
        return _note_unpickled_in, (self.path,)


def test_procs_relayed_through_their_agent_beside_direct_ones(agents, tmp_path):
    hosts = HostMesh.connect(agents, relay=[False, True])
    assert [h.relay for h in hosts._members] == [False, True]
    procs = hosts.spawn_procs(per_host={"gpus": 2})
    try:
        through = Mailbox.get()._relays  # inbox -> (agent, proc id)
        assert [through.get(p.inbox, (None,))[0] for p in procs._members] == [None, None, agents[1], agents[1]]
        mesh = procs.spawn("counter", Counter)
        relayed = mesh.slice(hosts=1)
        for i in range(20):
            relayed.record.broadcast(i)
        assert relayed.history.call().get(timeout=20).values() == [list(range(20))] * 2  # in order
        assert [w["flat"] for w in mesh.whoami.call().get(timeout=20).values()] == [0, 1, 2, 3]
        # The agent passes a relayed message's frames on as they are: only the proc unpickles them.
        wire = str(tmp_path / "unpickled")
        one = relayed.slice(gpus=0)
        pid = one.whoami.call_one().get(timeout=20)["pid"]
        assert one.record.call_one(_Tripwire(wire)).get(timeout=20) is None
        assert open(wire).read().split() == [str(pid)]
    finally:
        procs.stop().get()


def test_this_proc_outside_an_actor_is_a_clear_error():
    with pytest.raises(MonarchError, match="only available inside an actor"):
        this_proc()
    with pytest.raises(MonarchError, match="only available inside an actor"):
        context().proc


def test_connect_to_a_dead_address_fails_clearly():
    from monarch_cli import configure
    from monarch_cli.config import settings

    old = settings().spawn_timeout
    configure(spawn_timeout=0.5)
    try:
        with pytest.raises(MonarchError, match="did not answer"):
            HostMesh.connect(["tcp://127.0.0.1:1"])
    finally:
        configure(spawn_timeout=old)


def test_ipc_transport_works_end_to_end():
    from ..conftest import run_python

    proc = run_python(
        """
        from monarch_cli import Actor, configure, endpoint, this_host
        configure(transport="ipc")
        class Echo(Actor):
            @endpoint
            def echo(self, x):
                return x
        procs = this_host().spawn_procs(per_host={"gpus": 2})
        mesh = procs.spawn("echo", Echo)
        print(mesh.echo.call("hi").get(timeout=20).values())
        print(procs._members[0].inbox.split(":")[0])
        procs.stop().get()
        """
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split() == ["['hi',", "'hi']", "ipc"]


def test_stopping_a_proc_mesh_drains_what_was_sent_first(capfd):
    procs = this_host().spawn_procs(per_host={"gpus": 2})
    mesh = procs.spawn("counter", Counter)
    for i in range(50):
        mesh.record.broadcast(i)
    mesh.sleep.broadcast(0.3)  # still queued when stop() is called
    t = time.monotonic()
    procs.stop().get()
    assert time.monotonic() - t >= 0.3  # it waited for the queued work instead of killing it
    assert not procs.failures  # a requested stop is not a failure
    assert "unhandled failure" not in capfd.readouterr().err


def test_stop_returns_a_future_that_coroutines_can_await():
    """As in Monarch: `await procs.stop()`; the stop starts at once and the future resolves when procs are gone."""
    procs = this_host().spawn_procs(per_host={"gpus": 2})
    mesh = procs.spawn("counter", Counter)
    pids = [v["pid"] for v in mesh.whoami.call().get(timeout=20).values()]
    mesh.sleep.broadcast(1.5)
    t = time.monotonic()
    stopping = procs.stop()
    assert not stopping.done()  # returned before the queued work finished

    async def main() -> None:
        await stopping

    asyncio.run(main())
    assert time.monotonic() - t >= 1.5
    assert all(not os.path.exists(f"/proc/{pid}") or open(f"/proc/{pid}/stat").read().split()[2] == "Z" for pid in pids)
