"""Host, proc and actor meshes, and the adverbs that call endpoints on them.

Meshes are plain references (addresses and a shape): they pickle, so they can be passed
to actors in messages, and they route through whichever process's mailbox unpickles them.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import functools
import itertools
import os
import queue
import sys
import threading
import uuid
from collections.abc import Callable, Iterator, Sequence
from typing import Any, cast

from ...config import settings
from .. import protocol
from ..errors import ActorError, Failure, MonarchError
from ..mailbox.future import Future, gather
from ..mailbox.mailbox import Mailbox
from ..transport import wire
from .actor import NOT_IN_A_PROC, context, current_bootstrap, current_inbox, endpoints_of, spawn_here
from .shape import Index, Shape, ValueMesh


@dataclasses.dataclass(frozen=True)
class HostRef:
    agent: str  # the host agent's address
    host: str
    relay: bool = False  # its procs and this process cannot connect to each other: go through the agent


@dataclasses.dataclass(frozen=True)
class ProcRef:
    proc_id: str
    inbox: str
    agent: str
    host: str
    pid: int


@dataclasses.dataclass(frozen=True)
class ActorRef:
    proc: ProcRef
    key: str  # the actor's key inside its proc


class _Mesh:
    """What every mesh shares: a shape, one member per point, and slicing."""

    def __init__(self, shape: Shape, members: Sequence[Any]) -> None:
        if len(shape) != len(members):
            raise ValueError(f"shape {shape.extent} has {len(shape)} points but {len(members)} members")
        self._shape = shape
        self._members = list(members)

    @property
    def shape(self) -> Shape:
        return self._shape

    @property
    def extent(self) -> dict[str, int]:
        return self._shape.extent

    def __len__(self) -> int:
        return len(self._members)

    def slice(self, **dims: Index) -> Any:
        """A sub-mesh: ``mesh.slice(hosts=0, gpus=slice(0, 2))``."""
        shape, ranks = self._shape.select(**dims)
        clone = object.__new__(type(self))
        clone.__dict__.update(self.__dict__)
        clone._shape = shape
        clone._members = [self._members[r] for r in ranks]
        return clone

    def _with_members(self, shape: Shape, members: Sequence[Any]) -> Any:
        clone = object.__new__(type(self))
        clone.__dict__.update(self.__dict__)
        clone._shape = shape
        clone._members = list(members)
        return clone


class HostMesh(_Mesh):
    """Host agents, one per host, that spawn and supervise procs."""

    @classmethod
    def connect(cls, agents: Sequence[str], dim: str = "hosts", relay: Sequence[bool] | None = None) -> HostMesh:
        """A mesh over running agents (addresses as they print them, or forwards to them),
        checked with a ping. ``relay`` (per agent): this process and that host's procs cannot
        connect to each other, so messages between them pass through its agent."""
        relay = list(relay) if relay is not None else [False] * len(agents)
        if len(relay) != len(agents):
            raise ValueError(f"relay has {len(relay)} entries for {len(agents)} agents")
        mb = Mailbox.get()
        for a in agents:
            mb.link_directly(a)  # (not through a relay a run in this process once routed it by)
        pings = [mb.request(a, lambda cid: protocol.Ping(cid, mb.address)) for a in agents]
        refs = []
        for agent, fut, through in zip(agents, pings, relay):
            try:
                info = fut.get(timeout=settings().spawn_timeout)
            except MonarchError as e:
                raise MonarchError(f"host agent {agent} did not answer: {e}") from None
            refs.append(HostRef(agent, info["host"], bool(through)))
        return cls(Shape({dim: len(refs)}), refs)

    def spawn_procs(self, per_host: dict[str, int] | None = None, name: str = "procs") -> ProcMesh:
        """Start ``per_host`` procs on every host; returns once every proc is ready."""
        per_host = dict(per_host or {})
        proc_shape = Shape({**self.extent, **per_host})
        if set(per_host) & set(self.extent):
            raise ValueError(f"per_host dimensions {list(per_host)} clash with host dimensions {list(self.extent)}")
        local = len(Shape(per_host))
        mb = Mailbox.get()
        ctx = context()
        uid = f"{name}-{uuid.uuid4().hex[:8]}"
        mesh = ProcMesh.__new__(ProcMesh)
        mesh._name = uid
        mesh._failures = []
        ready: list[Future[Any]] = []
        acks = []
        for h, host in enumerate(self._members):
            specs = []
            for i in range(local):
                proc_id = f"{uid}.{h * local + i}"
                cid, fut = mb.expect(proc_id, relayed=host.relay)
                ready.append(fut)
                mb.track_proc(proc_id, host.agent, host.host, mesh, ctx._key)
                specs.append((proc_id, cid))
            body = wire.dumps((specs, dataclasses.asdict(settings()), _import_context()))
            acks.append(
                mb.request(
                    host.agent, functools.partial(protocol.SpawnProcs, reply_to=mb.address, relay=host.relay), body
                )
            )
        timeout = settings().spawn_timeout
        for fut in acks:
            fut.get(timeout=timeout)
        refs = []
        for h, host in enumerate(self._members):
            for i in range(local):
                proc_id = f"{uid}.{h * local + i}"
                inbox, pid = ready[h * local + i].get(timeout=timeout)
                if host.relay:
                    mb.relay_through(inbox, host.agent, proc_id)
                refs.append(ProcRef(proc_id, inbox, host.agent, host.host, pid))
        _Mesh.__init__(mesh, proc_shape, refs)
        return mesh

    def __repr__(self) -> str:
        return f"HostMesh({self.extent}, hosts={[h.host for h in self._members]})"


def _import_context() -> dict[str, Any]:
    """What a proc needs to import what the spawner can: its ``sys.path`` and cwd."""
    return {"sys_path": [os.path.abspath(p or ".") for p in sys.path], "cwd": os.getcwd()}


class ProcMesh(_Mesh):
    """Processes that host actors; one actor of each spawned mesh per proc."""

    _name: str
    _failures: list[Failure]

    def spawn(self, name: str, actor_class: type, *args: Any, **kwargs: Any) -> ActorMesh:
        """One ``actor_class(*args, **kwargs)`` per proc; raises :class:`ActorError` if any constructor fails."""
        if not isinstance(actor_class, type):
            raise TypeError(f"spawn needs an Actor class, not {actor_class!r}")
        mb = Mailbox.get()
        key = f"{name}#{uuid.uuid4().hex[:8]}"
        body = wire.dumps((actor_class, args, kwargs))
        here = current_bootstrap()
        futs = []
        for point, proc in zip(self._shape.points(), self._members):
            if here is not None and proc.proc_id == here["proc_id"]:
                # Spawning beside ourselves: construct in place (a message to our own
                # inbox would wait behind the endpoint that is running now).
                spawn_here(key, name, point, actor_class, args, kwargs)
                continue
            futs.append(
                mb.request(
                    proc.inbox,
                    functools.partial(protocol.Spawn, reply_to=mb.address, key=key, name=name, point=point),
                    body,
                    proc_id=proc.proc_id,
                    actor=name,
                )
            )
        gather(futs).get(timeout=settings().spawn_timeout)
        members = [ActorRef(p, key) for p in self._members]
        return ActorMesh(self._shape, members, name, endpoints_of(actor_class), actor_class.__name__)

    def stop(self) -> Future[None]:
        """Stop every proc once it has handled what was already sent to it; a future of when they are gone.

        As in Monarch: ``procs.stop().get()`` from threads, ``await procs.stop()`` from
        coroutines. The stop starts at once, whether or not the future is waited on. Procs
        that do not stop within ``stop_grace`` get SIGTERM, then SIGKILL.
        """
        mb = Mailbox.get()
        mb.expect_exit(p.proc_id for p in self._members)
        # Sent from the caller's thread, so they queue behind what this thread already sent.
        drained = [
            mb.request(p.inbox, lambda cid: protocol.Stop(cid, mb.address), proc_id=p.proc_id)
            for p in self._members
            if mb.failure_of(p.proc_id) is None
        ]
        return _in_background(lambda: self._stop(drained), f"stop {self._name}")

    def _stop(self, drained: list[Future[Any]]) -> None:
        mb = Mailbox.get()
        for fut in drained:
            try:
                fut.get(timeout=settings().stop_grace)
            except MonarchError:
                pass  # it died or hung: the agent below deals with it
        by_agent: dict[str, list[str]] = {}
        for p in self._members:
            by_agent.setdefault(p.agent, []).append(p.proc_id)
        futs = [
            mb.request(
                agent,
                functools.partial(protocol.StopProcs, reply_to=mb.address, proc_ids=ids, grace=settings().stop_grace),
            )
            for agent, ids in by_agent.items()
        ]
        gather(futs).get(timeout=settings().stop_grace + 10)

    def _record_failure(self, failure: Failure) -> None:
        self._failures.append(failure)

    @property
    def failures(self) -> list[Failure]:
        """Failures supervision has seen for procs of this mesh."""
        return list(self._failures)

    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        state["_failures"] = []
        return state

    def __repr__(self) -> str:
        return f"ProcMesh({self._name}, {self.extent})"


class ActorMesh(_Mesh):
    """One actor per point; endpoints are attributes: ``mesh.train.call(batch)``."""

    def __init__(self, shape: Shape, members: Sequence[ActorRef], name: str, endpoints: frozenset, cls_name: str):
        super().__init__(shape, members)
        self._name = name
        self._endpoints = endpoints
        self._cls_name = cls_name
        self._rr = itertools.count()

    def __getattr__(self, attr: str) -> EndpointRef:
        if attr.startswith("_"):
            raise AttributeError(attr)
        if attr not in self._endpoints:
            raise AttributeError(
                f"{self._cls_name}.{attr} is not an endpoint (endpoints: {', '.join(sorted(self._endpoints)) or 'none'})"
            )
        return EndpointRef(self, attr)

    def stop(self) -> Future[None]:
        """Remove the actors once the messages already sent to them are handled; a future of when that is done."""
        mb = Mailbox.get()
        futs = [
            mb.request(
                a.proc.inbox,
                functools.partial(protocol.StopActor, reply_to=mb.address, key=a.key),
                proc_id=a.proc.proc_id,
            )
            for a in self._members
        ]
        return gather(futs).then(lambda _results: None)

    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        del state["_rr"]
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._rr = itertools.count()

    def __repr__(self) -> str:
        return f"ActorMesh({self._name}: {self._cls_name}, {self.extent})"


class EndpointRef:
    """An endpoint of an actor mesh, with Monarch's adverbs."""

    __slots__ = ("_mesh", "_method")

    def __init__(self, mesh: ActorMesh, method: str) -> None:
        self._mesh = mesh
        self._method = method

    def _send(self, ref: ActorRef, body: list[Any], mb: Mailbox) -> Future[Any]:
        method = self._method
        fut = mb.request(
            ref.proc.inbox,
            lambda cid: protocol.Call(cid, mb.address, ref.key, method),
            body,
            proc_id=ref.proc.proc_id,
            actor=self._mesh._name,
        )
        if mb.proc_id is not None and ref.proc.proc_id == mb.proc_id:
            fut._same_proc = True
        return fut

    def call(self, *args: Any, **kwargs: Any) -> Future[ValueMesh[Any]]:
        """Call every actor; a future of their results as a :class:`ValueMesh`."""
        mb = Mailbox.get()
        body = wire.dumps((args, kwargs))
        shape = self._mesh._shape
        futs = [self._send(ref, body, mb) for ref in self._mesh._members]
        return gather(futs).then(lambda values: ValueMesh(shape, values))

    def call_one(self, *args: Any, **kwargs: Any) -> Future[Any]:
        """Call the only actor of a one-actor mesh."""
        members = self._mesh._members
        if len(members) != 1:
            raise ValueError(
                f"call_one needs a mesh of exactly one actor; this one has {len(members)} "
                f"({self._mesh.extent}): slice it first"
            )
        mb = Mailbox.get()
        return self._send(members[0], wire.dumps((args, kwargs)), mb)

    def choose(self, *args: Any, **kwargs: Any) -> Future[Any]:
        """Call one actor of the mesh (round robin over live procs)."""
        mb = Mailbox.get()
        members = self._mesh._members
        for _ in range(len(members)):
            ref = members[next(self._mesh._rr) % len(members)]
            if mb.failure_of(ref.proc.proc_id) is None:
                break
        return self._send(ref, wire.dumps((args, kwargs)), mb)

    def broadcast(self, *args: Any, **kwargs: Any) -> None:
        """Send to every actor without waiting; an error is reported on the caller's stderr."""
        mb = Mailbox.get()
        body = wire.dumps((args, kwargs))
        method = self._method
        for ref in self._mesh._members:
            mb.send(ref.proc.inbox, protocol.Call(None, mb.address, ref.key, method), body)

    def stream(self, *args: Any, **kwargs: Any) -> Iterator[Future[Any]]:
        """Call every actor; yield each (already resolved) future as it completes."""
        mb = Mailbox.get()
        body = wire.dumps((args, kwargs))
        futs = [self._send(ref, body, mb) for ref in self._mesh._members]
        done: queue.SimpleQueue[Future[Any]] = queue.SimpleQueue()

        def _put(f: concurrent.futures.Future[Any]) -> None:
            # a done callback is given the future it was added to (here one of ours): typeshed types it as the base class
            done.put(cast(Future[Any], f))

        for f in futs:
            f.add_done_callback(_put)

        def _iter() -> Iterator[Future[Any]]:
            for _ in futs:
                yield done.get()

        return _iter()


# ----------------------------------------------------------------- entry points
_local_host: HostMesh | None = None


def this_host() -> HostMesh:
    """The host this code runs on, as a one-host mesh that can spawn procs.

    In the controller it starts a private host agent (stopped when the controller exits);
    inside an actor it is the agent that spawned the actor's proc.
    """
    global _local_host
    if _local_host is None:
        boot = current_bootstrap()
        if boot is not None:
            _local_host = HostMesh(Shape({}), [HostRef(boot["agent"], boot["host"])])
        else:
            from ..launch.start import start_private_agent

            mb = Mailbox.get()
            addr = start_private_agent(mb.keys)
            _local_host = HostMesh.connect([addr])
            _local_host = _local_host._with_members(Shape({}), _local_host._members)
    return _local_host


def this_proc() -> ProcMesh:
    """The proc this actor runs in, as a one-proc mesh (``this_proc().spawn(...)``)."""
    boot = current_bootstrap()
    if boot is None:
        raise MonarchError(NOT_IN_A_PROC)
    mesh = ProcMesh.__new__(ProcMesh)
    mesh._name = boot["proc_id"]
    mesh._failures = []
    ref = ProcRef(boot["proc_id"], current_inbox(), boot["agent"], boot["host"], boot["pid"])
    _Mesh.__init__(mesh, Shape({}), [ref])
    return mesh


__all__ = [
    "ActorError",
    "ActorMesh",
    "EndpointRef",
    "HostMesh",
    "ProcMesh",
    "this_host",
    "this_proc",
]


def _in_background(work: Callable[[], None], name: str) -> Future[None]:
    """Run ``work`` on a thread now; its outcome resolves the returned future."""
    out: Future[None] = Future()

    def _run() -> None:
        try:
            work()
        except BaseException as e:  # noqa: BLE001 - handed to the waiter
            out.set_exception(e)
        else:
            out.set_result(None)

    threading.Thread(target=_run, name=name, daemon=True).start()
    return out
