"""The agent's share of a client's question to thousands of hosts (:class:`~..protocol.FanOut`).

A client of N hosts links ~√N agents and asks each to put the same question (``ping``,
``telemetry_stacks``, ...) to ~√N others, instead of paying a CURVE handshake and a request
per host itself (the star's limit: docs/architecture.md, "At scale"). This agent sends the
question on, under call ids of its own, and answers once with every target's answer as the
target sent it, undecoded, or ``None`` for one that did not answer in time.

Its connections to the targets are kept (one DEALER each, named by this relay), so only the
first question pays their handshakes, here, in parallel with the other relays on their own
machines. Everything runs on the agent's loop: the sockets are in its poller.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import zmq

from .. import protocol
from ..transport import wire

if TYPE_CHECKING:
    from .core import AgentCore

#: Targets one question may name: a relay keeps a connection to each (sockets, not threads).
MAX_TARGETS = 1000
#: Connections a relay keeps; past it, the least recently asked target with nothing pending is let go.
MAX_KEPT = 2 * MAX_TARGETS
_MAX_TIMEOUT = 120.0


@dataclasses.dataclass(eq=False)
class _Question:
    reply_to: str
    cid: int
    deadline: float
    targets: list[str]
    answers: list[tuple[bool, list[bytes]] | None]
    left: int
    cids: list[int]  # ours, one per target


class FanOutRelay:
    def __init__(self, agent: AgentCore, watch: Callable[[Any], None], unwatch: Callable[[Any], None]) -> None:
        self.agent = agent
        self._watch = watch
        self._unwatch = unwatch
        self.name = f"{agent.address}/relay"  # the routing id our targets answer to
        self.socks: dict[Any, str] = {}  # socket -> target
        self._by_target: dict[str, Any] = {}
        self._waiting: dict[int, tuple[_Question, int]] = {}  # our cid -> (question, target index)
        self._questions: list[_Question] = []
        self._next_cid = 0

    def handlers(self) -> dict[type, Callable[[Any, list[Any]], None]]:
        return {protocol.FanOut: self._start}

    def _start(self, msg: protocol.FanOut, body: list[Any]) -> None:
        targets = [str(t) for t in msg.targets]
        try:
            inner = protocol.decode(tuple(msg.inner))
            if inner.KIND not in protocol.FAN_OUT_KINDS:
                raise ValueError(f"a relay does not pass on {inner.KIND!r} requests")
            if len(targets) > MAX_TARGETS:
                raise ValueError(f"{len(targets)} targets in one question (at most {MAX_TARGETS})")
            if any(not t.startswith(("tcp://", "ipc://")) for t in targets):
                raise ValueError("a target is not an agent address")
            timeout = min(max(float(msg.timeout), 0.1), _MAX_TIMEOUT)
        except (KeyError, TypeError, ValueError) as e:
            self.agent.reply(msg.reply_to, msg.cid, False, f"fan_out refused: {e}")
            return
        q = _Question(
            msg.reply_to, msg.cid, time.monotonic() + timeout, targets, [None] * len(targets), len(targets), []
        )
        data = [bytes(f) for f in body]
        for i, target in enumerate(targets):
            self._next_cid += 1
            cid = self._next_cid
            q.cids.append(cid)
            self._waiting[cid] = (q, i)
            sock = self._socket(target)
            sock.send_multipart(wire.frames(protocol.header(inner._replace(cid=cid, reply_to=self.name)), data))
        self._questions.append(q)
        if not targets:
            self._answer(q)

    def _socket(self, target: str) -> Any:
        sock = self._by_target.pop(target, None)
        if sock is None:  # kept: the next question to this target pays no handshake
            if len(self._by_target) >= MAX_KEPT:
                self._let_go()
            sock = self.agent.transport.dealer(target, self.name.encode())
            sock.linger = 0
            self.socks[sock] = target
            self._watch(sock)
        self._by_target[target] = sock  # (re)inserted last: the dict's order is least recently asked first
        return sock

    def _let_go(self) -> None:
        """Close the least recently asked connection that no question waits on."""
        busy = {q_i[0].targets[q_i[1]] for q_i in self._waiting.values()}
        for target, sock in self._by_target.items():
            if target not in busy:
                del self._by_target[target]
                del self.socks[sock]
                self._unwatch(sock)
                sock.close(0)
                return

    def readable(self, sock: Any) -> None:
        while sock.getsockopt(zmq.EVENTS) & zmq.POLLIN:
            head, body = wire.parse(wire.recv_frames(sock))
            if head[0] != "result":
                continue
            result = protocol.decode(head)
            entry = self._waiting.pop(result.cid, None)
            if entry is None:
                continue  # after its question's deadline
            q, i = entry
            q.answers[i] = (bool(result.ok), [bytes(f) for f in body])
            q.left -= 1
            if q.left == 0:
                self._answer(q)

    def tick(self) -> None:
        """Answer the questions whose time is up, with what came (called from the agent's loop)."""
        if not self._questions:
            return
        now = time.monotonic()
        for q in [q for q in self._questions if q.deadline <= now]:
            for cid in q.cids:
                self._waiting.pop(cid, None)
            self._answer(q)

    def next_due(self) -> float | None:
        return min((q.deadline for q in self._questions), default=None)

    def _answer(self, q: _Question) -> None:
        if q in self._questions:
            self._questions.remove(q)
            self.agent.reply(q.reply_to, q.cid, True, q.answers)

    def close(self) -> None:
        for sock in list(self.socks):
            self._unwatch(sock)
            sock.close(0)
        self.socks.clear()
        self._by_target.clear()
