"""The mailbox's heartbeat thread (runs in the client, and in procs that own procs).

Liveness never depends on how busy this process is: heartbeats have a thread of their own
(started when the first agent is watched), their own ZeroMQ context and their own
connection to each agent's one port (the agent answers on it), so no handler, such as a
run's output being printed to a slow terminal, can hold them up. An agent counts as lost
only when a heartbeat this process *sent* has gone unanswered for the timeout. Every
connection belongs to one ROUTER socket (the agent's address is its routing id): the
thread polls one socket whatever the number of hosts.
"""

from __future__ import annotations

import dataclasses
import threading
import time
from collections.abc import Callable
from typing import Any

import zmq

from ...config import settings
from .. import protocol
from ..transport import wire
from ..transport.keys import Keys

# Plain ints: the enum flags cost ~0.6 µs an operation, twice per host every beat.
_EVENTS, _POLLIN, _RCVMORE = int(zmq.EVENTS), int(zmq.POLLIN), int(zmq.RCVMORE)
_NOBLOCK, _SNDMORE_NOBLOCK = int(zmq.NOBLOCK), int(zmq.NOBLOCK | zmq.SNDMORE)

#: Seconds per watched agent that a new connection may take to bring its first answer before
#: its silence counts (thousands of CURVE handshakes at once take a while on one client).
_CONNECT_ALLOWANCE = 0.02


@dataclasses.dataclass
class _AgentWatch:
    last_ack: float
    watched_at: float  # until its first answer, silence counts only after a grace (its connection may be coming up)
    unanswered_since: float | None = None  # when the oldest heartbeat not yet answered was sent


class AgentHeartbeats:
    """Heartbeats the agents in ``wanted()``; ``lost(agent, silence)`` once one stops answering.

    ``lost`` runs on the heartbeat thread; an agent no longer wanted is simply dropped.
    """

    def __init__(
        self, keys: Keys, address: str, wanted: Callable[[], set[str]], lost: Callable[[str, float], None]
    ) -> None:
        self._keys = keys
        self._address = address
        self._wanted = wanted
        self._lost = lost
        self._agents: dict[str, _AgentWatch] = {}
        self._transport: Any | None = None  # own context: big transfers cannot delay heartbeats
        self._sock: Any | None = None
        self._connected: set[str] = set()
        self._answered: set[str] = set()  # agents whose connection has brought an answer
        self._thread: threading.Thread | None = None
        self._wake = threading.Event()
        self._lock = threading.Lock()
        self._closing = False

    @property
    def agents(self) -> set[str]:
        return set(self._agents)

    def watch(self, agent: str) -> None:
        """Heartbeat ``agent`` (now, not at the next tick) for as long as it is wanted."""
        if agent not in self._agents:
            now = time.monotonic()
            self._agents[agent] = _AgentWatch(now, now)
        with self._lock:
            if self._thread is None:
                self._thread = threading.Thread(target=self._loop, name="monarch-heartbeat", daemon=True)
                self._thread.start()
        self._wake.set()  # (and wake a thread idle for want of agents)

    def close(self) -> None:
        self._closing = True
        self._wake.set()

    def join(self, timeout: float) -> bool:
        """Wait for the thread to end; True when it has (or never started)."""
        if self._thread is not None:
            self._thread.join(timeout)
            return not self._thread.is_alive()
        return True

    def release(self) -> None:
        """Free the heartbeat context (only once :meth:`join` said the thread has ended)."""
        if self._transport is not None:
            self._transport.close()

    def _loop(self) -> None:
        from ..transport.sockets import Transport

        self._transport = Transport(self._keys, zap=False)
        # Its own name: the link (see mailbox_io) is named by the mailbox's address.
        self._sock = self._transport.link_router(f"{self._address}/heartbeats".encode())
        self._sock.linger = 0
        beat = wire.frames(protocol.header(protocol.Heartbeat(self._address)))[0]
        watch = [(self._sock, int(zmq.POLLIN))]
        next_beat = 0.0
        while not self._closing:
            if not self._agents:  # nothing to watch: sleep until an agent is watched or we close
                self._wake.wait()
            if zmq.zmq_poll(watch, max(1, int(min(next_beat - time.monotonic(), 0.1) * 1000))):
                now = time.monotonic()
                sock, agents, answered = self._sock, self._agents, self._answered
                # Plain ints and single-frame reads: at 4,096 hosts this loop reads ~8,000 acks a second.
                while sock.getsockopt(_EVENTS) & _POLLIN:
                    name = sock.recv().decode()
                    while sock.getsockopt(_RCVMORE):
                        sock.recv()  # protocol.HEARTBEAT_ACK
                    answered.add(name)
                    agent = agents.get(name)
                    if agent is not None:
                        agent.last_ack = now
                        agent.unanswered_since = None
            if self._wake.is_set() or time.monotonic() >= next_beat:
                self._wake.clear()
                self._beat(beat)
                next_beat = time.monotonic() + settings().heartbeat_interval
        self._sock.close(linger=0)

    def _beat(self, beat: bytes) -> None:
        now = time.monotonic()
        limit = settings().heartbeat_timeout
        wanted = self._wanted()
        # Connections all come up at once, in no particular order: each gets the grace of them all.
        grace = limit + _CONNECT_ALLOWANCE * len(self._agents)
        sock = self._sock
        for agent, watch in list(self._agents.items()):
            if agent not in wanted:
                self._unwatch(agent)
            elif (
                watch.unanswered_since is not None
                and now - watch.unanswered_since > limit
                and (agent in self._answered or now - watch.watched_at > grace)
            ):
                # Silence counted from a heartbeat we sent, not from the last answer we got
                # round to reading: a busy process does not make its agents look dead.
                self._unwatch(agent)
                self._lost(agent, now - watch.unanswered_since)
            else:
                if agent not in self._connected:  # its own connection to the agent's one port, kept
                    self._sock.connect_rid = agent.encode()
                    self._sock.connect(agent)
                    self._connected.add(agent)
                try:
                    sock.send(agent.encode(), _SNDMORE_NOBLOCK)
                    sock.send(beat, _NOBLOCK)
                except zmq.ZMQError:  # not routable (its connection went): the beat goes unanswered
                    pass
                if watch.unanswered_since is None:
                    watch.unanswered_since = now

    def _unwatch(self, agent: str) -> None:
        # Its connection stays: the next run watches it again without a new CURVE handshake.
        self._agents.pop(agent, None)
