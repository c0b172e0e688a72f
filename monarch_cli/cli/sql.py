"""``monarch sql``: a read-only query of the reservation's telemetry store.

This module imports only the standard library and :mod:`monarch_cli.telemetry_store`, so
``monarch sql`` answers without loading Typer, rich or the runtime (see :func:`fast_main`,
which ``monarch_cli.cli.main`` calls directly). The Typer command in
:mod:`.telemetry` renders through the same functions, for ``--help`` and in-process use.
"""

from __future__ import annotations

import argparse
import csv
import io
import json
import os
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from ..telemetry_store import StoreError, db_path, query, schema_json, schema_text

_MAX_CELL = 120


def store_path(state: str | None) -> Path:
    """The store next to the state file (same rules as ``--state`` everywhere)."""
    if state:
        return db_path(Path(state).expanduser().parent)
    env = os.environ.get("MONARCH_STATE")
    return db_path(Path(env).expanduser().parent if env else Path(".monarch"))


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


def run_sql(statement: str | None, state: str | None, fmt: str, schema: bool) -> tuple[int, str, str]:
    """(exit code, stdout text, stderr text) for ``monarch sql``."""
    if schema:
        return 0, (json.dumps(schema_json(), indent=1) + "\n") if fmt == "json" else schema_text() + "\n", ""
    if not statement or not statement.strip():
        return (
            2,
            "",
            'monarch: error: give a query, e.g. monarch sql "SELECT * FROM runs" (monarch sql --schema lists the tables)\n',
        )
    try:
        cols, rows = query(store_path(state), statement)
    except StoreError as e:
        return 2, "", f"monarch: error: {e}\n"
    return 0, render(cols, rows, fmt), ""


def fast_main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="monarch sql", add_help=False)
    parser.add_argument("statement", nargs="?")
    parser.add_argument("--state")
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--csv", action="store_true")
    parser.add_argument("--schema", action="store_true")
    args, extra = parser.parse_known_args(argv)
    if extra:
        sys.stderr.write(f"monarch: error: unknown option(s) for sql: {' '.join(extra)}\n")
        return 2
    if args.json and args.csv:
        sys.stderr.write("monarch: error: --json and --csv together: pick one\n")
        return 2
    code, out, err = run_sql(
        args.statement, args.state, "json" if args.json else "csv" if args.csv else "text", args.schema
    )
    sys.stdout.write(out)
    sys.stderr.write(err)
    return code
