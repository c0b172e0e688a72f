"""The mailbox's heartbeat thread (runs in the client, and in procs that own procs).

Liveness never depends on how busy this process is: heartbeats have a thread of their own
(started when the first agent is watched), their own ZeroMQ context and their own
connection to each agent's one port (the agent answers on it), so no handler, such as a
run's output being printed to a slow terminal, can hold them up. An agent counts as lost
only when a heartbeat this process *sent* has gone unanswered for the timeout.
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


@dataclasses.dataclass
class _AgentWatch:
    last_ack: float
    sock: zmq.Socket | None = None
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
            self._agents[agent] = _AgentWatch(time.monotonic())
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
        beat = wire.frames(protocol.header(protocol.Heartbeat(self._address)))[0]
        poller = zmq.Poller()
        next_beat = 0.0
        while not self._closing:
            if not self._agents:  # nothing to watch: sleep until an agent is watched or we close
                self._wake.wait()
            events = dict(poller.poll(max(0.0, min(next_beat - time.monotonic(), 0.1)) * 1000))
            for watch in list(self._agents.values()):
                if watch.sock is not None and watch.sock in events:
                    while watch.sock.poll(0):
                        watch.sock.recv()  # protocol.HEARTBEAT_ACK
                        watch.last_ack = time.monotonic()
                        watch.unanswered_since = None
            if self._wake.is_set() or time.monotonic() >= next_beat:
                self._wake.clear()
                self._beat(poller, beat)
                next_beat = time.monotonic() + settings().heartbeat_interval
        for watch in list(self._agents.values()):
            if watch.sock is not None:
                watch.sock.close(linger=0)

    def _beat(self, poller: zmq.Poller, beat: bytes) -> None:
        now = time.monotonic()
        limit = settings().heartbeat_timeout
        wanted = self._wanted()
        for agent, watch in list(self._agents.items()):
            if agent not in wanted:
                self._unwatch(agent, poller)
            elif watch.unanswered_since is not None and now - watch.unanswered_since > limit:
                # Silence counted from a heartbeat we sent, not from the last answer we got
                # round to reading: a busy process does not make its agents look dead.
                self._unwatch(agent, poller)
                self._lost(agent, now - watch.unanswered_since)
            else:
                if watch.sock is None:  # its own connection to the agent's one port
                    assert self._transport is not None
                    watch.sock = self._transport.dealer(agent)
                    poller.register(watch.sock, zmq.POLLIN)
                watch.sock.send(beat, zmq.NOBLOCK)
                if watch.unanswered_since is None:
                    watch.unanswered_since = now

    def _unwatch(self, agent: str, poller: zmq.Poller) -> None:
        watch = self._agents.pop(agent, None)
        if watch is not None and watch.sock is not None:
            poller.unregister(watch.sock)
            watch.sock.close(linger=0)
