"""The per-process messaging endpoint: one authenticated reply socket, an I/O thread.

Every process of the runtime (controller, proc) has exactly one :class:`Mailbox`: requests
and their futures, supervision of the procs it owns, and the events agents send it, routed
to per-run subscriptions (:meth:`Mailbox.subscribe`). What runs where underneath:
:mod:`.io_thread` (the I/O thread, the links to agents, who reads the reply socket),
:mod:`.heartbeats` (heartbeats on the links), :mod:`.events` (the routing).
Every message is defined in :mod:`..protocol`.
"""

from __future__ import annotations

import atexit
import dataclasses
import itertools
import pickle
import sys
import threading
import traceback
import weakref
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import zmq

from .. import protocol
from ..errors import ActorError, Failure, RelayLost, SupervisionError, remote_error
from ..transport import wire
from ..transport.keys import Keys, keys_from_environment
from .events import EventRouter, Handler, Subscription
from .future import Future
from .io_thread import MailboxIO


@dataclasses.dataclass
class _OwnedProc:
    agent: str
    host: str
    mesh: weakref.ReferenceType[Any] | None
    owner_actor: str | None  # actor (in this process) that spawned it, if any


class Mailbox(MailboxIO):
    _instance: Mailbox | None = None
    _instance_lock = threading.Lock()

    def __init__(self, keys: Keys, owner: str | None = None, proc_id: str | None = None) -> None:
        self.owner = owner  # reply address of whoever spawned this process
        #: The client (no owner) reads nothing but plain data from hosts, relays and procs:
        #: code flows only from it (docs/runtime.md, "Security").
        self.plain_only = owner is None
        self.proc_id = proc_id
        self._lock = threading.Lock()
        self._ids = itertools.count(1)
        self._pending: dict[int, tuple[Future[Any], str | None, str | None]] = {}
        #: Requests sent to a host through a relay (runtime/agent/forwarding.py), by call id: the relay.
        self._carried_by: dict[int, str] = {}
        self._by_proc: dict[str, set[int]] = {}
        self._dead: dict[str, Failure] = {}
        self._procs: dict[str, _OwnedProc] = {}
        self._stopping: set[str] = set()
        self.unhandled: list[Failure] = []
        self.events = EventRouter()
        self._watchers: dict[str, Callable[[str, float], None]] = {}
        self._relays: dict[str, tuple[str, str | None]] = {}  # address -> (agent relaying to it, proc id)
        #: Set inside procs: called (from the I/O thread) to run an owner's ``__supervise__``.
        self.supervisor: Callable[[Failure, str], None] | None = None
        self._own_events: dict[str, Callable[[Any], None]] = {
            protocol.kind_of(protocol.ProcExited): self._on_proc_exit,
            protocol.kind_of(protocol.Unhandled): self._on_unhandled,
            protocol.kind_of(protocol.EndpointError): self._on_endpoint_error,
        }
        super().__init__(keys)

    # ----------------------------------------------------------------- lifecycle
    @classmethod
    def get(cls, keys: Keys | None = None) -> Mailbox:
        """This process's mailbox, created on first use (keys from the environment or new)."""
        inst = cls._instance
        if inst is not None:
            if keys is not None and keys != inst.keys:
                raise RuntimeError(
                    "this process is already connected with other reservation keys; "
                    "one process can drive one reservation"
                )
            return inst
        with cls._instance_lock:
            if cls._instance is None:
                cls._instance = Mailbox(keys or keys_from_environment() or Keys.generate())
                atexit.register(cls._instance.close)
            return cls._instance

    _by_keys: dict[Keys, Mailbox] = {}

    @classmethod
    def for_keys(cls, keys: Keys) -> Mailbox:
        """A mailbox holding ``keys``: the process's own if it matches, else one kept per key pair.

        Lets one process talk to several reservations (``monarch serve --replace`` checks
        the old one, then reserves with new keys); actor meshes use :meth:`get`.
        """
        primary = cls._instance
        if primary is not None and primary.keys == keys:
            return primary
        if primary is None:
            return cls.get(keys)
        with cls._instance_lock:
            box = cls._by_keys.get(keys)
            if box is None:
                box = cls._by_keys[keys] = Mailbox(keys)
                atexit.register(box.close)
            return box

    @classmethod
    def discard(cls, keys: Keys) -> None:
        """Close and forget the mailbox kept for ``keys`` (a released reservation's): its threads,
        sockets and ZeroMQ context go now, not at exit. The process's own mailbox stays."""
        with cls._instance_lock:
            box = cls._by_keys.pop(keys, None)
        if box is not None:
            atexit.unregister(box.close)
            box.close(release=True)

    @classmethod
    def install(cls, mailbox: Mailbox) -> None:
        cls._instance = mailbox

    @classmethod
    def current(cls) -> Mailbox | None:
        return cls._instance

    def close(self, release: bool = False) -> None:
        """Tell agents this client is gone (so they reap its procs now), then stop; with
        ``release``, also free the sockets and context once both threads have ended."""
        if self._closing:
            return
        agents = self._beats.agents | set(self._via.values())  # (a relay holds what is on its way to us)
        for agent in agents:
            try:
                self.send(agent, protocol.ClientExit(self.address))
            except zmq.ZMQError:
                pass
        self._closing = True
        try:
            self._send_wake()
            self._thread.join(timeout=2.0)
        except zmq.ZMQError:
            pass
        for sock in getattr(self._tls, "socks", {}).values():
            sock.close(linger=500)
        if release:
            # zmq_close is not thread-safe: free the sockets only when no thread of ours can be
            # using them (the I/O loop ended, nobody waiting on a reply); else leave them to exit.
            if not self._thread.is_alive() and self._reader.acquire(timeout=1.0):
                self.transport.close()

    # ------------------------------------------------------------------- sending
    def send(self, address: str, msg: Any, body: Sequence[Any] = ()) -> None:
        """Send one :mod:`..protocol` message (its body frames from :func:`..transport.wire.dumps`)."""
        head = (msg.KIND, *msg)
        if address in self._linked:
            through = self._relays.get(address)
            if through is not None:  # a proc (or, in a proc, its client) reached only through an agent
                agent, proc_id = through
                relay = protocol.RelayToProc(proc_id, address) if proc_id else protocol.RelayToClient(address)
                self.send(agent, relay, wire.frames(head, body))
            else:
                self._send_link(address, wire.frames(head, body))
            return
        socks: dict[str, zmq.Socket] | None = getattr(self._tls, "socks", None)
        if socks is None:
            socks = self._tls.socks = {}
        sock = socks.get(address)
        if sock is None:
            sock = socks[address] = self.transport.dealer(address)
        wire.send_message(sock, head, body)

    def request(
        self,
        address: str,
        make: Callable[[int], Any],
        body: Sequence[Any] = (),
        proc_id: str | None = None,
        actor: str | None = None,
    ) -> Future[Any]:
        """Send the request ``make(cid)`` that expects one ``result``; the future fails if ``proc_id`` dies."""
        fut: Future[Any] = Future()
        if address not in self._linked:  # an agent's answer comes to the I/O thread, not to a pump
            fut._mailbox = self
        cid = next(self._ids)
        relay = self._via.get(address) if self._via else None
        with self._lock:
            failure = self._dead.get(proc_id) if proc_id else None
            if failure is None:
                self._pending[cid] = (fut, proc_id, actor)
                if relay is not None:
                    self._carried_by[cid] = relay
                if proc_id is not None:
                    ids = self._by_proc.get(proc_id)
                    if ids is None:
                        ids = self._by_proc[proc_id] = set()
                    ids.add(cid)
        if failure is not None:
            fut.set_exception(SupervisionError(failure, actor))
            return fut
        self.send(address, make(cid), body)
        return fut

    def expect(
        self, proc_id: str | None = None, actor: str | None = None, relayed: bool = False
    ) -> tuple[int, Future[Any]]:
        """Reserve a call id whose result someone else (a new proc) will send (``relayed``:
        through its agent, so it arrives on a link, not on this mailbox's own socket)."""
        fut: Future[Any] = Future()
        if not relayed:
            fut._mailbox = self
        cid = next(self._ids)
        with self._lock:
            self._pending[cid] = (fut, proc_id, actor)
            if proc_id is not None:
                self._by_proc.setdefault(proc_id, set()).add(cid)
        return cid, fut

    def relay_through(self, address: str, agent: str, proc_id: str | None = None) -> None:
        """Reach ``address`` (proc ``proc_id``'s inbox; in a proc, its client) through the host
        agent ``agent``: for hosts and clients that cannot connect to each other. Answers to
        what is sent there arrive on the agent's link, read by the I/O thread."""
        self._relays[address] = (agent, proc_id)
        self._linked.add(address)

    def reply(self, address: str, call_id: int, ok: bool, value: Any) -> None:
        """Send a call's outcome; an unpicklable value becomes an error, never a lost reply."""
        try:
            body = wire.dumps(value)
        except Exception as e:  # noqa: BLE001
            ok = False
            body = wire.dumps((f"result could not be pickled: {type(e).__name__}: {e}", traceback.format_exc(), None))
        self.send(address, protocol.Result(call_id, ok), body)

    # ------------------------------------------------------------------- events
    def subscribe(
        self, run_id: str | None, handlers: Mapping[type[Any], Handler], thread: str | None = None
    ) -> Subscription:
        """Receive ``run_id``'s events of these :mod:`..protocol` types (every run's, with None)
        until the subscription is closed; use it as a context manager. Handlers that may block
        (on a console) name a ``thread`` of their own: the I/O thread keeps the heartbeats."""
        return self.events.subscribe(run_id, handlers, thread)

    # ------------------------------------------------------------- supervision
    def track_proc(self, proc_id: str, agent: str, host: str, mesh: Any, owner_actor: str | None) -> None:
        """Own ``proc_id``: its exit is supervised here, and its agent is heartbeated."""
        self._procs[proc_id] = _OwnedProc(agent, host, weakref.ref(mesh) if mesh is not None else None, owner_actor)
        self.link(agent)
        self.heartbeat(agent)

    def watch_agent(self, agent: str, on_lost: Callable[[str, float], None]) -> None:
        """Heartbeat ``agent`` until :meth:`unwatch_agent`; call ``on_lost(agent, silence)`` if it goes quiet."""
        self._watchers[agent] = on_lost
        self.link(agent)
        self.heartbeat(agent)

    def unwatch_agent(self, agent: str) -> None:
        self._watchers.pop(agent, None)

    def _wanted_agents(self) -> set[str]:
        return {rec.agent for rec in list(self._procs.values())} | set(self._watchers)

    def _agent_lost(self, agent: str, silent_for: float) -> None:
        watcher = self._watchers.pop(agent, None)
        if watcher is not None:
            watcher(agent, silent_for)
        for proc_id, rec in list(self._procs.items()):
            if rec.agent == agent:
                self.proc_failed(
                    proc_id,
                    Failure(
                        proc=proc_id,
                        host=rec.host,
                        pid=None,
                        reason=f"its host agent {agent} stopped answering ({silent_for:.1f} s without a heartbeat)",
                    ),
                )

    def _relay_lost(self, relay: str) -> None:
        """What was asked of hosts through ``relay`` and not answered is lost with it: fail it now
        (the hosts are linked directly from here on; a request is not sent twice)."""
        with self._lock:
            cids = [cid for cid, r in self._carried_by.items() if r == relay]
            entries = [self._pending.pop(cid, None) for cid in cids]
            for cid in cids:
                del self._carried_by[cid]
        for entry in entries:
            if entry is not None:
                entry[0].set_exception(RelayLost(relay))

    def expect_exit(self, proc_ids: Iterable[str]) -> None:
        """These procs are being stopped on purpose: their exits are not failures."""
        self._stopping.update(proc_ids)

    def failure_of(self, proc_id: str) -> Failure | None:
        return self._dead.get(proc_id)

    def proc_failed(self, proc_id: str, failure: Failure, expected: bool = False) -> None:
        """Fail every pending call to ``proc_id``; supervise the failure unless it was asked for."""
        if proc_id in self._stopping:
            self._stopping.discard(proc_id)
            expected = True
            failure = dataclasses.replace(failure, reason="stopped")
        with self._lock:
            if proc_id in self._dead:
                return
            self._dead[proc_id] = failure
            ids = self._by_proc.pop(proc_id, ())
            entries = [self._pending.pop(i) for i in ids if i in self._pending]
        for fut, _, actor in entries:
            if not fut.done():
                fut.set_exception(SupervisionError(failure, actor))
        rec = self._procs.pop(proc_id, None)
        if expected or rec is None:
            return
        mesh = rec.mesh() if rec.mesh is not None else None
        if mesh is not None:
            mesh._record_failure(failure)
        if self.supervisor is not None and rec.owner_actor is not None:
            self.supervisor(failure, rec.owner_actor)
        else:
            self.unhandled_failure(failure)

    def unhandled_failure(self, failure: Failure) -> None:
        """No owner handled ``failure``: hand it up, or (at the controller) report it."""
        if self.owner is not None and self.proc_id is not None:
            self.send(self.owner, protocol.Unhandled(self.proc_id, failure))
            return
        self.unhandled.append(failure)
        print(f"monarch: unhandled failure: {failure.describe()}", file=sys.stderr, flush=True)

    # ------------------------------------------------------------------ receiving
    def _handle_message(self, frames: list[zmq.Frame]) -> None:
        try:
            head, body = wire.parse(frames, plain=self.plain_only)
        except pickle.UnpicklingError as e:  # not plain data (or torn): refused, said once per kind
            why = f"refused a message: {e}"  # (rare: made at once)
            self._dropped("not plain data", lambda: why)
            return
        if head and head[0] == "batch":  # an agent's events of one round: each as if sent alone
            try:
                batch = protocol.decode(head)
            except TypeError:
                batch = None
            if batch is not None:
                for event_head, event_body in protocol.unbatch(batch, body):
                    try:
                        self._dispatch(event_head, event_body)
                    except Exception:  # noqa: BLE001 - as for a message alone: the others still count
                        traceback.print_exc()
                return
        self._dispatch(head, body)

    def _dispatch(self, head: tuple[Any, ...], body: list[Any]) -> None:
        try:
            msg = protocol.decode(head)
        except (KeyError, TypeError):  # from a newer agent or proc: say so once per kind, go on
            self._dropped(str(head[0]) if head else "?", lambda: protocol.not_understood(head, "this client"))
            return
        if msg.KIND == "result":
            self._on_result(msg, body)
            return
        own = self._own_events.get(msg.KIND)
        if own is not None:
            own(msg)
        else:
            self.events.deliver(msg, body)

    def _on_result(self, msg: protocol.Result, body: list[Any]) -> None:
        cid = msg.cid
        with self._lock:
            entry = self._pending.pop(cid, None)
            if self._carried_by:
                self._carried_by.pop(cid, None)
            if entry is not None and entry[1] is not None:
                ids = self._by_proc.get(entry[1])
                if ids is not None:
                    ids.discard(cid)
        if entry is None:
            return  # the call already failed (its proc died); a late answer is dropped
        fut = entry[0]
        try:
            value = wire.loads(body, plain=self.plain_only, lenient=not msg.ok)
        except BaseException as e:  # noqa: BLE001
            fut.set_exception(ActorError(f"could not decode the result: {type(e).__name__}: {e}"))
            return
        if msg.ok:
            fut.set_result(value)
        else:
            fut.set_exception(remote_error(value))

    def _dropped(self, kind: str, why: Callable[[], str]) -> None:
        """Count a message not handled; say why the first time its kind is dropped."""
        if kind not in self.events.dropped:
            print(f"monarch: {why()}", file=sys.stderr, flush=True)
        self.events.dropped[kind] = self.events.dropped.get(kind, 0) + 1

    def _on_proc_exit(self, msg: protocol.ProcExited) -> None:
        self.proc_failed(msg.proc_id, msg.failure, msg.expected)

    def _on_unhandled(self, msg: protocol.Unhandled) -> None:
        child_proc = msg.proc_id
        wrapped = dataclasses.replace(
            msg.failure,
            reason=f"owner proc {child_proc} did not handle a failure in a mesh it owns: {msg.failure.describe()}",
        )
        if child_proc in self._procs:
            rec = self._procs[child_proc]
            self.proc_failed(child_proc, Failure(proc=child_proc, host=rec.host, pid=None, reason=wrapped.reason))
        else:
            self.unhandled_failure(wrapped)

    def _on_endpoint_error(self, msg: protocol.EndpointError) -> None:
        print(f"monarch: {msg.message}", file=sys.stderr, flush=True)
