"""What both benchmarks share: timing a callable, and printing the one table."""

from __future__ import annotations

import os
import platform
import time
from collections.abc import Callable, Sequence

from rich.console import Console
from rich.table import Table


def timed(fn: Callable[[], object], n: int, warmup: int = 0) -> list[float]:
    """Seconds per call of ``fn``, ``n`` times, after ``warmup`` untimed calls."""
    for _ in range(warmup):
        fn()
    out = []
    for _ in range(n):
        t = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t)
    return out


def print_table(
    what: str,
    columns: Sequence[str],
    rows: Sequence[Sequence[str]],
    caption: str | None = None,
    width: int | None = None,
) -> None:
    """``width``: the console's, where a wide table must not wrap (a pipe or file is 80 columns otherwise)."""
    table = Table(title=f"monarch-cli {what} — {platform.node()}, {os.cpu_count()} cores", caption=caption)
    for col in columns:
        table.add_column(col)
    for row in rows:
        table.add_row(*row)
    Console(width=width).print(table)
