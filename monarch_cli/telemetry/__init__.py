"""The telemetry store: one SQLite file per reservation (``.monarch/telemetry.db``), and the SQL that reads it.

Standard library only, so ``monarch sql`` starts in a few tens of milliseconds. Outside code imports
from here, never from the modules:

- :mod:`.schema`: the tables (:data:`TABLES`), the file's place (:func:`db_path`), opening it to write;
- :mod:`.writer`: :class:`TelemetryWriter`, one run's rows from a background thread, and :func:`end_lost_run`;
- :mod:`.reader`: read-only connections and bounded queries (:func:`query`, :func:`query_bounded`);
- :mod:`.queries`: the named statements behind ``top``/``stack``/``diagnose`` and the dashboard.
"""

from __future__ import annotations

from ..errors import StoreError
from .queries import QUERIES, numbers, rows, sql
from .reader import DEFAULT_MAX_ROWS, DEFAULT_TIMEOUT, connect_readonly, query, query_bounded
from .schema import (
    DB_NAME,
    EXAMPLES,
    KEEP_RUNS,
    MAX_LINE_CHARS,
    MAX_LINES,
    SCHEMA_VERSION,
    TABLES,
    _connect_rw,
    db_path,
    schema_json,
    schema_text,
)
from .writer import MAX_QUEUED_BYTES, TelemetryWriter, end_lost_run

__all__ = [
    "DB_NAME",
    "DEFAULT_MAX_ROWS",
    "DEFAULT_TIMEOUT",
    "EXAMPLES",
    "KEEP_RUNS",
    "MAX_LINES",
    "MAX_LINE_CHARS",
    "MAX_QUEUED_BYTES",
    "QUERIES",
    "SCHEMA_VERSION",
    "TABLES",
    "StoreError",
    "TelemetryWriter",
    "_connect_rw",
    "connect_readonly",
    "db_path",
    "end_lost_run",
    "numbers",
    "query",
    "query_bounded",
    "rows",
    "schema_json",
    "schema_text",
    "sql",
]
