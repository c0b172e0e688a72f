"""The one rank-list syntax, shared by ``run-spmd --ranks``, ``monarch debug``, grouped output and the run log."""

from __future__ import annotations

from collections.abc import Iterable

from .errors import JobError

SYNTAX = "numbers, ranges and slices such as 0,3 or 2-5 or 0:8:2"


def parse_rank_list(text: str, size: int | None, what: str = "ranks") -> set[int]:
    """``0,3``, ``2-5`` (inclusive), ``0:8:2`` (a Python slice); ``size`` bounds open slices.

    Without a ``size`` (the ranks are not known yet), a slice needs its end.
    """
    out: set[int] = set()
    try:
        for part in text.split(","):
            part = part.strip()
            if ":" in part:
                bits = [int(b) if b.strip() else None for b in part.split(":")]
                if len(bits) > 3:
                    raise ValueError(part)
                if size is None:
                    if len(bits) < 2 or bits[1] is None:
                        raise ValueError(part)
                    out.update(range(bits[1])[slice(*bits)])
                else:
                    out.update(range(size)[slice(*bits)])
            elif "-" in part[1:]:
                lo, hi = part.split("-")
                out.update(range(int(lo), int(hi) + 1))
            elif part:
                value = int(part)
                if value < 0:
                    raise ValueError(part)
                out.add(value)
    except (ValueError, TypeError):
        raise JobError(f"{what} takes {SYNTAX}, not {text!r}") from None
    return out


def rank_ranges(ranks: Iterable[int]) -> str:
    """``0-3,5,7-9`` for ranks 0,1,2,3,5,7,8,9 (what :func:`parse_rank_list` reads back)."""
    out: list[str] = []
    ordered = sorted(set(ranks))
    i = 0
    while i < len(ordered):
        j = i
        while j + 1 < len(ordered) and ordered[j + 1] == ordered[j] + 1:
            j += 1
        out.append(str(ordered[i]) if i == j else f"{ordered[i]}-{ordered[j]}")
        i = j + 1
    return ",".join(out)


__all__ = ["parse_rank_list", "rank_ranges", "SYNTAX"]
