"""Telling a partition between hosts from a slow run: each host's agent probes the others.

A run whose hosts cannot reach each other hangs in its first collective while every agent
still answers the client, so nothing else reports it (gloo's timeout is 30 minutes). While a
run spans several hosts, every few seconds each agent is asked to open a TCP connection to
other agents; a pair that fails twice in a row is a partition, named with both hosts.

Up to :data:`ALL_PAIRS_UP_TO` hosts every agent probes every other one. Beyond, all pairs
would be quadratic (4,096 hosts: 16.7 M connections and 4,095 threads per agent every few
seconds, and a 4,095-address list pickled per host by the client), so host ``i`` probes
``i + 1, i + 2, i + 4, ...`` (mod N), about log2(N) peers: the ring ``i -> i + 1`` alone
crosses every split of the hosts into two sides, so a partition into groups is still found
(named by one pair across it); a single blocked pair off those offsets is not.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from ..config import env
from ..runtime import protocol
from ..runtime.mailbox.mailbox import Mailbox
from ..schedulers.base import HostRecord

__all__ = ["PartitionWatch", "probe_targets"]

#: Up to this many hosts, every agent probes every other one.
ALL_PAIRS_UP_TO = 32


def probe_targets(i: int, n: int) -> list[int]:
    """The hosts that host ``i`` of ``n`` probes: all others up to :data:`ALL_PAIRS_UP_TO`, else
    ``i + 2**k`` (mod ``n``) for ``2**k < n``."""
    if n <= ALL_PAIRS_UP_TO:
        return [j for j in range(n) if j != i]
    out: list[int] = []
    step = 1
    while step < n:
        out.append((i + step) % n)
        step *= 2
    return out


class PartitionWatch:
    def __init__(
        self,
        mb: Mailbox,
        hosts: Sequence[HostRecord],
        reach: Sequence[str],
        *,
        interval: float = 5.0,
        timeout: float = 3.0,
        confirm: int = 2,
    ) -> None:
        """``hosts``: the run's hosts; ``reach``: where this client reaches each one's agent.
        ``$MONARCH_PARTITION_PROBE_INTERVAL`` overrides ``interval`` (seconds between rounds)."""
        self.mb, self.hosts, self.reach = mb, list(hosts), list(reach)
        interval = env.partition_probe_interval or interval
        self.interval, self.timeout, self.confirm = interval, timeout, confirm
        self._next: float | None = None
        self._asked: list[tuple[int, Any]] = []  # (host index, future) of the probe round in flight
        self._failures: dict[tuple[int, int], int] = {}  # (from, to) -> rounds failed in a row
        self.found: str | None = None

    def tick(self, now: float) -> str | None:
        """Start or collect probe rounds; a one-line description once a partition is confirmed."""
        if len(self.hosts) < 2 or self.found is not None:
            return None
        if self._asked:
            if not all(f.done() for _, f in self._asked):
                return None
            self._collect()
            return self.found
        if self._next is None:
            self._next = now + self.interval
        if now >= self._next:
            self._next = now + self.interval
            self._ask()
        return None

    @property
    def probing(self) -> bool:
        """A probe round is on its way."""
        return bool(self._asked)

    def urgent(self, now: float) -> None:
        """Ctrl-C: probe now, with a short timeout, and believe the first failure (the user is
        waiting: a run hung on a partition must end within seconds)."""
        if len(self.hosts) < 2 or self.found is not None:
            return
        self.confirm, self.timeout = 1, min(self.timeout, 2.0)
        if not self._asked:
            self._next = now + self.interval
            self._ask()

    def _ask(self) -> None:
        n = len(self.hosts)
        for i in range(n):
            peers = [self.hosts[j].agent for j in probe_targets(i, n)]

            def probe(cid: int, peers: list[str] = peers) -> protocol.ProbePeers:
                return protocol.ProbePeers(cid, self.mb.address, peers, self.timeout)

            fut = self.mb.request(self.reach[i], probe)
            self._asked.append((i, fut))

    def _collect(self) -> None:
        asked, self._asked = self._asked, []
        by_address = {h.agent: j for j, h in enumerate(self.hosts)}
        for i, fut in asked:
            try:
                answers = fut.get(timeout=0)
            except Exception:  # noqa: BLE001 - an agent that cannot answer is the heartbeat's to report
                continue
            for address, why in dict(answers).items():
                j = by_address.get(address)
                if j is None:
                    continue
                if not why:
                    self._failures.pop((i, j), None)
                    continue
                n = self._failures[(i, j)] = self._failures.get((i, j), 0) + 1
                if n >= self.confirm and self.found is None:
                    a, b = self.hosts[i].name, self.hosts[j].name
                    self.found = f"network partition: {a} cannot reach {b} ({a} -> {b}: {why})"


def partition_now(mb: Mailbox, hosts: Sequence[HostRecord], timeout: float = 3.0) -> str | None:
    """One probe round, waited for (``monarch diagnose`` on a live run): the first pair of
    ``hosts`` that cannot reach each other, in one line, or None. An agent that does not answer
    is not judged here (the liveness checks name it)."""
    if len(hosts) < 2:
        return None
    watch = PartitionWatch(mb, hosts, [h.agent for h in hosts], timeout=timeout, confirm=1)
    watch._ask()
    for _, fut in watch._asked:
        try:
            fut.get(timeout=timeout + 10)
        except Exception:  # noqa: BLE001 - _collect skips it
            pass
    watch._collect()
    return watch.found
