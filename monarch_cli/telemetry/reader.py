"""Reading the telemetry store: read-only connections and bounded queries. Errors are :class:`StoreError`.

Any process reads the store while a run writes it (WAL mode): ``monarch sql``, the dashboard, the MCP
server, ``top``/``stack``/``diagnose``. A read connection cannot change the store (``mode=ro``,
``query_only``, an authorizer that refuses ATTACH and PRAGMA writes).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..errors import StoreError
from .schema import _check_ours

if TYPE_CHECKING:
    import sqlite3

#: PRAGMAs that only read; any other, or one of these given a value, is refused.
_READ_PRAGMAS = {
    "table_info",
    "table_xinfo",
    "table_list",
    "index_list",
    "index_info",
    "index_xinfo",
    "foreign_key_list",
    "database_list",
    "collation_list",
    "function_list",
    "module_list",
    "pragma_list",
    "compile_options",
    "journal_mode",
    "user_version",
    "schema_version",
    "page_count",
    "page_size",
    "freelist_count",
    "encoding",
    "data_version",
    "integrity_check",
    "quick_check",
    "query_only",
}
_TABLE_ARGUMENT = {
    "table_info",
    "table_xinfo",
    "index_list",
    "index_info",
    "index_xinfo",
    "foreign_key_list",
    "integrity_check",
    "quick_check",
}


class _ReadOnly:
    """The authorizer of a read-only connection: no ATTACH, no VACUUM INTO, no PRAGMA that sets anything."""

    def __init__(self) -> None:
        self.refused: str | None = None

    def __call__(self, action: int, arg1: str | None, arg2: str | None, *_: Any) -> int:
        import sqlite3

        if action in (sqlite3.SQLITE_ATTACH, sqlite3.SQLITE_DETACH):
            self.refused = "ATTACH/DETACH (and VACUUM, which attaches) is refused"
        elif action == sqlite3.SQLITE_PRAGMA and (
            (arg1 or "").lower() not in _READ_PRAGMAS
            or (arg2 is not None and (arg1 or "").lower() not in _TABLE_ARGUMENT)
        ):
            self.refused = f"PRAGMA {arg1}{'=' + arg2 if arg2 is not None else ''} is refused"
        else:
            return sqlite3.SQLITE_OK
        return sqlite3.SQLITE_DENY


def connect_readonly(path: Path) -> sqlite3.Connection:
    """A connection that cannot change the store: ``mode=ro``, ``query_only``, no ATTACH, no PRAGMA writes."""
    import sqlite3

    path = Path(path)
    if not path.exists():
        raise StoreError(f"no telemetry store at {path}: nothing has run on this reservation yet")
    try:
        _check_ours(path)
    except PermissionError as e:
        raise StoreError(str(e)) from None
    conn = sqlite3.connect(path.resolve().as_uri() + "?mode=ro", uri=True, timeout=10.0)
    conn.execute("PRAGMA query_only=1")
    conn.set_authorizer(_ReadOnly())
    return conn


def query(path: Path, sql: str, params: Sequence[Any] = ()) -> tuple[list[str], list[tuple[Any, ...]]]:
    """Run one read-only statement; returns (column names, rows). Errors are :class:`StoreError`."""
    cols, rows, _ = query_bounded(path, sql, params)
    return cols, rows


#: ``monarch sql``'s defaults (``--max-rows``, ``--timeout``): a runaway query (a recursive CTE)
#: stops there instead of growing until the machine runs out of memory.
DEFAULT_MAX_ROWS = 10_000
DEFAULT_TIMEOUT = 30.0
_HEAP_LIMIT = 1 << 30  # SQLite's own memory (sorts, CTE queues) in this process, whatever the rows


def query_bounded(
    path: Path,
    sql: str,
    params: Sequence[Any] = (),
    *,
    max_rows: int | None = None,
    timeout: float | None = None,
    interrupted: Callable[[], bool] | None = None,
    clip: Callable[[Any], Any] | None = None,
) -> tuple[list[str], list[tuple[Any, ...]], bool]:
    """:func:`query` with bounds: (columns, at most ``max_rows`` rows, whether more were left out).

    ``clip`` is applied to every cell as rows are read, a few at a time: 200 rows of 4 MB cells
    are never held whole (the MCP server held 690 MiB for a 2 KB answer).

    The statement is abandoned (:class:`StoreError`) past ``timeout`` seconds or once
    ``interrupted()`` says so (Ctrl-C): SQLite's progress handler asks every few thousand steps.
    """
    import sqlite3

    conn = connect_readonly(path)
    guard = _ReadOnly()
    deadline = time.monotonic() + timeout if timeout is not None else None
    why: list[str] = []

    def progress() -> int:
        if interrupted is not None and interrupted():
            why.append("interrupted (Ctrl-C)")
            return 1
        if deadline is not None and time.monotonic() > deadline:
            why.append(f"stopped after {timeout:g} s; --timeout raises the limit")
            return 1
        return 0

    if timeout is not None or interrupted is not None:
        conn.set_progress_handler(progress, 20_000)
    if timeout is not None:  # process-wide: `monarch sql` runs in its own process
        conn.set_authorizer(None)
        conn.execute(f"PRAGMA hard_heap_limit={_HEAP_LIMIT}")
    conn.set_authorizer(guard)
    try:
        cur = conn.execute(sql, params)
        cols = [d[0] for d in cur.description or ()]
        if max_rows is None:
            return cols, cur.fetchall(), False
        rows: list[tuple[Any, ...]] = []
        while len(rows) <= max_rows:
            batch = cur.fetchmany(min(1000 if clip is None else 8, max_rows + 1 - len(rows)))
            if not batch:
                break
            rows.extend(batch if clip is None else [tuple(clip(v) for v in row) for row in batch])
        return cols, rows[:max_rows], len(rows) > max_rows
    except sqlite3.Error as e:
        msg = str(e)
        if why:
            msg = why[0]
        elif "out of memory" in msg and timeout is not None:
            msg = f"stopped: the query needs more than {_HEAP_LIMIT >> 20} MiB; narrow it (LIMIT, WHERE)"
        elif guard.refused:
            msg = f"the telemetry store is read-only here: {guard.refused}; use SELECT"
        elif "readonly" in msg:
            msg = f"the telemetry store is read-only here ({msg}); use SELECT"
        elif "one statement at a time" in msg:
            msg = "one statement at a time, please (no ';' between statements)"
        raise StoreError(f"sql: {' '.join(msg.split())}") from None
    except sqlite3.Warning:  # Python < 3.12: "You can only execute one statement at a time."
        raise StoreError("sql: one statement at a time, please (no ';' between statements)") from None
    finally:
        conn.close()
