"""Heartbeats on the links (run by the mailbox's I/O thread, in the client and in procs that own procs).

A beat goes to each watched agent on the link this process already has to it, and the agent
answers with a bare ``ack`` on the same connection: one connection per host, not a link plus
a heartbeat connection (at 4,096 hosts that second connection was a CURVE handshake per host
per command and ~100 MB of libzmq buffers). Liveness still never depends on how busy this
process's handlers are: nothing that may block runs on the I/O thread (a run's events, which
print to a console the user may pause, have a thread of their own: ``subscribe(thread=)``),
and silence is judged right after the links were drained, so an ack queued behind a flood
of output is never mistaken for silence (under a flood that never drains, once it has lasted
a timeout, and only of a host not heard from while the reader took a message from every host
in turn; beats then go out every third of the timeout, not every interval). Any message read
from an agent counts as hearing from it, not only an ack. An agent counts as lost once nothing came from
it for the timeout (4 s) *and* a beat this process sent has gone unanswered for all but one
interval of it: a process too busy to send beats does not make its agents look dead, and a
host that vanishes is named within the timeout of its last answer (judged at that deadline,
not at the next round of beats).

A round skips an agent heard from within half an interval (its messages already show it
alive) unless its last beat is nearly a third of the timeout old (the agent reaps a
client whose beats stop), and a newly watched agent is not beaten at once (the request
that made it wanted is on its way): a 4,096-host run sent 8-16 k beats and read as many
acks, half the messages of its dispatch-to-all-exits, for hosts that were talking anyway.
"""

from __future__ import annotations

import collections
import dataclasses
from collections.abc import Callable
from typing import Any

import zmq

from ...config import settings
from .. import protocol
from ..transport import wire

#: Seconds per watched agent that a new connection may take to bring its first answer before
#: its silence counts (thousands of CURVE handshakes at once take a while on one client).
_CONNECT_ALLOWANCE = 0.02


@dataclasses.dataclass
class _AgentWatch:
    watched_at: float  # until its first answer, silence counts only after a grace (its connection may be coming up)
    last_ack: float  # (watched_at until the first)
    unanswered_since: float | None = None  # when the oldest beat not yet answered was sent
    reads_at: int = 0  # messages read from the links when it was last heard from
    beaten_at: float = float("-inf")  # when the last beat went to it


class LinkHeartbeats:
    """Beats the agents in ``wanted()`` through ``send(agent, frames)``; ``lost(agent, silence)``
    once one stops answering. Every method but :meth:`watch` runs on the I/O thread."""

    def __init__(
        self,
        address: str,
        wanted: Callable[[], set[str]],
        lost: Callable[[str, float], None],
        send: Callable[[str, list[Any]], None],
    ) -> None:
        self._wanted = wanted
        self._lost = lost
        self._send = send
        self._beat = wire.frames(protocol.header(protocol.Heartbeat(address)))
        self._agents: dict[str, _AgentWatch] = {}
        self._new: collections.deque[str] = collections.deque()  # watched by other threads, not taken yet
        self.answered: set[str] = set()  # agents whose link has brought a message (a lost one leaves)
        self._next_beat = 0.0
        self._next_judgement = float("inf")  # the earliest moment an agent may be found silent
        self._undrained_since: float | None = None  # since when the I/O thread has had more to read
        self._last_round = 0.0  # when the last round of beats went out
        self._reads = 0  # messages read from the links

    @property
    def agents(self) -> set[str]:
        return set(self._agents) | set(self._new)

    @property
    def watching(self) -> bool:
        return bool(self._agents)

    def watch(self, agent: str) -> None:
        """Beat ``agent`` (at the I/O thread's next turn) for as long as it is wanted."""
        self._new.append(agent)

    def silent(self, agent: str, now: float) -> bool:
        """Whether ``agent`` has been quiet for longer than a beat and its answer take
        (I/O thread only); one not watched counts as silent."""
        watch = self._agents.get(agent)
        return watch is None or now - watch.last_ack > 1.5 * settings().heartbeat_interval

    def rewatch(self, agent: str, now: float) -> None:
        """Judge ``agent`` afresh from now, as newly watched and beaten at the next round (I/O
        thread only): its link changed (the relay that carried it was lost)."""
        self.answered.discard(agent)
        self._agents[agent] = _AgentWatch(now, now, unanswered_since=now)
        self._next_judgement = min(self._next_judgement, now + settings().heartbeat_interval)

    def acked(self, agent: str, now: float) -> None:
        self.answered.add(agent)
        self.heard(agent, now)

    def heard(self, agent: str, now: float) -> None:
        """Anything read from ``agent``'s link shows it alive, not only an ack. Under a flood its
        ack waits behind its own output, and a slow reader reads each connection in turn: a
        client that read slower than its agents wrote (measured: 4,096 hosts x 8 ranks, client
        under ``tracemalloc``) named 1,500 live hosts lost while it was still reading their output."""
        self._reads += 1
        watch = self._agents.get(agent)
        if watch is not None:
            self.answered.add(agent)  # its link is up: no connect grace
            watch.unanswered_since = None
            watch.last_ack = now
            watch.reads_at = self._reads

    def wait(self, now: float) -> float:
        """Seconds the I/O thread may sleep before the next beat is due."""
        if not self._agents and not self._new:
            return 1.0
        if self._new:
            return 0.0
        return max(0.0, min(self._next_beat, self._next_judgement) - now)

    def tick(self, now: float, drained: bool) -> None:
        """Beat the agents when their turn comes; judge silence only when the links were just drained."""
        new = self._new
        while new:
            agent = new.popleft()
            if agent not in self._agents:
                # Not beaten now: the request that made it wanted is going to it (and restarts
                # the agent's clock for us), and its answer shows it alive. Its silence counts
                # from now, as if a beat had gone.
                self._agents[agent] = _AgentWatch(now, now, unanswered_since=now, beaten_at=now)
        limit = settings().heartbeat_timeout
        # Beats go out even while the links are not drained (the agents reap a client whose beats
        # stop, and a flood of output may outlast the timeout), but then only every third of the
        # timeout: a round of 4,096 beats in the middle of a run's flood of events had cost
        # ~100-150 MB of a 4,096-host client's peak RSS and up to ~1 s of its dispatch-to-all-exits.
        beat = now >= self._next_beat and (drained or now - self._last_round >= limit / 3)
        if drained:
            self._undrained_since = None
        elif self._undrained_since is None:
            self._undrained_since = now
        # Silence is judged right after the links were drained; under a flood that never drains,
        # after a timeout of it, and then only of hosts not heard from for a whole turn of reading
        # (below): a dead host must still be named.
        readable = drained or now - (self._undrained_since or now) >= limit
        judge = readable and (beat or now >= self._next_judgement)
        if not beat and not judge:
            return
        interval = settings().heartbeat_interval
        if beat:
            self._next_beat, self._last_round = now + interval, now
        if judge:
            self._next_judgement = float("inf")
        wanted = self._wanted()
        # Connections all come up at once, in no particular order: each gets the grace of them all.
        grace = limit + _CONNECT_ALLOWANCE * len(self._agents)
        for agent, watch in list(self._agents.items()):
            if self._agents.get(agent) is not watch:
                continue  # judged afresh meanwhile (:meth:`rewatch`, from a lost relay's ``lost``)
            if agent not in wanted:
                del self._agents[agent]  # its link stays: the next run watches it again, no new handshake
                continue
            if judge and watch.unanswered_since is not None:
                # Nothing heard for the timeout, and a beat we sent unanswered for all but one
                # interval of it (not merely the last answer we got round to reading).
                due = max(watch.last_ack + limit, watch.unanswered_since + limit - interval)
                if agent not in self.answered:
                    due = max(due, watch.watched_at + grace)
                # Under a flood, silence also needs a whole turn of reading since its last message
                # (as many messages as hosts): each connection is read in turn, so a live host's
                # queued message comes within one; a reader slower than the timeout per turn (a
                # client under a profiler: 3,456 live hosts named lost) must not blame the hosts.
                if now >= due and (drained or self._reads - watch.reads_at >= len(self._agents)):
                    del self._agents[agent]
                    self.answered.discard(agent)
                    self._lost(agent, now - watch.last_ack)
                    continue
                self._next_judgement = min(self._next_judgement, due if due > now else now + interval)
            if beat:
                if now - watch.last_ack >= interval / 2 or now - watch.beaten_at >= limit / 3 - interval / 2:
                    self._beat_one(agent, watch, now)
                elif watch.unanswered_since is None:
                    watch.unanswered_since = now  # judged as if beaten: this round shows we are alive

    def _beat_one(self, agent: str, watch: _AgentWatch, now: float) -> None:
        try:
            self._send(agent, self._beat)
        except zmq.ZMQError:  # (the context is closing): the beat goes unanswered, the I/O loop goes on
            pass
        watch.beaten_at = now
        if watch.unanswered_since is None:
            watch.unanswered_since = now
