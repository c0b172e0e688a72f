"""The mailbox's I/O thread and the links to host agents (runs in every runtime process).

Messages to procs leave on a DEALER socket owned by the sending thread, so a send never
waits for another thread; their replies arrive on the mailbox's ROUTER.

Host agents are different: this process needs no inbound port for them. Each agent address
that is linked gets one connection (its link) of a single ROUTER socket owned by the I/O
thread and named by this mailbox's address, the agent's address being the connection's
routing id; the agent answers everything (results, rank output and exits, debugger
and telemetry traffic) through its ROUTER on that connection. One socket for every link,
not one per agent: at thousands of hosts, polling and draining one socket costs what it
costs for one host, where a socket per agent cost a Python loop over all of them per
wake-up (and ZeroMQ's 1,024-socket limit). A message for a link not connected yet (a
ROUTER cannot queue for a peer it has not met) waits in :attr:`_unsent` (``transport.sockets.RoutedSends``) and is retried. Other threads hand their
sends to the I/O thread through a deque, waking it only when it may be asleep (a run's start
to 4,096 hosts is one wake-up, not 4,096 socket sends, each a GIL hand-off), and the I/O
thread reads the links, so a future for an agent request is resolved by the I/O thread (its
waiter does not ``pump``).
One TCP port per host is enough, reached directly or through a forward.

Who reads that ROUTER: a thread blocked in ``Future.get()`` reads it itself (``pump``), so a
round trip costs no hand-off between threads; whenever nobody is waiting that way, the I/O
thread reads it. A lock decides who may touch the socket; the I/O thread only ever tries
it, backing off for a couple of milliseconds when a waiter holds it, so it never blocks
ZAP handshakes behind a long wait. A reader handles at most :data:`_DRAIN_BATCH` messages at
a time, so a waiter under a flood of output gets back to its own deadlines.
"""

from __future__ import annotations

import collections
import threading
import time
import traceback
from collections.abc import Callable
from typing import Any, cast

import zmq

from .. import protocol
from ..transport import wire
from ..transport.keys import Keys
from ..transport.sockets import RoutedSends, Transport
from .future import Future
from .heartbeats import LinkHeartbeats

# Plain ints: `getsockopt(zmq.EVENTS) & zmq.POLLIN` builds enum flags, ~0.6 µs a time on the hot path.
EVENTS, POLLIN = int(zmq.EVENTS), int(zmq.POLLIN)

_ACK_SIZE = len(protocol.HEARTBEAT_ACK)
_FORWARDED_SIZE = len(protocol.FORWARDED)

#: Messages one reader handles before others get their turn.
_DRAIN_BATCH = 64


class MailboxIO:
    """The sockets and threads under :class:`~.mailbox.Mailbox`; it supplies ``_handle_message``."""

    def __init__(self, keys: Keys) -> None:
        self.keys = keys
        self.transport = Transport(keys, link_thread=True)  # (heartbeats ride the links: see heartbeats.py)
        self._reply, self.address = self.transport.bind_router()
        self._tls = threading.local()
        self._closing = False
        self._reader = threading.Lock()  # held by whoever is reading self._reply
        self._backoff_until = 0.0
        self._more = False  # a reader stopped with replies still queued: the I/O thread goes on
        self._wake_addr = f"inproc://mailbox-wake-{id(self)}"
        self._wake_rx = self.transport.ctx.socket(zmq.PULL)
        self._wake_rx.bind(self._wake_addr)
        #: Agent addresses reached through a link; the links themselves belong to the I/O thread.
        self._linked: set[str] = set()
        #: Agents reached through another agent's link (a relay: protocol/links.py), by address.
        self._via: dict[str, str] = {}
        #: Per relay, ``(host, frames)`` to send it in one message at the end of the I/O thread's turn.
        self._forwards: dict[str, list[tuple[str, list[Any]]]] = {}
        self._links: zmq.Socket | None = None  # one ROUTER: a connection per agent (I/O thread only)
        self._connected: set[str] = set()
        #: Per agent, frames not yet accepted by the links' ROUTER (its connection is not up yet).
        self._unsent = RoutedSends()
        #: (address, frames) other threads send on the links, in order; the I/O thread drains it.
        self._outbox: collections.deque[tuple[str, list[Any]]] = collections.deque()
        self._outbox_wake = False  # a wake-up for the outbox is on its way (the I/O thread clears it first)
        #: Heartbeats on the links, sent and judged by the I/O thread.
        self._beats = LinkHeartbeats(self.address, self._wanted_links, self._link_lost, self._link_send)
        self._watching = zmq.Poller()
        self._backing_off = zmq.Poller()
        self._thread = threading.Thread(target=self._io_loop, name="monarch-mailbox", daemon=True)
        self._thread.start()

    def _handle_message(self, frames: list[zmq.Frame]) -> None:
        raise NotImplementedError

    def _wanted_agents(self) -> set[str]:
        raise NotImplementedError

    def _agent_lost(self, agent: str, silent_for: float) -> None:
        raise NotImplementedError

    def _relay_lost(self, relay: str) -> None:
        raise NotImplementedError

    def link(self, address: str, via: str | None = None) -> None:
        """Reach the host agent at ``address`` through one connection of ours: it answers on it;
        ``via``: through the connection to that agent, which forwards both ways (a relay, for
        clients of thousands of hosts: see ``runtime/agent/forwarding.py``). Without ``via``, a
        host linked through a relay stays so (:meth:`link_directly` changes that); a relay that
        is lost has its hosts linked directly."""
        if via is not None and via != address:
            self._linked.add(via)
            self._via[address] = via
        self._linked.add(address)

    def link_directly(self, address: str) -> None:
        """Reach ``address`` on a connection of ours from now on, even if a relay carried it (the
        agent answers on whichever way our last message came)."""
        self._via.pop(address, None)
        self._linked.add(address)

    def _wanted_links(self) -> set[str]:
        """The agents to beat: those wanted, and the relays that carry any of them (a relay
        that dies must be named as itself, not as the hosts behind it)."""
        wanted = self._wanted_agents()
        via = self._via
        if via:
            wanted |= {r for r in map(via.get, wanted) if r is not None}
        return wanted

    def _link_lost(self, agent: str, silent_for: float) -> None:
        """A silent agent: lost, unless it is reached through a relay that is silent too. Such a
        host is given a direct link and a fresh timeout (the relay is judged as itself); the
        hosts behind a lost relay are linked directly, so what is sent to them next (a run's
        stop) reaches them."""
        relay = self._via.get(agent)
        if relay is not None and self._beats.silent(relay, time.monotonic()):
            self._via.pop(agent, None)
            self._beats.rewatch(agent, time.monotonic())
            return
        for behind in [a for a, r in list(self._via.items()) if r == agent]:  # (other threads link hosts)
            self._via.pop(behind, None)
            self._beats.rewatch(behind, time.monotonic())
        self._relay_lost(agent)
        self._agent_lost(agent, silent_for)

    def _send_wake(self) -> None:
        sock = getattr(self._tls, "wake", None)
        if sock is None:
            sock = self._tls.wake = self.transport.ctx.socket(zmq.PUSH)
            sock.linger = 0
            sock.connect(self._wake_addr)
        sock.send(b"")

    def _send_link(self, address: str, frames: list[Any]) -> None:
        if threading.current_thread() is self._thread:
            self._link_send(address, frames)
            return
        self._outbox.append((address, frames))
        self._wake_once()

    def _wake_once(self) -> None:
        """Wake the I/O thread for what was just queued for it, unless a wake-up is on its way.
        It clears the flag before it looks at its queues: either it sees the new entry, or this sees False."""
        if not self._outbox_wake:
            self._outbox_wake = True
            self._send_wake()

    def heartbeat(self, agent: str) -> None:
        """Beat ``agent`` on its link from now on (until the mailbox no longer wants it)."""
        self._beats.watch(agent)
        self._wake_once()

    def _links_socket(self) -> zmq.Socket:
        """The ROUTER holding every link (I/O thread only), made on first use."""
        sock = self._links
        if sock is None:
            sock = self._links = self.transport.link_router(self.address.encode())
            self._watching.register(sock, zmq.POLLIN)
            self._backing_off.register(sock, zmq.POLLIN)
        return sock

    def _link_send(self, address: str, frames: list[Any]) -> None:
        """Send on ``address``'s link (I/O thread only), connecting it first; queued while it is not up."""
        relay = self._via.get(address)
        if relay is not None:  # sent with the rest of this turn's messages for that relay
            held = self._forwards.get(relay)
            if held is None:
                held = self._forwards[relay] = []
            held.append((address, frames))
            return
        sock = self._links_socket()
        if address not in self._connected:
            sock.connect_rid = address.encode()
            sock.connect(address)
            self._connected.add(address)
        self._unsent.send(sock, address.encode(), frames)

    def _send_forwards(self) -> None:
        """Send each relay what was held for its hosts, as one message (I/O thread only)."""
        held, self._forwards = self._forwards, {}
        for relay, messages in held.items():
            self._link_send(relay, protocol.forward_frames(messages))

    def pump(self, fut: Future[Any], timeout: float | None) -> bool:
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
        watching.register(reply_fd, zmq.POLLIN)
        links_more = False
        while not self._closing:
            now = time.monotonic()
            timeout = 0.0 if self._more or links_more else self._beats.wait(now)  # more queued: read it now
            if self._unsent:  # links still connecting: look again soon
                timeout = min(timeout, 0.005)
            if now < self._backoff_until:
                poller = backing_off
                timeout = self._backoff_until - now
            else:
                poller = watching
            events = dict(poller.poll(int(max(0.0, timeout) * 1000)))  # what poll does to a float
            zap = self.transport.zap
            if zap is not None and zap in events:
                while zap.poll(0):
                    self.transport.serve_zap()
            if self._wake_rx in events:
                while self._wake_rx.poll(0):
                    self._wake_rx.recv()
            self._forward_out()  # (always: a wake flag may be up with nothing left to send)
            if self._forwards:
                self._send_forwards()
            if self._unsent and self._links is not None:
                self._unsent.retry(self._links)
            links_more = self._drain_links()
            self._beats.tick(time.monotonic(), drained=not links_more)
            if poller is watching and (reply_fd in events or not events or self._more):
                if self._reader.acquire(blocking=False):
                    try:
                        self._more = False
                        self._more = self._drain_reply()
                    finally:
                        self._reader.release()
                else:  # a waiter is reading; look again shortly
                    self._backoff_until = time.monotonic() + 0.002
            if self._forwards:  # beats, and what handlers sent on this thread
                self._send_forwards()
        self._forward_out()  # a last `client_exit` queued by close()
        self._send_forwards()
        if self._links is not None:
            self._links.close(linger=500)

    def _forward_out(self) -> None:
        """Send what other threads queued for the links."""
        self._outbox_wake = False
        out = self._outbox
        while out:
            address, frames = out.popleft()
            try:
                self._link_send(address, frames)
            except zmq.ZMQError:
                traceback.print_exc()

    def _drain_links(self) -> bool:
        """Handle what agents sent on the links, at most a batch; True when more may be queued."""
        return self._links is not None and _drain(self._links, self._handle)

    def _handle(self, frames: list[zmq.Frame]) -> None:
        self._handle_from(frames[0].bytes.decode(errors="replace"), frames[1:])

    def _handle_from(self, agent: str, frames: list[Any]) -> None:
        first = len(frames[0])
        if first == _ACK_SIZE and len(frames) == 1 and bytes(frames[0]) == protocol.HEARTBEAT_ACK:
            self._beats.acked(agent, time.monotonic())
            return
        if self._beats.watching:
            self._beats.heard(agent, time.monotonic())
        if first == _FORWARDED_SIZE and len(frames) > 1 and bytes(frames[0]) == protocol.FORWARDED:
            for source, message in protocol.unforward(frames[1:]):  # from the hosts behind a relay
                try:
                    self._handle_from(source, message)
                except Exception:  # noqa: BLE001 - one bad message must not lose the others
                    traceback.print_exc()
            return
        self._handle_message(frames)


def _drain(sock: zmq.Socket, handle: Callable[[list[zmq.Frame]], None], one: bool = False) -> bool:
    """Handle what is queued on ``sock``, at most a batch (``one``: read at least one, even if
    the socket does not say so yet); True when more may be queued."""
    handled = 0
    # ints: cheaper than zmq.Again, or enum flags; pyzmq types every option's value as int | bytes: EVENTS is an int
    while one or cast(int, sock.getsockopt(EVENTS)) & POLLIN:
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
