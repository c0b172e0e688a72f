"""The per-process messaging endpoint: one authenticated reply socket, an I/O thread.

Every process of the runtime (controller, proc) has exactly one :class:`Mailbox`. Messages to
procs leave on a DEALER socket owned by the sending thread, so a send never waits for
another thread; their replies arrive on the mailbox's ROUTER.

Host agents are different: this process needs no inbound port for them. Each agent address
that is :meth:`~Mailbox.link`-ed gets one DEALER (its link), owned by the I/O thread and named
by this mailbox's address; the agent answers everything (results, rank output and exits,
debugger and telemetry traffic) through its ROUTER on that connection. Other threads hand
their sends to the I/O thread over an inproc queue, and the I/O thread reads the links, so
a future for an agent request is resolved by the I/O thread (its waiter does not ``pump``).
One TCP port per host is enough, reached directly or through a forward.

Who reads that ROUTER: a thread blocked in ``Future.get()`` reads it itself (``pump``), so a
round trip costs no hand-off between threads; whenever nobody is waiting that way, the I/O
thread reads it. A lock decides who may touch the socket; the I/O thread only ever tries
it, backing off for a couple of milliseconds when a waiter holds it, so it never blocks
heartbeats or ZAP handshakes behind a long wait.

Liveness never depends on how busy this process is: heartbeats have a thread of their own
(started when the first agent is watched), their own ZeroMQ context and their own
connection to the agent's one port (the agent answers on it), so no handler, such
as a run's output being printed to a slow terminal, can hold them up; an agent counts as
lost only when a heartbeat this process *sent* has gone unanswered for the timeout. A
reader also handles at most :data:`_DRAIN_BATCH` messages at a time, so a waiter under a
flood of output gets back to its own deadlines.
"""

from __future__ import annotations

import atexit
import dataclasses
import itertools
import sys
import threading
import time
import traceback
import weakref
from typing import Any, Callable, Dict, Iterable, List, Optional, Sequence, Set, Tuple

import zmq

from ..config import settings
from . import wire
from .errors import ActorError, Failure, SupervisionError
from .future import Future
from .keys import Keys, keys_from_environment

# Plain ints: `getsockopt(zmq.EVENTS) & zmq.POLLIN` builds enum flags, ~0.6 µs a time on the hot path.
EVENTS, POLLIN = int(zmq.EVENTS), int(zmq.POLLIN)

Header = Tuple[Any, ...]

#: Messages one reader handles before heartbeats get their turn.
_DRAIN_BATCH = 64


@dataclasses.dataclass
class _AgentWatch:
    last_ack: float
    sock: Optional[zmq.Socket] = None
    unanswered_since: Optional[float] = None  # when the oldest heartbeat not yet answered was sent


@dataclasses.dataclass
class _OwnedProc:
    agent: str
    host: str
    mesh: "weakref.ReferenceType[Any] | None"
    owner_actor: Optional[str]  # actor (in this process) that spawned it, if any


class Mailbox:
    _instance: Optional["Mailbox"] = None
    _instance_lock = threading.Lock()

    def __init__(self, keys: Keys, owner: Optional[str] = None, proc_id: Optional[str] = None) -> None:
        from .transport import Transport

        self.keys = keys
        self.owner = owner  # reply address of whoever spawned this process
        self.proc_id = proc_id
        self.transport = Transport(keys)
        self._reply, self.address = self.transport.bind_router()
        self._tls = threading.local()
        self._lock = threading.Lock()
        self._ids = itertools.count(1)
        self._pending: Dict[int, Tuple[Future[Any], Optional[str], Optional[str]]] = {}
        self._by_proc: Dict[str, Set[int]] = {}
        self._dead: Dict[str, Failure] = {}
        self._procs: Dict[str, _OwnedProc] = {}
        self._stopping: Set[str] = set()
        self._agents: Dict[str, _AgentWatch] = {}
        self._hb_transport: Optional[Any] = None  # own context: big transfers cannot delay heartbeats
        self.unhandled: List[Failure] = []
        #: Handlers for agent events other than proc exits (SPMD output and exits), by kind.
        self.event_handlers: Dict[str, Callable[[Header, List[zmq.Frame]], None]] = {}
        self._watchers: Dict[str, Callable[[str, float], None]] = {}
        #: Set inside procs: called (from the I/O thread) to run an owner's ``__supervise__``.
        self.supervisor: Optional[Callable[[Failure, str], None]] = None
        self._closing = False
        self._reader = threading.Lock()  # held by whoever is reading self._reply
        self._backoff_until = 0.0
        self._more = False  # a reader stopped with replies still queued: the I/O thread goes on
        self._wake_addr = f"inproc://mailbox-wake-{id(self)}"
        self._wake_rx = self.transport.ctx.socket(zmq.PULL)
        self._wake_rx.bind(self._wake_addr)
        #: Agent addresses reached through a link; the links themselves belong to the I/O thread.
        self._linked: Set[str] = set()
        self._links: Dict[str, zmq.Socket] = {}
        self._out_addr = f"inproc://mailbox-out-{id(self)}"
        self._out_rx = self.transport.ctx.socket(zmq.PULL)
        self._out_rx.rcvhwm = 0
        self._out_rx.bind(self._out_addr)
        self._watching = zmq.Poller()
        self._backing_off = zmq.Poller()
        self._thread = threading.Thread(target=self._io_loop, name="monarch-mailbox", daemon=True)
        self._thread.start()
        self._hb_thread: Optional[threading.Thread] = None
        self._hb_wake = threading.Event()

    # ----------------------------------------------------------------- lifecycle
    @classmethod
    def get(cls, keys: Optional[Keys] = None) -> "Mailbox":
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

    _by_keys: Dict[Keys, "Mailbox"] = {}

    @classmethod
    def for_keys(cls, keys: Keys) -> "Mailbox":
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
    def install(cls, mailbox: "Mailbox") -> None:
        cls._instance = mailbox

    @classmethod
    def current(cls) -> Optional["Mailbox"]:
        return cls._instance

    def close(self, release: bool = False) -> None:
        """Tell agents this client is gone (so they reap its procs now), then stop; with
        ``release``, also free the sockets and context once both threads have ended."""
        if self._closing:
            return
        for agent in list(self._agents):
            try:
                self.send(agent, ("client_exit", self.address))
            except zmq.ZMQError:
                pass
        self._closing = True
        self._hb_wake.set()
        try:
            self._send_wake()
            self._thread.join(timeout=2.0)
        except zmq.ZMQError:
            pass
        for sock in getattr(self._tls, "socks", {}).values():
            sock.close(linger=500)
        if release:
            hb = self._hb_thread
            if hb is not None:
                hb.join(timeout=2.0)
            # zmq_close is not thread-safe: free the sockets only when no thread of ours can be
            # using them (both loops ended, nobody waiting on a reply); else leave them to exit.
            if (not self._thread.is_alive() and (hb is None or not hb.is_alive())
                    and self._reader.acquire(timeout=1.0)):
                if self._hb_transport is not None:
                    self._hb_transport.close()
                self.transport.close()

    def _send_wake(self) -> None:
        sock = getattr(self._tls, "wake", None)
        if sock is None:
            sock = self._tls.wake = self.transport.ctx.socket(zmq.PUSH)
            sock.linger = 0
            sock.connect(self._wake_addr)
        sock.send(b"")

    # ------------------------------------------------------------------- sending
    def link(self, address: str) -> None:
        """Reach the host agent at ``address`` through one connection of ours: it answers on it."""
        self._linked.add(address)

    def send(self, address: str, header: Header, body: Sequence[Any] = ()) -> None:
        if address in self._linked:
            self._send_link(address, wire.frames(header, body))
            return
        socks: Optional[Dict[str, zmq.Socket]] = getattr(self._tls, "socks", None)
        if socks is None:
            socks = self._tls.socks = {}
        sock = socks.get(address)
        if sock is None:
            sock = socks[address] = self.transport.dealer(address)
        wire.send_message(sock, header, body)

    def _send_link(self, address: str, frames: List[Any]) -> None:
        if threading.current_thread() is self._thread:
            self._link_socket(address).send_multipart(frames, copy=False)
            return
        out = getattr(self._tls, "out", None)
        if out is None:
            out = self._tls.out = self.transport.ctx.socket(zmq.PUSH)
            out.sndhwm = 0
            out.linger = 2000
            out.connect(self._out_addr)
        out.send_multipart([address.encode(), *frames], copy=False)

    def _link_socket(self, address: str) -> zmq.Socket:
        """The link to ``address`` (I/O thread only), made on first use."""
        sock = self._links.get(address)
        if sock is None:
            sock = self.transport.dealer(address, identity=self.address.encode())
            self._links[address] = sock
            self._watching.register(sock, zmq.POLLIN)
            self._backing_off.register(sock, zmq.POLLIN)
        return sock

    def request(
        self,
        address: str,
        make_header: Callable[[int], Header],
        body: Sequence[Any] = (),
        proc_id: Optional[str] = None,
        actor: Optional[str] = None,
    ) -> Future[Any]:
        """Send a message that expects one ``result``; the future fails if ``proc_id`` dies."""
        fut: Future[Any] = Future()
        if address not in self._linked:  # an agent's answer comes to the I/O thread, not to a pump
            fut._mailbox = self
        cid = next(self._ids)
        with self._lock:
            failure = self._dead.get(proc_id) if proc_id else None
            if failure is None:
                self._pending[cid] = (fut, proc_id, actor)
                if proc_id is not None:
                    ids = self._by_proc.get(proc_id)
                    if ids is None:
                        ids = self._by_proc[proc_id] = set()
                    ids.add(cid)
        if failure is not None:
            fut.set_exception(SupervisionError(failure, actor))
            return fut
        self.send(address, make_header(cid), body)
        return fut

    def expect(self, proc_id: Optional[str] = None, actor: Optional[str] = None) -> Tuple[int, Future[Any]]:
        """Reserve a call id whose result someone else (a new proc) will send."""
        fut: Future[Any] = Future()
        fut._mailbox = self
        cid = next(self._ids)
        with self._lock:
            self._pending[cid] = (fut, proc_id, actor)
            if proc_id is not None:
                self._by_proc.setdefault(proc_id, set()).add(cid)
        return cid, fut

    def reply(self, address: str, call_id: int, ok: bool, value: Any) -> None:
        """Send a call's outcome; an unpicklable value becomes an error, never a lost reply."""
        try:
            body = wire.dumps(value)
        except Exception as e:  # noqa: BLE001
            ok = False
            body = wire.dumps(
                (f"result could not be pickled: {type(e).__name__}: {e}", traceback.format_exc(), None)
            )
        self.send(address, ("result", call_id, ok), body)

    # ------------------------------------------------------------- supervision
    def track_proc(self, proc_id: str, agent: str, host: str, mesh: Any, owner_actor: Optional[str]) -> None:
        """Own ``proc_id``: its exit is supervised here, and its agent is heartbeated."""
        self._procs[proc_id] = _OwnedProc(agent, host, weakref.ref(mesh) if mesh is not None else None, owner_actor)
        self.link(agent)
        if agent not in self._agents:
            self._agents[agent] = _AgentWatch(time.monotonic())
        self._start_heartbeats()

    def watch_agent(self, agent: str, on_lost: Callable[[str, float], None]) -> None:
        """Heartbeat ``agent`` until :meth:`unwatch_agent`; call ``on_lost(agent, silence)`` if it goes quiet."""
        self._watchers[agent] = on_lost
        self.link(agent)
        if agent not in self._agents:
            self._agents[agent] = _AgentWatch(time.monotonic())
        self._start_heartbeats()

    def _start_heartbeats(self) -> None:
        with self._lock:
            if self._hb_thread is None:
                self._hb_thread = threading.Thread(target=self._heartbeat_loop, name="monarch-heartbeat", daemon=True)
                self._hb_thread.start()
        self._hb_wake.set()  # beat now, not at the next tick (and wake a thread idle for want of agents)

    def unwatch_agent(self, agent: str) -> None:
        self._watchers.pop(agent, None)

    def expect_exit(self, proc_ids: Iterable[str]) -> None:
        """These procs are being stopped on purpose: their exits are not failures."""
        self._stopping.update(proc_ids)

    def failure_of(self, proc_id: str) -> Optional[Failure]:
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
            self.send(self.owner, ("event", "unhandled", self.proc_id, failure))
            return
        self.unhandled.append(failure)
        print(f"monarch: unhandled failure: {failure.describe()}", file=sys.stderr, flush=True)

    # ------------------------------------------------------------------ I/O loop
    def pump(self, fut: Future[Any], timeout: Optional[float]) -> bool:
        """Read replies in the calling thread until ``fut`` is done or ``timeout`` passes.

        Returns False at once if another thread is reading; the caller then waits on the
        future itself and that reader (or the I/O thread) resolves it.
        """
        if not self._reader.acquire(blocking=False):
            return False
        try:
            deadline = None if timeout is None else time.monotonic() + timeout
            watch = [(self._reply, POLLIN)]
            while not fut.done():
                wait_ms = 100
                if deadline is not None:
                    left = deadline - time.monotonic()
                    if left <= 0:
                        break
                    wait_ms = min(wait_ms, max(1, int(left * 1000)))
                # The reply to a request just sent is never there yet: wait first, then read.
                # zmq_poll, not Socket.poll, which builds a Poller on every call.
                if zmq.zmq_poll(watch, wait_ms):
                    self._drain_reply(one=True)
        finally:
            # The I/O thread's edge-triggered fd will not fire for what is left queued: read
            # a batch, and if more is left, tell the I/O thread to go on (never an unbounded
            # drain here: under a flood of output the caller must get back to its deadlines).
            more = self._drain_reply()
            self._reader.release()
            if more:
                self._more = True
                self._send_wake()
        return True

    def _drain_reply(self, one: bool = False) -> bool:
        """Handle messages queued on the ROUTER, at most a batch; True when more may be queued."""
        return _drain(self._reply, self._handle, one)

    def _io_loop(self) -> None:
        reply_fd = self._reply.getsockopt(zmq.FD)
        watching = self._watching
        backing_off = self._backing_off
        for p in (watching, backing_off):
            p.register(self.transport.zap, zmq.POLLIN)
            p.register(self._wake_rx, zmq.POLLIN)
            p.register(self._out_rx, zmq.POLLIN)
        watching.register(reply_fd, zmq.POLLIN)
        links_more = False
        while not self._closing:
            now = time.monotonic()
            timeout = 0.0 if self._more or links_more else 1.0  # more queued: read it now
            if now < self._backoff_until:
                poller = backing_off
                timeout = self._backoff_until - now
            else:
                poller = watching
            events = dict(poller.poll(max(0.0, timeout) * 1000))
            if self.transport.zap in events:
                while self.transport.zap.poll(0):
                    self.transport.serve_zap()
            if self._wake_rx in events:
                while self._wake_rx.poll(0):
                    self._wake_rx.recv()
            if self._out_rx in events:
                self._forward_out()
            links_more = self._drain_links()
            if poller is watching and (reply_fd in events or not events or self._more):
                if self._reader.acquire(blocking=False):
                    try:
                        self._more = False
                        self._more = self._drain_reply()
                    finally:
                        self._reader.release()
                else:  # a waiter is reading; look again shortly
                    self._backoff_until = time.monotonic() + 0.002
        self._forward_out()  # a last `client_exit` queued by close()
        for sock in self._links.values():
            sock.close(linger=500)

    def _forward_out(self) -> None:
        """Send what other threads queued for the links."""
        out = self._out_rx
        while out.getsockopt(EVENTS) & POLLIN:
            frames = out.recv_multipart(copy=False)
            try:
                self._link_socket(frames[0].bytes.decode()).send_multipart(frames[1:], copy=False)
            except zmq.ZMQError:
                traceback.print_exc()

    def _drain_links(self) -> bool:
        """Handle what agents sent on the links, at most a batch each; True when more may be queued."""
        more = False
        for sock in list(self._links.values()):
            more = _drain(sock, self._handle_message) or more
        return more

    def _handle(self, frames: List[zmq.Frame]) -> None:
        self._handle_message(frames[1:])

    def _handle_message(self, frames: List[zmq.Frame]) -> None:
        header, body = wire.parse(frames)
        kind = header[0]
        if kind == "result":
            _, cid, ok = header
            with self._lock:
                entry = self._pending.pop(cid, None)
                if entry is not None and entry[1] is not None:
                    ids = self._by_proc.get(entry[1])
                    if ids is not None:
                        ids.discard(cid)
            if entry is None:
                return  # the call already failed (its proc died); a late answer is dropped
            fut = entry[0]
            try:
                value = wire.loads(body)
            except BaseException as e:  # noqa: BLE001
                fut.set_exception(ActorError(f"could not decode the result: {type(e).__name__}: {e}"))
                return
            if ok:
                fut.set_result(value)
            else:
                message, tb, exc = value
                fut.set_exception(ActorError(message, tb, exc))
        elif kind == "event":
            self._handle_event(header, body)

    def _handle_event(self, header: Header, body: List[Any]) -> None:
        what = header[1]
        handler = self.event_handlers.get(what)
        if handler is not None:
            handler(header, body)
        elif what == "proc_exit":
            _, _, proc_id, failure, expected = header
            self.proc_failed(proc_id, failure, expected)
        elif what == "unhandled":
            _, _, child_proc, failure = header
            wrapped = dataclasses.replace(
                failure,
                reason=f"owner proc {child_proc} did not handle a failure in a mesh it owns: {failure.describe()}",
            )
            if child_proc in self._procs:
                rec = self._procs[child_proc]
                self.proc_failed(
                    child_proc,
                    Failure(proc=child_proc, host=rec.host, pid=None, reason=wrapped.reason),
                )
            else:
                self.unhandled_failure(wrapped)
        elif what == "endpoint_error":
            _, _, message = header
            print(f"monarch: {message}", file=sys.stderr, flush=True)

    def _heartbeat_loop(self) -> None:
        """Heartbeat the watched agents and read their answers; nothing else runs here."""
        from .transport import Transport

        self._hb_transport = Transport(self.keys, zap=False)
        self._beat = wire.frames(("heartbeat", self.address))[0]
        poller = zmq.Poller()
        next_beat = 0.0
        while not self._closing:
            if not self._agents:  # nothing to watch: sleep until an agent is watched or we close
                self._hb_wake.wait()
            events = dict(poller.poll(max(0.0, min(next_beat - time.monotonic(), 0.1)) * 1000))
            for watch in list(self._agents.values()):
                if watch.sock is not None and watch.sock in events:
                    while watch.sock.poll(0):
                        watch.sock.recv()
                        watch.last_ack = time.monotonic()
                        watch.unanswered_since = None
            if self._hb_wake.is_set() or time.monotonic() >= next_beat:
                self._hb_wake.clear()
                self._heartbeat(poller)
                next_beat = time.monotonic() + settings().heartbeat_interval
        for watch in list(self._agents.values()):
            if watch.sock is not None:
                watch.sock.close(linger=0)

    def _heartbeat(self, poller: zmq.Poller) -> None:
        now = time.monotonic()
        limit = settings().heartbeat_timeout
        live_agents = {rec.agent for rec in self._procs.values()} | set(self._watchers)
        for agent, watch in list(self._agents.items()):
            if agent not in live_agents:
                self._unwatch(agent, poller)
            elif watch.unanswered_since is not None and now - watch.unanswered_since > limit:
                # Silence counted from a heartbeat we sent, not from the last answer we got
                # round to reading: a busy process does not make its agents look dead.
                self._agent_lost(agent, now - watch.unanswered_since, poller)
            else:
                if watch.sock is None:  # its own connection to the agent's one port
                    watch.sock = self._hb_transport.dealer(agent)
                    poller.register(watch.sock, zmq.POLLIN)
                watch.sock.send(self._beat, zmq.NOBLOCK)
                if watch.unanswered_since is None:
                    watch.unanswered_since = now

    def _unwatch(self, agent: str, poller: zmq.Poller) -> None:
        watch = self._agents.pop(agent, None)
        if watch is not None and watch.sock is not None:
            poller.unregister(watch.sock)
            watch.sock.close(linger=0)

    def _agent_lost(self, agent: str, silent_for: float, poller: zmq.Poller) -> None:
        self._unwatch(agent, poller)
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


def _drain(sock: zmq.Socket, handle: Callable[[List[zmq.Frame]], None], one: bool = False) -> bool:
    """Handle what is queued on ``sock``, at most a batch (``one``: read at least one, even if
    the socket does not say so yet); True when more may be queued."""
    handled = 0
    while one or sock.getsockopt(EVENTS) & POLLIN:  # ints: cheaper than zmq.Again, or enum flags
        if handled >= _DRAIN_BATCH:
            return True
        one = False
        frames = wire.recv_frames(sock)
        handled += 1
        try:
            handle(frames)
        except Exception:  # noqa: BLE001 - one bad message must not stop the reader
            traceback.print_exc()
    return False
