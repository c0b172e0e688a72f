"""Keeping an agent's context small: every result is bounded and says what it left out.

A training run can print millions of lines on thousands of ranks; an agent's context holds a
few hundred thousand tokens, all told. So lines are clipped, lists capped, and each result
that left something out says how much and how to get it (``logs`` with ``tail``/``grep``,
``sql`` with ``LIMIT``/``OFFSET``).
"""

from __future__ import annotations

import os
import re
import time
from collections import deque
from pathlib import Path
from typing import Any

from ..errors import UserError

#: One line of output, at most (the rest is counted).
MAX_LINE = 400
#: Rank entries in a run's result (failures first), rank groups cover every rank anyway.
MAX_RANKS = 64
#: Lines a ``logs`` call returns at most, over all its ranks.
MAX_LOG_LINES = 1000
#: Rows a ``sql`` call returns at most, and characters per cell.
MAX_ROWS = 500
MAX_CELL = 2000
#: Stack groups (and frames per group) in ``stack``.
MAX_GROUPS = 20
MAX_FRAMES = 40
#: The text rendering of any result, at most.
MAX_TEXT = 16000


def clip_line(line: str, limit: int = MAX_LINE) -> str:
    if len(line) <= limit:
        return line
    return f"{line[:limit]}… [{len(line) - limit} more characters]"


def clip_text(text: str, limit: int = MAX_TEXT) -> str:
    if len(text) <= limit:
        return text
    return text[:limit] + f"\n… [{len(text) - limit} more characters; the structured result has the data]"


#: How far back from a log's end :func:`tail_lines` reads at most (a line longer than this, with
#: no newline, is shown from where the read stopped), and how much of a line :func:`scan` matches.
MAX_TAIL_BYTES = 16 << 20
MAX_MATCH = 1 << 16


def tail_lines(path: Path, n: int, block: int = 1 << 16) -> list[str]:
    """The last ``n`` lines of a file, read from its end (a log may be gigabytes), clipped.

    Linear in what it reads, and it reads at most :data:`MAX_TAIL_BYTES`: a 64 MiB line with no
    newline (a tqdm bar redrawn with ``\\r``) took 33 s a call when each block was prepended to
    all the others."""
    if n <= 0:
        return []
    chunks: list[bytes] = []
    newlines = read = 0
    with open(path, "rb") as f:
        end = f.seek(0, os.SEEK_END)
        while end > 0 and newlines <= n and read < MAX_TAIL_BYTES:
            start = max(0, end - block)
            f.seek(start)
            chunk = f.read(end - start)
            chunks.append(chunk)
            newlines += chunk.count(b"\n")
            read += len(chunk)
            end = start
    data = b"".join(reversed(chunks))
    lines = data.decode("utf-8", "backslashreplace").splitlines()
    return [clip_line(l) for l in lines[-n:]]


#: What a grep may take: on one line, and in all over one call. A pattern such as ``(a+)+$``
#: backtracks for ever on a long line of ``a``; matched by ``re`` it held the GIL, and the server
#: answered nothing more. The ``regex`` package stops a match at its timeout.
GREP_LINE_S = 2.0
GREP_TOTAL_S = 30.0


class Grep:
    """A caller's pattern, matched with a time budget (``regex``'s ``timeout``, which ``re`` lacks).

    Past :data:`GREP_LINE_S` on one line, or :data:`GREP_TOTAL_S` in all, the match stops with
    one line that says why (:class:`UserError`); the server goes on serving."""

    def __init__(self, pattern: str, line_s: float = GREP_LINE_S, total_s: float = GREP_TOTAL_S) -> None:
        import regex

        try:
            self.compiled = regex.compile(pattern)
        except (regex.error, ValueError, OverflowError) as e:
            raise UserError(f"grep: not a regular expression: {e}") from None
        self.pattern, self.line_s = pattern, line_s
        self.deadline = time.monotonic() + total_s
        self.total_s = total_s

    def search(self, line: str) -> bool:
        left = self.deadline - time.monotonic()
        if left <= 0:
            raise UserError(
                f"grep: matching took more than {self.total_s:g} s in all; narrow it with rank=, or use sql over "
                "the logs table"
            )
        try:
            return self.compiled.search(line, timeout=min(self.line_s, left)) is not None
        except TimeoutError:
            raise UserError(
                f"grep: {self.pattern!r} took more than {min(self.line_s, left):.3g} s on one line and was stopped "
                "(nested repeats such as (a+)+ backtrack without end on long lines); simplify the pattern"
            ) from None


def scan(path: Path, pattern: Grep | re.Pattern[str] | None, tail: int) -> tuple[list[dict[str, Any]], int, int]:
    """(the last ``tail`` lines that match, with their line numbers; how many matched; lines in the file).

    A line is matched on its first :data:`MAX_MATCH` bytes: what a grep costs is bounded by the
    file's size, however long its lines, and a :class:`Grep` bounds the time its pattern takes."""
    kept: deque[dict[str, Any]] = deque(maxlen=max(tail, 0))
    matched = total = 0
    with open(path, "rb") as f:
        while True:
            raw = f.readline(MAX_MATCH)
            if not raw:
                break
            if not raw.endswith(b"\n"):
                while (rest := f.readline(MAX_MATCH)) and not rest.endswith(b"\n"):
                    pass  # the rest of a long line: counted, not matched
            total += 1
            line = raw.decode("utf-8", "backslashreplace").rstrip("\r\n")
            if pattern is None or pattern.search(line):
                matched += 1
                kept.append({"n": total, "line": clip_line(line)})
    return list(kept), matched, total


def cell(value: Any) -> Any:
    if isinstance(value, bytes):
        value = value.decode("utf-8", "backslashreplace")
    if isinstance(value, str) and len(value) > MAX_CELL:
        return f"{value[:MAX_CELL]}… [{len(value) - MAX_CELL} more characters]"
    return value


#: Hosts listed in a result (status, warm, exec), at most.
MAX_HOSTS = 256


def cap(data: dict[str, Any], key: str, limit: int, hint: str) -> None:
    """Keep the first ``limit`` entries of ``data[key]``; say how many were left out and where they are."""
    items = data.get(key)
    if isinstance(items, list) and len(items) > limit:
        data[key] = items[:limit]
        data[f"{key}_left_out"] = len(items) - limit
        data[f"{key}_hint"] = hint
