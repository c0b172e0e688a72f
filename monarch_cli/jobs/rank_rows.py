"""One row per rank of a run (``monarch top``), and the rules that pick a rank out of the others.

``diagnose`` and ``top`` share them: a rank silent while the others print, a rank steps behind
the others, a rank's GPU idle while the others' are busy. Each compares one rank with all the
others, at thousands of hosts tens of thousands of ranks, so the others' aggregates are
computed once.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

__all__ = ["RankRow", "suspicions"]


@dataclasses.dataclass
class RankRow:
    """One line of ``monarch top``."""

    rank: int
    host: str | None = None
    state: str = "?"
    cpu_percent: float | None = None
    rss_mb: float | None = None
    gpu_util: float | None = None
    gpu_mem_mb: float | None = None
    step: int | None = None
    step_ms: float | None = None
    output_age: float | None = None
    last_line: str = ""
    suspect: str = ""


def suspicions(rows: list[RankRow], silence: float = 60.0) -> dict[int, list[str]]:
    """Ranks that differ from the rest in output age, step count or GPU use.

    Each test compares one rank with all the others, so the others' aggregates are computed once
    (a median without one value is index arithmetic on the sorted list): at 1,024 hosts x 8 ranks
    a list of the others per rank made ``diagnose`` quadratic, seconds of it.
    """
    out: dict[int, list[str]] = {}
    if len(rows) < 2:
        return out
    ages = [r.output_age for r in rows if r.output_age is not None]
    # a silent rank (age > silence) is never among the recent ones, so they are the same for each
    recent = [a for a in ages if a < silence / 2]
    steps = sorted(r.step or 0 for r in rows)
    top = steps[-1]
    gpus = sorted(r.gpu_util for r in rows if r.gpu_util is not None)
    for r in rows:
        if r.output_age is not None and r.output_age > silence and len(ages) == len(rows):
            if len(recent) > (len(rows) - 1) / 2:
                out.setdefault(r.rank, []).append(
                    f"no output for {r.output_age:.0f} s while the others printed within {max(recent):.0f} s"
                )
        step = r.step or 0
        if top >= 2 and top - step >= 2 and _median_without(steps, step) >= top - 1:
            out.setdefault(r.rank, []).append(f"at step {step} while the others reached {top}")
        if r.gpu_util is not None and r.gpu_util < 10 and len(gpus) >= 2:
            busy = _median_without(gpus, r.gpu_util)
            if busy > 50:
                out.setdefault(r.rank, []).append(
                    f"GPU idle ({r.gpu_util:.0f} %) while the others are busy (median {busy:.0f} %)"
                )
    return out


def _median_without(ordered: Sequence[float], value: float) -> float:
    """``statistics.median`` of ``ordered`` (sorted, holding ``value``) less one ``value``, in O(log n)."""
    import bisect  # (not on a run's path)

    skip = bisect.bisect_left(ordered, value)
    size = len(ordered) - 1

    def at(k: int) -> float:
        return ordered[k] if k < skip else ordered[k + 1]

    if size % 2:
        return at(size // 2)
    return (at(size // 2 - 1) + at(size // 2)) / 2
