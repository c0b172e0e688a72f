"""Output at scale: the same line from many ranks printed once, with the ranks that printed it.

4,096 ranks printing ``epoch 3 loss 2.31`` should cost one console line, ``[rank 0-4095] epoch
3 loss 2.31``, not 4,096. :class:`LineGrouper` holds each complete console line while other
ranks keep printing it (up to :data:`GROUP_WINDOW` after the last one did, :data:`MAX_HOLD` at
most, :data:`MAX_BURST_HOLD` while thousands of ranks' copies are still arriving) and merges the identical lines (same stream, same bytes) that
other ranks print meanwhile; a line that only one rank printed comes out with that rank's usual
prefix. Each rank's lines keep their order: a line joins a waiting group only when that group
comes after every line the rank already has waiting, and groups are printed in the order they
were opened. A group every live shown rank has joined is printed at once.

Only the console is grouped: the per-rank logs (:class:`~.output.OutputSink`) get every byte.
Grouping is on by default when more than :data:`AUTO_MIN_RANKS` ranks are shown (small runs
print exactly as before); ``group=True``/``False`` (``--group``/``--no-group``) forces it.

:func:`outcome_summary` does the same for the exit report: ranks grouped by how they ended.
"""

from __future__ import annotations

import collections
import threading
import time
from collections.abc import Callable, Iterable
from typing import Any

from .ranks import rank_ranges

#: How long a line waits for the same line from more ranks, counted from the last rank that joined.
GROUP_WINDOW = 0.25
#: The longest a line waits however many ranks keep joining (a slow, steady trickle).
MAX_HOLD = 2.0
#: Ranks a second: a line joined faster than this is one moment's output of thousands of ranks,
#: still arriving (the client reads ~15-20 k ranks' events a second: 32,768 ranks' line takes it
#: ~2 s), not a trickle; it may wait up to :data:`MAX_BURST_HOLD`, so that it prints once.
BURST_RATE = 1000.0
#: The longest a line arriving as a burst waits.
MAX_BURST_HOLD = 10.0
#: Grouping is on by default when more ranks than this are shown on the console.
AUTO_MIN_RANKS = 16
#: Groups waiting at most: beyond this the oldest is printed whatever its age (bounded memory).
MAX_WAITING = 20_000


def grouping_wanted(group: bool | None, shown: int) -> bool:
    """``--group``/``--no-group`` as given, else on for more than :data:`AUTO_MIN_RANKS` shown ranks."""
    return group if group is not None else shown > AUTO_MIN_RANKS


class _Group:
    __slots__ = ("born", "joined", "live", "printed", "ranks", "seq", "stream", "text")

    def __init__(self, seq: int, stream: int, text: bytes, born: float) -> None:
        self.seq = seq
        self.stream = stream
        self.text = text
        self.born = born
        self.joined = born
        self.ranks: list[int] = []
        self.live = 0  # of its ranks, those still running: all the live ranks have joined when it is len(_live)
        self.printed = False


class LineGrouper:
    """Merges identical console lines of several ranks; ``write(stream, data)`` prints.

    ``prefix``: each rank's own prefix (a line printed by one rank keeps it); ``shown``: the
    ranks on the console (a group they have all joined need not wait).
    """

    def __init__(
        self,
        write: Callable[[int, bytes], None],
        prefix: dict[int, bytes],
        shown: Iterable[int],
        *,
        window: float = GROUP_WINDOW,
        max_hold: float = MAX_HOLD,
        color: bool = False,
        noun: str = "rank",
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._clock = clock
        self._write = write
        self._noun = noun
        self._prefix = prefix
        self._live = set(shown)
        self._window = window
        self._max_hold = max(window, max_hold)
        self._color = color
        self._waiting: collections.deque[_Group] = collections.deque()
        self._latest: dict[tuple[int, bytes], _Group] = {}  # the newest waiting group of each line
        self._last_seq: dict[int, int] = {}  # rank -> seq of the group holding its newest waiting line
        self._joined: dict[int, collections.deque[_Group]] = {}  # rank -> the groups it joined, not yet printed
        self._seq = 0
        self._cond = threading.Condition()
        self._closed = False
        self._thread = threading.Thread(target=self._timer, name="monarch-output-groups", daemon=True)
        self._thread.start()

    def add(self, rank: int, stream: int, segments: Iterable[bytes]) -> None:
        """Whole console segments (each with its line end) of one rank, in order."""
        now = self._clock()
        with self._cond:
            wake = not self._waiting
            for text in segments:
                key = (stream, text)
                group = self._latest.get(key)
                if group is None or group.seq <= self._last_seq.get(rank, -1):
                    self._seq += 1
                    group = _Group(self._seq, stream, text, now)
                    self._waiting.append(group)
                    self._latest[key] = group
                group.ranks.append(rank)
                group.joined = now
                self._last_seq[rank] = group.seq
                if rank in self._live:
                    group.live += 1
                    joined = self._joined.get(rank)
                    if joined is None:
                        joined = self._joined[rank] = collections.deque()
                    while joined and joined[0].printed:  # printed in order: a prefix of its groups
                        joined.popleft()
                    joined.append(group)
            self._print_due(now)
            if wake:
                self._cond.notify()

    def rank_ended(self, rank: int) -> None:
        """``rank`` prints no more: groups need not wait for it."""
        with self._cond:
            if rank in self._live:
                self._live.discard(rank)
                for group in self._joined.pop(rank, ()):
                    group.live -= 1
            self._print_due(self._clock())

    def close(self) -> None:
        """Print everything still waiting."""
        with self._cond:
            self._closed = True
            self._print_due(float("inf"))
            self._cond.notify()
        self._thread.join(timeout=1.0)

    def _timer(self) -> None:
        with self._cond:
            while not self._closed:
                if not self._waiting:
                    self._cond.wait()
                    continue
                head = self._waiting[0]
                now = self._clock()
                left = min(head.joined + self._window, head.born + self._hold(head, now)) - now
                if left > 0:
                    self._cond.wait(left)
                self._print_due(self._clock())

    def _hold(self, group: _Group, now: float) -> float:
        """How long ``group`` may wait since it was born: longer while it fills as a burst."""
        age = now - group.born
        if age >= self._max_hold and len(group.ranks) >= BURST_RATE * age:
            return max(self._max_hold, MAX_BURST_HOLD)
        return self._max_hold

    def _print_due(self, now: float) -> None:
        """Print, oldest first, the waiting groups that are old enough or complete (lock held)."""
        waiting = self._waiting
        out: dict[int, list[bytes]] = {}
        live = len(self._live)
        while waiting:
            head = waiting[0]
            due = now - head.joined >= self._window or now - head.born >= self._hold(head, now)
            # Complete: every rank still running has joined it (ranks that ended count for nothing:
            # a group of ended ranks still waits for live ranks printing the same line).
            if not (due or head.live >= live or len(waiting) > MAX_WAITING):
                break
            waiting.popleft()
            head.printed = True
            if self._latest.get((head.stream, head.text)) is head:
                del self._latest[(head.stream, head.text)]
            out.setdefault(head.stream, []).append(self._label(head.ranks) + head.text)
        for stream, lines in out.items():
            self._write(stream, b"".join(lines))

    def _label(self, ranks: list[int]) -> bytes:
        if len(ranks) == 1:
            return self._prefix[ranks[0]]
        text = f"[{self._noun} {rank_ranges(ranks)}] "
        return (f"\x1b[1m{text}\x1b[0m" if self._color else text).encode()


# ----------------------------------------------------------------------- exit summary
def outcome_summary(exits: Iterable[Any], list_up_to: int = 4) -> str:
    """``4,094 exited 0; rank 17, 802: killed by SIGSEGV``: ranks grouped by how they ended
    (``exits``: :class:`~.spmd.RankExit`), the largest group first; a group of at most
    ``list_up_to`` ranks names them."""
    groups: dict[str, list[int]] = {}
    for e in exits:
        groups.setdefault("exited 0" if e.ok else e.how, []).append(e.rank)
    parts = []
    for how, ranks in sorted(groups.items(), key=lambda kv: (-len(kv[1]), kv[0] != "exited 0", min(kv[1]))):
        if len(ranks) <= list_up_to:
            names = ", ".join(str(r) for r in sorted(ranks))
            parts.append(f"rank{'s' if len(ranks) > 1 else ''} {names}: {how}")
        else:
            parts.append(f"{len(ranks):,} {how}" if how == "exited 0" else f"{len(ranks):,} ranks: {how}")
    return "; ".join(parts)


def failure_rows(exits: Iterable[Any], limit: int = 20) -> tuple[list[Any], int]:
    """The failed ranks worth a row each in the exit table: the first failure, then one per
    distinct (outcome, last line), at most ``limit``; and how many failed ranks were left out."""
    failed = [e for e in exits if not e.ok]
    seen: set[tuple[str, str]] = set()
    rows: list[Any] = []
    for e in failed:
        key = (e.how, e.tail[-1] if e.tail else "")
        if key in seen or len(rows) >= limit:
            continue
        seen.add(key)
        rows.append(e)
    return rows, len(failed) - len(rows)
