"""The SQL behind every view of the telemetry store, in one place.

``monarch top``, ``stack``, ``diagnose`` and ``monarch dashboard`` (its pages and its REST API) all run
these statements through :func:`monarch_cli.telemetry.query`, so what a page shows is exactly what
``monarch sql`` gives for the same statement (``GET /api/queries`` lists them, with their parameters).
Standard library only, like the store.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from .reader import query

#: name -> (what it answers, statement). Parameters are positional (``?``), in the order the text names them.
QUERIES: dict[str, tuple[str, str]] = {
    "latest_run": ("the newest run", "SELECT * FROM runs ORDER BY run_id DESC LIMIT 1"),
    "run": ("one run (run_id)", "SELECT * FROM runs WHERE run_id = ?"),
    "runs": (
        "the newest runs with their failed-rank count (limit)",
        "SELECT run_id, command, started_at, ended_at, exit_code, world_size, hosts, restarts, interrupted, "
        "ended_at - started_at AS seconds, "
        "(SELECT count(*) FROM ranks r WHERE r.run_id = runs.run_id AND r.status != 0) AS failed "
        "FROM runs ORDER BY run_id DESC LIMIT ?",
    ),
    "rank_states": ("each rank's host and how it ended (run_id)", "SELECT rank, host, how FROM ranks WHERE run_id = ?"),
    "exit_table": (
        "every rank of a run: where it ran and how it ended (run_id)",
        "SELECT rank, local_rank, node, host, pid, exit_code, signal, status, how, started_at, ended_at, "
        "last_output_at, lines FROM ranks WHERE run_id = ? ORDER BY rank",
    ),
    "rank_endings": (
        "ranks in the order they ended (run_id)",
        "SELECT rank, host, how, status, ended_at FROM ranks WHERE run_id = ? ORDER BY ended_at, rank",
    ),
    "events": (
        "what happened to a run (run_id)",
        "SELECT ts, rank, kind, detail FROM events WHERE run_id = ? ORDER BY ts",
    ),
    "hosts": (
        "the hosts a run used (run_id)",
        "SELECT node, host, agent, agent_pid, cpus, gpus FROM hosts WHERE run_id = ? ORDER BY node",
    ),
    "last_output_at": (
        "each rank's newest output time (run_id)",
        "SELECT rank, max(ts) AS ts FROM logs WHERE run_id = ? GROUP BY rank",
    ),
    "last_line": (
        "each rank's last non-empty line (run_id)",
        "SELECT l.rank, l.line FROM logs l JOIN (SELECT rank, max(rowid) AS id FROM logs "
        "WHERE run_id = ? AND line != '' GROUP BY rank) m ON l.rowid = m.id",
    ),
    "last_step": (
        "each rank's newest step and its time (run_id)",
        "SELECT rank, max(step) AS step, (SELECT dt_ms FROM steps s2 WHERE s2.run_id = s.run_id AND "
        "s2.rank = s.rank ORDER BY step DESC LIMIT 1) AS dt FROM steps s WHERE run_id = ? GROUP BY rank",
    ),
    "last_sample": (
        "each rank's newest sample (run_id)",
        "SELECT s.rank, s.host, s.ts, s.state, s.cpu_percent, s.rss_mb, s.gpu_util, s.gpu_mem_mb FROM samples s JOIN "
        "(SELECT max(rowid) AS id FROM samples WHERE run_id = ? GROUP BY rank) m ON s.rowid = m.id",
    ),
    "tail": (
        "a rank's last 10 non-empty lines, newest first (run_id, rank)",
        "SELECT stream, line FROM logs WHERE run_id = ? AND rank = ? AND line != '' ORDER BY rowid DESC LIMIT 10",
    ),
    "logs_after": (
        "output lines after a cursor, oldest first; ranks a JSON list or NULL, text a substring or NULL "
        "(run_id, after, ranks, ranks, text, text, limit)",
        "SELECT rowid AS id, rank, ts, stream, line FROM logs WHERE run_id = ? AND rowid > ? "
        "AND (? IS NULL OR rank IN (SELECT value FROM json_each(?))) AND (? IS NULL OR instr(lower(line), lower(?)) > 0) "
        "ORDER BY rowid LIMIT ?",
    ),
    "logs_before": (
        "output lines before a cursor, newest first (run_id, before, ranks, ranks, text, text, limit)",
        "SELECT rowid AS id, rank, ts, stream, line FROM logs WHERE run_id = ? AND rowid < ? "
        "AND (? IS NULL OR rank IN (SELECT value FROM json_each(?))) AND (? IS NULL OR instr(lower(line), lower(?)) > 0) "
        "ORDER BY rowid DESC LIMIT ?",
    ),
    "samples_after": (
        "process samples after a cursor, oldest first (run_id, after, limit)",
        "SELECT rowid AS id, rank, ts, cpu_percent, rss_mb, gpu_util, gpu_mem_mb FROM samples "
        "WHERE run_id = ? AND rowid > ? ORDER BY rowid LIMIT ?",
    ),
    "steps_after": (
        "optimizer steps after a cursor, oldest first (run_id, after, limit)",
        "SELECT rowid AS id, rank, step, ts, dt_ms FROM steps WHERE run_id = ? AND rowid > ? ORDER BY rowid LIMIT ?",
    ),
    "numbers_after": (
        "output lines that may hold key=value numbers, after a cursor, oldest first (run_id, after, limit)",
        "SELECT rowid AS id, rank, ts, line FROM logs WHERE run_id = ? AND rowid > ? AND line LIKE '%=%' "
        "ORDER BY rowid LIMIT ?",
    ),
    "latest_capture": (
        "the newest stored stack capture of a run, one row per thread (run_id)",
        "SELECT capture_id, rank, host, pid, ts, method, thread, is_main, stack, error FROM stacks "
        "WHERE capture_id = (SELECT capture_id FROM stacks WHERE run_id = ? ORDER BY ts DESC LIMIT 1) "
        "ORDER BY rank, is_main DESC",
    ),
    "cursors": (
        "the newest row of each growing table (no parameters): what changed since last time",
        "SELECT (SELECT max(rowid) FROM logs) AS logs, (SELECT max(rowid) FROM samples) AS samples, "
        "(SELECT max(rowid) FROM steps) AS steps, (SELECT max(run_id) FROM runs) AS run, "
        "(SELECT count(*) FROM runs WHERE ended_at IS NULL) AS open_runs, (SELECT max(rowid) FROM events) AS events, "
        "(SELECT max(ts) FROM stacks) AS stacks",
    ),
}


def rows(db: Path, name: str, params: Sequence[Any] = ()) -> list[dict[str, Any]]:
    """The named statement's rows as dicts; errors are :class:`~monarch_cli.errors.StoreError`."""
    cols, found = query(db, QUERIES[name][1], params)
    return [dict(zip(cols, r)) for r in found]


def sql(name: str) -> str:
    return QUERIES[name][1]


#: ``loss=0.25``, ``lr=3e-4``, ``acc=97.5%``: a name, ``=``, a number (what a training script prints).
_NUMBER = re.compile(
    r"(?<![\w./=-])([A-Za-z_][A-Za-z0-9_./-]{0,63})=\s*(-?(?:\d+\.?\d*|\.\d+)(?:[eE][-+]?\d+)?)(?![\w.])"
)


def numbers(line: str) -> list[tuple[str, float]]:
    """The ``key=value`` numbers in one output line (``step=3 loss=0.25`` -> [("step", 3.0), ("loss", 0.25)])."""
    return [(k, float(v)) for k, v in _NUMBER.findall(line)]
