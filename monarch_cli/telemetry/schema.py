"""The telemetry store's shape: its tables, where its file is, and opening it for writing.

One SQLite file per reservation (``.monarch/telemetry.db``). :data:`TABLES` is the one description
of the tables: the DDL and ``monarch sql --schema`` both come from it. Standard library only, so
``monarch sql`` starts in a few tens of milliseconds.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..config import EnvSettings, env

if TYPE_CHECKING:
    import sqlite3  # imported where used: a run's client loads it in the writer thread, off its path

DB_NAME = "telemetry.db"
SCHEMA_VERSION = 1
#: Runs kept per reservation ($MONARCH_TELEMETRY_RUNS overrides).
KEEP_RUNS = env.telemetry_runs  # read once, at import
#: Output lines the store keeps per run: the first half and the last half of that many (the rank
#: logs keep everything). ``$MONARCH_TELEMETRY_LINES`` changes it.
MAX_LINES: int = EnvSettings.telemetry_lines.default
MAX_LINE_CHARS = 4096  # a longer line is stored cut, with "…" (a rank printing without newlines)

#: table -> (what it holds, [(column, type, meaning)]). The DDL and `monarch sql --schema` both come from here.
TABLES: dict[str, tuple[str, list[tuple[str, str, str]]]] = {
    "runs": (
        "one row per `run-spmd` run",
        [
            ("run_id", "TEXT PRIMARY KEY", "run id, sortable by start time (also the log directory's name)"),
            ("command", "TEXT", "the command line, shell-quoted"),
            ("started_at", "REAL", "unix time the run started"),
            ("ended_at", "REAL", "unix time it ended (or was found lost: its client died); NULL while it runs"),
            (
                "exit_code",
                "INTEGER",
                "the run's exit status (the first failing rank's; 128+N for signal N); NULL if its client died",
            ),
            ("world_size", "INTEGER", "number of ranks"),
            ("hosts", "INTEGER", "number of hosts used"),
            ("restarts", "INTEGER", "torchrun --max-restarts attempts used"),
            ("interrupted", "INTEGER", "1 if Ctrl-C (or a forwarded signal) stopped it"),
            ("log_dir", "TEXT", "where the raw per-rank logs are"),
        ],
    ),
    "ranks": (
        "one row per rank of a run (its last attempt)",
        [
            ("run_id", "TEXT", "run id"),
            ("rank", "INTEGER", "global rank"),
            ("local_rank", "INTEGER", "rank on its host"),
            ("node", "INTEGER", "host index (GROUP_RANK)"),
            ("host", "TEXT", "host name"),
            ("pid", "INTEGER", "process id on its host (set once it exits)"),
            ("exit_code", "INTEGER", "exit code; NULL if killed by a signal or still running"),
            ("signal", "INTEGER", "signal that killed it, else NULL"),
            ("status", "INTEGER", "shell-style status: 0 ok, N exit code, 128+N signal, 255 host lost"),
            ("how", "TEXT", "'exit 0', 'killed by SIGKILL', 'lost: ...'"),
            ("started_at", "REAL", "unix time it was started"),
            ("ended_at", "REAL", "unix time its exit was reported; NULL while it runs"),
            ("last_output_at", "REAL", "unix time of its last output line"),
            ("lines", "INTEGER", "output lines so far"),
        ],
    ),
    "logs": (
        f"output lines of every rank: per run the first and the last {EnvSettings.telemetry_lines.var}/2 (default 10000 each); the rank logs keep all",
        [
            ("run_id", "TEXT", "run id"),
            ("rank", "INTEGER", "rank"),
            ("ts", "REAL", "unix time the controller received it"),
            ("stream", "TEXT", "'stdout' or 'stderr'"),
            ("line", "TEXT", "the line, without its line end (invalid UTF-8 backslash-escaped)"),
        ],
    ),
    "hosts": (
        "the hosts a run used",
        [
            ("run_id", "TEXT", "run id"),
            ("node", "INTEGER", "host index"),
            ("host", "TEXT", "host name"),
            ("agent", "TEXT", "the host agent's address"),
            ("agent_pid", "INTEGER", "the host agent's process id"),
            ("cpus", "INTEGER", "CPUs on the host"),
            ("gpus", "INTEGER", "NVIDIA GPUs visible on the host"),
        ],
    ),
    "events": (
        "what happened to a run, in order",
        [
            ("run_id", "TEXT", "run id"),
            ("ts", "REAL", "unix time"),
            ("rank", "INTEGER", "the rank concerned, or NULL"),
            (
                "kind",
                "TEXT",
                "run_start, rank_failed, rank_lost, restart, interrupt, run_end, run_lost (its client died)",
            ),
            ("detail", "TEXT", "free text"),
        ],
    ),
    "samples": (
        "each live rank's process, sampled by its host agent about once a second",
        [
            ("run_id", "TEXT", "run id"),
            ("rank", "INTEGER", "rank"),
            ("host", "TEXT", "host name"),
            ("ts", "REAL", "unix time of the sample (the host's clock)"),
            ("pid", "INTEGER", "process id"),
            ("state", "TEXT", "process state: running, sleeping, disk-sleep, stopped, zombie..."),
            ("cpu_percent", "REAL", "CPU use since the previous sample (100 = one core)"),
            ("rss_mb", "REAL", "resident memory, MiB"),
            ("threads", "INTEGER", "OS threads"),
            ("gpu_index", "INTEGER", "GPU the rank's process uses (NVML); NULL without a GPU"),
            ("gpu_util", "REAL", "that GPU's utilisation, percent; NULL without a GPU"),
            ("gpu_mem_mb", "REAL", "GPU memory the process uses, MiB; NULL without a GPU"),
            ("gpu_power_w", "REAL", "that GPU's power draw, watts; NULL without a GPU"),
            ("gpu_temp_c", "REAL", "that GPU's temperature, Celsius; NULL without a GPU"),
        ],
    ),
    "steps": (
        "optimizer steps, from a hook monarch installs in every rank (no change to your code)",
        [
            ("run_id", "TEXT", "run id"),
            ("rank", "INTEGER", "rank"),
            ("step", "INTEGER", "1 for the first optimizer.step() of the run, then 2, 3..."),
            (
                "ts",
                "REAL",
                "unix time the step ended (the host's clock when the rank started, plus monotonic time since)",
            ),
            ("dt_ms", "REAL", "milliseconds since the previous step ended (since the hook was installed for step 1)"),
        ],
    ),
    "stacks": (
        "stacks captured by `monarch stack` / `monarch diagnose`, one row per thread",
        [
            ("capture_id", "TEXT", "one id per capture command"),
            ("run_id", "TEXT", "run id"),
            ("rank", "INTEGER", "rank"),
            ("host", "TEXT", "host name"),
            ("pid", "INTEGER", "process id"),
            ("ts", "REAL", "unix time of the capture"),
            ("method", "TEXT", "'py-spy' or 'faulthandler' (the interpreter's own dump, when py-spy cannot attach)"),
            ("thread", "TEXT", "thread name (py-spy) or id"),
            ("is_main", "INTEGER", "1 for the main thread"),
            ("stack", "TEXT", "frames, innermost first, one 'function (file:line)' per line"),
            ("error", "TEXT", "why no stack was captured, else NULL"),
        ],
    ),
}

_INDEXES = [
    "CREATE INDEX IF NOT EXISTS logs_run_rank ON logs(run_id, rank, ts)",
    "CREATE INDEX IF NOT EXISTS samples_run_rank ON samples(run_id, rank, ts)",
    "CREATE INDEX IF NOT EXISTS steps_run_rank ON steps(run_id, rank, step)",
    "CREATE INDEX IF NOT EXISTS events_run ON events(run_id, ts)",
    "CREATE INDEX IF NOT EXISTS stacks_run ON stacks(run_id, capture_id)",
]
_KEYS = {"ranks": "PRIMARY KEY (run_id, rank)", "hosts": "PRIMARY KEY (run_id, node)"}

EXAMPLES: list[tuple[str, str]] = [
    (
        "the last 5 runs",
        "SELECT run_id, exit_code, ended_at - started_at AS seconds, command FROM runs ORDER BY started_at DESC LIMIT 5",
    ),
    (
        "how each rank of the latest run ended",
        "SELECT rank, host, how, last_output_at FROM ranks WHERE run_id = (SELECT max(run_id) FROM runs) ORDER BY rank",
    ),
    (
        "the last lines of the first rank that failed",
        "SELECT rank, line FROM logs WHERE run_id = (SELECT max(run_id) FROM runs) AND rank = (SELECT rank FROM ranks WHERE run_id = logs.run_id AND status != 0 ORDER BY ended_at LIMIT 1) ORDER BY ts DESC LIMIT 20",
    ),
    (
        "step time per rank (slowest first)",
        "SELECT rank, count(*) AS steps, avg(dt_ms) AS mean_ms, max(dt_ms) AS worst_ms FROM steps WHERE run_id = (SELECT max(run_id) FROM runs) AND step > 1 GROUP BY rank ORDER BY mean_ms DESC",
    ),
    (
        "peak memory per rank",
        "SELECT rank, max(rss_mb), max(gpu_mem_mb) FROM samples WHERE run_id = (SELECT max(run_id) FROM runs) GROUP BY rank",
    ),
    ("grep every run's output", "SELECT run_id, rank, line FROM logs WHERE line LIKE '%NCCL%' ORDER BY ts"),
]


def db_path(state_dir: Path) -> Path:
    return Path(state_dir) / DB_NAME


def _ddl() -> list[str]:
    out = []
    for table, (_, cols) in TABLES.items():
        parts = [f"{name} {kind}" for name, kind, _ in cols]
        if table in _KEYS:
            parts.append(_KEYS[table])
        out.append(f"CREATE TABLE IF NOT EXISTS {table} ({', '.join(parts)})")
    return out + _INDEXES


def _check_ours(path: Path) -> None:
    """A store (or its -wal/-shm) someone else made or can write is refused: they would read every rank's output."""
    from ..sysutil import check_private

    for p in (path, path.with_name(path.name + "-wal"), path.with_name(path.name + "-shm")):
        check_private(p)


def _connect_rw(path: Path) -> sqlite3.Connection:
    import sqlite3

    path.parent.mkdir(parents=True, exist_ok=True)
    if not path.exists():
        # Rows hold output lines: never world-readable (-wal and -shm take this mode too). Only a
        # file nobody has open yet may be opened and closed here: closing any descriptor of a
        # database file drops every POSIX lock this process holds on it.
        try:
            os.close(os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600))
        except FileExistsError:
            pass
    _check_ours(path)
    conn = sqlite3.connect(str(path), timeout=10.0, isolation_level=None, check_same_thread=False)
    conn.execute("PRAGMA journal_mode=WAL")
    conn.execute("PRAGMA synchronous=NORMAL")  # WAL + NORMAL: no fsync per commit, still crash-consistent
    if conn.execute("PRAGMA user_version").fetchone()[0] != SCHEMA_VERSION:
        conn.execute("BEGIN IMMEDIATE")
        for stmt in _ddl():
            conn.execute(stmt)
        conn.execute(f"PRAGMA user_version={SCHEMA_VERSION}")
        conn.execute("COMMIT")
    return conn


def schema_text() -> str:
    """The tables, their columns, what they mean, and example queries: for a person or a coding agent."""
    lines = [
        f"Telemetry store (SQLite, read-only here). Times are unix seconds; the latest run is "
        f"(SELECT max(run_id) FROM runs). Kept: the last {KEEP_RUNS} runs.",
        "",
    ]
    for table, (what, cols) in TABLES.items():
        lines.append(f"{table}: {what}")
        for name, kind, meaning in cols:
            lines.append(f"  {name:<15} {kind.split()[0]:<8} {meaning}")
        lines.append("")
    lines.append("Examples:")
    for what, sql in EXAMPLES:
        lines += [f"  -- {what}", f"  {sql};"]
    return "\n".join(lines)


def schema_json() -> dict[str, Any]:
    return {
        "tables": {
            t: {"description": what, "columns": [{"name": n, "type": k.split()[0], "meaning": m} for n, k, m in cols]}
            for t, (what, cols) in TABLES.items()
        },
        "examples": [{"description": what, "sql": sql} for what, sql in EXAMPLES],
        "keep_runs": KEEP_RUNS,
    }
