"""The one rank-list syntax, shared by ``run-spmd --ranks`` and ``monarch debug``."""

from __future__ import annotations

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


__all__ = ["parse_rank_list", "SYNTAX"]
