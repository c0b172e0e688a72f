"""``monarch sql``: a read-only query of the reservation's telemetry store.

This module imports only the standard library and :mod:`monarch_cli.telemetry`, so
``monarch sql`` answers without loading Typer, rich or the runtime (see :func:`fast_main`,
which ``monarch_cli.cli.main`` calls directly). The Typer command in
:mod:`.telemetry` renders through the same functions, for ``--help`` and in-process use.
"""

from __future__ import annotations

import argparse
import csv
import io
import json
import math
import signal
import sys
import threading
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from ..config import env
from ..telemetry import (
    DEFAULT_MAX_ROWS,
    DEFAULT_TIMEOUT,
    StoreError,
    db_path,
    query_bounded,
    schema_json,
    schema_text,
)

_MAX_CELL = 120


def store_path(state: str | None) -> Path:
    """The store next to the state file (same rules as ``--state`` everywhere)."""
    if state:
        return db_path(Path(state).expanduser().parent)
    from_env = env.state
    return db_path(Path(from_env).expanduser().parent if from_env else Path(".monarch"))


def render(cols: list[str], rows: Sequence[tuple[Any, ...]], fmt: str) -> str:
    if fmt == "json":
        return json.dumps([dict(zip(cols, r)) for r in rows], indent=1, default=_plain) + "\n"
    if fmt == "csv":
        buf = io.StringIO()
        w = csv.writer(buf, lineterminator="\n")
        w.writerow(cols)
        w.writerows([[_plain(v) for v in r] for r in rows])
        return buf.getvalue()
    cells = [[_cell(v) for v in r] for r in rows]
    widths = [max([len(c)] + [len(r[i]) for r in cells]) for i, c in enumerate(cols)]
    lines = ["  ".join(c.ljust(w) for c, w in zip(cols, widths)).rstrip()]
    lines += ["  ".join(v.ljust(w) for v, w in zip(r, widths)).rstrip() for r in cells]
    lines.append(f"({len(rows)} row{'s' if len(rows) != 1 else ''})")
    return "\n".join(lines) + "\n"


def _plain(v: Any) -> Any:
    return v.decode("utf-8", "backslashreplace") if isinstance(v, bytes) else v


def _cell(v: Any) -> str:
    text = "NULL" if v is None else f"{v:.3f}" if isinstance(v, float) else str(_plain(v))
    text = text.replace("\n", "\\n")
    return text if len(text) <= _MAX_CELL else text[: _MAX_CELL - 1] + "…"


def run_sql(
    statement: str | None,
    state: str | None,
    fmt: str,
    schema: bool,
    max_rows: int = DEFAULT_MAX_ROWS,
    timeout: float = DEFAULT_TIMEOUT,
) -> tuple[int, str, str]:
    """(exit code, stdout text, stderr text) for ``monarch sql``; Ctrl-C abandons the query (exit 130)."""
    if schema:
        return 0, (json.dumps(schema_json(), indent=1) + "\n") if fmt == "json" else schema_text() + "\n", ""
    if not statement or not statement.strip():
        return (
            2,
            "",
            'monarch: error: give a query, e.g. monarch sql "SELECT * FROM runs" (monarch sql --schema lists the tables)\n',
        )
    if max_rows < 1 or not math.isfinite(timeout) or timeout <= 0:
        return 2, "", "monarch: error: --max-rows and --timeout take positive numbers\n"
    pressed: list[int] = []
    old = None
    if threading.current_thread() is threading.main_thread():
        old = signal.signal(signal.SIGINT, lambda *_: pressed.append(1))
    settle_runs(store_path(state).parent)
    try:
        cols, rows, more = query_bounded(
            store_path(state), statement, max_rows=max_rows, timeout=timeout, interrupted=lambda: bool(pressed)
        )
    except StoreError as e:
        return 130 if pressed else 2, "", f"monarch: error: {e}\n"
    finally:
        if old is not None:
            signal.signal(signal.SIGINT, old)
    note = f"monarch: showing the first {max_rows} rows; --max-rows raises the limit\n" if more else ""
    return 0, render(cols, rows, fmt), note


def settle_runs(state_dir: Path) -> None:
    """Runs whose client died read as ended (``run_owner``), not "running" forever."""
    from ..jobs.run_owner import settle_open

    try:
        settle_open(state_dir)
    except OSError:
        pass  # logs we cannot read: the store says what it says


def _number(kind: type) -> Callable[[str], Any]:
    def parse(text: str) -> Any:
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
        if not math.isfinite(value) or value <= 0:
            raise argparse.ArgumentTypeError(f"must be a positive number, not {text!r}")
        return value

    return parse


def fast_main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="monarch sql", add_help=False)
    parser.add_argument("statement", nargs="?")
    parser.add_argument("--state")
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--csv", action="store_true")
    parser.add_argument("--schema", action="store_true")
    parser.add_argument("--max-rows", type=_number(int), default=DEFAULT_MAX_ROWS)
    parser.add_argument("--timeout", type=_number(float), default=DEFAULT_TIMEOUT)
    try:
        args, extra = parser.parse_known_args(argv)
    except SystemExit:  # argparse has printed its line
        return 2
    if extra:
        sys.stderr.write(f"monarch: error: unknown option(s) for sql: {' '.join(extra)}\n")
        return 2
    if args.json and args.csv:
        sys.stderr.write("monarch: error: --json and --csv together: pick one\n")
        return 2
    code, out, err = run_sql(
        args.statement,
        args.state,
        "json" if args.json else "csv" if args.csv else "text",
        args.schema,
        args.max_rows,
        args.timeout,
    )
    sys.stdout.write(out)
    sys.stderr.write(err)
    return code
