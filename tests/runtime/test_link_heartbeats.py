"""When a watched agent counts as lost (``runtime/mailbox/heartbeats.py``), on a clock of our own.

The judgement is what users see as "host X stopped answering": a vanished host must be named
within the timeout of its last answer, and a client that was too busy to beat (or to read)
must not name live hosts lost.
"""

from __future__ import annotations

from typing import Any

import pytest

from monarch_cli.config import configure, settings
from monarch_cli.runtime.mailbox.heartbeats import LinkHeartbeats


class Clock:
    """Drives a LinkHeartbeats as the I/O thread would, in steps of ``step`` seconds."""

    def __init__(self, agents: list[str]) -> None:
        self.now = 1000.0
        self.sent: list[tuple[float, str]] = []
        self.lost: list[tuple[float, str, float]] = []
        self.beats = LinkHeartbeats("tcp://client:1", lambda: set(agents), self._lost, self._send)
        for a in agents:
            self.beats.watch(a)
        self.beats.tick(self.now, drained=True)
        for a in agents:  # every link up and answering
            self.beats.acked(a, self.now)

    def _send(self, agent: str, frames: list[Any]) -> None:
        self.sent.append((self.now, agent))

    def _lost(self, agent: str, silence: float) -> None:
        self.lost.append((self.now, agent, silence))

    def run(self, seconds: float, answering: set[str], step: float = 0.05, drained: bool = True) -> None:
        """Let time pass; the agents in ``answering`` ack every beat they get at once."""
        end = self.now + seconds
        while self.now < end:
            self.now = round(self.now + step, 6)
            before = len(self.sent)
            self.beats.tick(self.now, drained)
            for _, agent in self.sent[before:]:
                if agent in answering:
                    self.beats.acked(agent, self.now)


@pytest.fixture(autouse=True)
def _timings() -> Any:
    old = settings().heartbeat_interval, settings().heartbeat_timeout
    configure(heartbeat_interval=0.5, heartbeat_timeout=5.0)
    yield
    configure(heartbeat_interval=old[0], heartbeat_timeout=old[1])


def test_answering_agents_are_never_lost_and_are_beaten_every_interval() -> None:
    c = Clock(["a", "b"])
    c.run(30, answering={"a", "b"})
    assert c.lost == []
    beats_to_a = [t for t, agent in c.sent if agent == "a"]
    gaps = [round(t2 - t1, 3) for t1, t2 in zip(beats_to_a, beats_to_a[1:])]
    assert gaps and max(gaps) <= 0.55, gaps


def test_a_vanished_host_is_named_within_the_timeout_of_its_last_answer() -> None:
    c = Clock(["a", "b"])
    c.run(3.3, answering={"a", "b"})
    last_answer = c.now  # b answers nothing from here on
    c.run(10, answering={"a"})
    assert [(agent) for _, agent, _ in c.lost] == ["b"]
    named_at, _, silence = c.lost[0]
    assert named_at - last_answer <= 5.0 + 0.06  # (one step of this clock)
    assert named_at - last_answer >= 4.5  # and not before the timeout of its last beat's answer
    assert 4.5 <= silence <= 5.6


def test_a_client_that_could_not_beat_or_read_does_not_name_live_hosts_lost() -> None:
    c = Clock(["a"])
    c.run(2, answering={"a"})
    c.run(0.5, answering=set())  # a beat goes out, and the process stalls before it reads the answer
    c.now += 8  # (a long pause: nothing sent, nothing read)
    c.beats.acked("a", c.now)  # on waking, the I/O loop reads the links before it judges
    c.run(1, answering={"a"})
    assert c.lost == []


def test_beats_go_on_under_a_flood_and_a_host_lost_meanwhile_is_still_named() -> None:
    """While the links are never drained (a flood of output), beats must still go out (the agents
    reap a client whose beats stop), and a silent host is named once the flood has lasted a timeout."""
    c = Clock(["a", "b"])
    c.run(1, answering={"a", "b"})
    sent = len(c.sent)
    c.run(3, answering={"a"}, drained=False)
    assert {agent for _, agent in c.sent[sent:]} == {"a", "b"}  # every interval, to both
    assert c.lost == []  # silence is not judged within a timeout of undrained links
    c.run(10, answering={"a"}, drained=False)
    assert [agent for _, agent, _ in c.lost] == ["b"]


def test_a_host_whose_output_is_still_being_read_is_not_lost_while_its_acks_wait_behind_it() -> None:
    """A client that reads slower than its agents write has each host's ack queued behind that
    host's output for longer than the timeout; every message read from the host shows it alive."""
    c = Clock(["a", "b"])
    c.run(1, answering={"a", "b"})
    for _ in range(200):  # 10 s of flood: b's acks never come through, its output does
        c.run(0.05, answering={"a"}, step=0.05, drained=False)
        c.beats.heard("b", c.now)
    assert c.lost == []
    c.run(10, answering={"a"}, drained=False)  # b's output stops too: b is named
    assert [agent for _, agent, _ in c.lost] == ["b"]


def test_under_a_flood_a_slow_reader_does_not_blame_hosts_it_has_not_read_in_turn() -> None:
    """A reader that takes longer than the timeout to get round every connection (a client under
    a profiler) names nobody whose turn has not come; once a full turn was read without a word
    from a host, that host is named."""
    agents = [f"h{i}" for i in range(8)]
    c = Clock(agents)
    c.run(1, answering=set(agents))
    c.run(12, answering=set(), drained=False)  # 12 s of flood, nothing read from anyone
    assert c.lost == []
    for a in agents[1:]:  # a turn of reading: every host but h0 is heard from
        c.beats.heard(a, c.now)
    c.run(1, answering=set(), drained=False)
    assert [agent for _, agent, _ in c.lost] == ["h0"]


def test_a_host_that_keeps_talking_is_beaten_only_as_often_as_it_needs_to_keep_the_client() -> None:
    """A host whose messages already show it alive is not beaten every interval (half a
    4,096-host run's messages were beats and their acks), but still every third of the
    timeout, or its agent would reap the client; a quiet host is beaten every interval, and
    once the talking host goes silent it is named as before."""
    c = Clock(["a", "b"])
    sent = len(c.sent)
    for _ in range(100):  # 10 s: "a" sends something every 0.1 s
        c.run(0.1, answering={"a", "b"})
        c.beats.heard("a", c.now)
    beats_a = [t for t, agent in c.sent[sent:] if agent == "a"]
    beats_b = [t for t, agent in c.sent[sent:] if agent == "b"]
    assert len(beats_b) >= 18
    assert 5 <= len(beats_a) <= 8, beats_a
    gaps = [t2 - t1 for t1, t2 in zip(beats_a, beats_a[1:])]
    assert max(gaps) <= 5.0 / 3 + 0.06, gaps
    assert c.lost == []
    last = c.now
    c.run(10, answering={"b"})  # "a" goes silent
    assert [agent for _, agent, _ in c.lost] == ["a"]
    assert c.lost[0][0] - last <= 5.0 + 0.06
