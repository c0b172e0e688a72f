"""The telemetry store: one SQLite file per reservation (``.monarch/telemetry.db``).

Standard library only, so ``monarch sql`` starts in a few tens of milliseconds. The file is
in WAL mode: a run writes through one :class:`TelemetryWriter` (a thread that batches rows,
so the run never waits on the disk) while any other process reads it with
:func:`query` over a read-only connection. Retention is by run: the oldest runs past
:data:`KEEP_RUNS` are deleted, with all their rows, when a new run starts.
"""

from __future__ import annotations

import collections
import itertools
import os
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from .config import EnvSettings, env
from .errors import StoreError

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
    from .sysutil import check_private

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


def _line_text(raw: bytes) -> str:
    text = raw[: MAX_LINE_CHARS + 1].rstrip(b"\r").decode("utf-8", "backslashreplace")
    return text if len(raw) <= MAX_LINE_CHARS else text[:MAX_LINE_CHARS] + "…"


#: Output rows a writer's transaction holds before it inserts them (it commits once per round).
_LOG_ROWS_AT_ONCE = 2048
#: Queued items one transaction takes at most: under a flood the queue never empties, and a round
#: that ran until it did never committed (the run's telemetry was lost).
_ITEMS_PER_TRANSACTION = 20_000
_SECONDS_PER_TRANSACTION = 0.5  # (and at most this long: a round of big chunks is seconds of work)
#: Output bytes waiting for the writer, at most; beyond, output is left to the run's log (counted).
MAX_QUEUED_BYTES = 64 << 20
_INSERT_LOGS = "INSERT INTO logs VALUES (?,?,?,?,?)"


class TelemetryWriter:
    """Writes one run's rows from a background thread, a batch (one transaction) at a time.

    Every method only appends to a queue, so the caller (the run's event loop) never waits
    on SQLite. A failure inside the thread disables telemetry for the run, with one warning;
    it never fails the run.
    """

    def __init__(
        self,
        path: Path,
        run_id: str,
        *,
        keep_runs: int = KEEP_RUNS,
        start: bool = True,
        max_lines: int | None = None,
    ) -> None:
        """``start=False``: rows queue up until :meth:`start` (or :meth:`close`) starts the thread.
        ``max_lines``: lines kept for the run (default ``$MONARCH_TELEMETRY_LINES``, else
        :data:`MAX_LINES`): the first half as they come, the last half when the run ends."""
        self.path = Path(path)
        self.run_id = run_id
        self.keep_runs = keep_runs
        if max_lines is None:
            max_lines = env.telemetry_lines
        self._head_left = max(0, max_lines) - max(0, max_lines) // 2
        self._tail_budget = max(0, max_lines) // 2  # shared by the ranks: each keeps its own last lines
        self._tails: dict[int, collections.deque[tuple[Any, ...]]] = {}
        self._rank_count = 1
        self.lines_left_out = 0
        self.bytes_left_out = 0  # output not queued: the writer was MAX_QUEUED_BYTES behind
        self._queued_bytes = 0
        self._bytes_lock = threading.Lock()
        self._queue: collections.deque[tuple[str, Any]] = collections.deque()
        self._wake = threading.Event()
        self._closing = False
        self._committed = threading.Event()  # set once everything queued before close() is committed
        self._partial: dict[tuple[int, int], bytes] = {}
        self.error: str | None = None
        self._thread = threading.Thread(target=self._loop, name="monarch-telemetry", daemon=True)
        self._starting = threading.Lock()
        if start:
            self.start()

    def start(self) -> None:
        """Start writing (opening the store, pruning old runs): a run calls it once its ranks are
        launched, so that this thread's work does not delay the launch."""
        with self._starting:
            if self._thread.ident is None:
                self._thread.start()

    # ------------------------------------------------------------ producers
    def sql(self, statement: str, params: Sequence[Any]) -> None:
        self._queue.append(("sql", (statement, params)))

    def output(self, rank: int, stream: int, data: bytes) -> None:
        if self.error is not None:
            return
        with self._bytes_lock:
            if self._queued_bytes + len(data) > MAX_QUEUED_BYTES:
                self.bytes_left_out += len(data)
                return
            self._queued_bytes += len(data)
        self._queue.append(("out", (rank, stream, time.time(), data)))

    def rows(self, table: str, rows: Iterable[Sequence[Any]]) -> None:
        """Queue rows for ``table``. A generator is consumed by the writer thread as it inserts
        them, never held as a list: a 32,768-rank run's ``ranks`` rows were 5 MB of tuples at the
        client's peak, queued while its links were busiest."""
        if self.error is not None:
            return
        it = iter(rows)
        first = next(it, None)
        if first is not None:
            self._queue.append(("rows", (table, len(first), itertools.chain((first,), it))))
            self._wake.set()

    def event(self, kind: str, rank: int | None = None, detail: str = "") -> None:
        self.rows("events", [(self.run_id, time.time(), rank, kind, detail)])

    def flush(self, timeout: float = 10.0) -> None:
        """Wait until everything queued so far is committed."""
        self.start()
        done = threading.Event()
        self._queue.append(("flush", done))
        self._wake.set()
        done.wait(timeout)

    def close(self, timeout: float = 10.0) -> None:
        """Returns once every row is committed; the connection closes (and checkpoints) in the background."""
        self.start()
        self._closing = True
        self._wake.set()
        self._committed.wait(timeout)

    # --------------------------------------------------------------- thread
    def _loop(self) -> None:
        import sqlite3

        try:
            conn = _connect_rw(self.path)
            self._prune(conn)
        except (sqlite3.Error, OSError) as e:
            self._fail(e)
            return
        try:
            self._serve(conn)
        finally:
            self._queue.clear()
            self._committed.set()
            conn.close()

    def _serve(self, conn: sqlite3.Connection) -> None:
        import sqlite3

        while True:
            if not self._queue:  # (a round that stopped at its bound goes on at once)
                self._wake.wait(0.25)
                self._wake.clear()
            closing = self._closing  # read after the wake: close() sets it, then wakes us
            if self._queue or (closing and self._tails):
                try:
                    self._write(conn)
                except (sqlite3.Error, OSError, ValueError) as e:
                    self._fail(e)
                    return
            if closing and not self._queue:
                return

    def _write(self, conn: sqlite3.Connection) -> None:
        logs: list[tuple[Any, ...]] = []
        last: dict[int, tuple[float, int]] = {}
        waiters = []
        conn.execute("BEGIN")
        taken, until = 0, time.monotonic() + _SECONDS_PER_TRANSACTION
        while self._queue and taken < _ITEMS_PER_TRANSACTION and time.monotonic() < until:
            taken += 1
            kind, item = self._queue.popleft()
            if kind == "out":
                rank, stream, ts, data = item
                with self._bytes_lock:
                    self._queued_bytes -= len(data)
                buf = self._partial.pop((rank, stream), b"") + data
                *lines, rest = buf.split(b"\n")
                if rest:  # no newline yet: keep only what a stored line can hold (and one more byte)
                    self._partial[(rank, stream)] = rest[: MAX_LINE_CHARS + 1]
                name = "stdout" if stream == 1 else "stderr"
                for raw in lines:
                    self._keep(logs, (self.run_id, rank, ts, name, _line_text(raw)))
                if lines:
                    n = last.get(rank, (0.0, 0))[1]
                    last[rank] = (ts, n + len(lines))
                if len(logs) >= _LOG_ROWS_AT_ONCE:  # (32,768 ranks' first lines held at once were ~10 MB)
                    conn.executemany(_INSERT_LOGS, logs)
                    logs.clear()
            elif kind == "end_rank":
                rank, ts = item
                for stream in (1, 2):
                    rest = self._partial.pop((rank, stream), b"")
                    if rest:
                        self._keep(
                            logs, (self.run_id, rank, ts, "stdout" if stream == 1 else "stderr", _line_text(rest))
                        )
                        last[rank] = (ts, last.get(rank, (0.0, 0))[1] + 1)
            elif kind == "sql":
                statement, params = item
                # A run of the same statement (a rank's end, per rank: 32,768 at 4,096 hosts) is one executemany.
                many = [params]
                queue = self._queue
                while queue and queue[0][0] == "sql" and queue[0][1][0] == statement:
                    many.append(queue.popleft()[1][1])
                if len(many) == 1:
                    conn.execute(statement, params)
                else:
                    conn.executemany(statement, many)
            elif kind == "rows":
                table, width, rows = item
                marks = ",".join("?" * width)
                conn.executemany(f"INSERT INTO {table} VALUES ({marks})", rows)
            elif kind == "flush":
                waiters.append(item)
        if self._closing and not self._queue and self._tails:  # the ranks' last lines, once the run is over
            logs.extend(sorted((row for tail in self._tails.values() for row in tail), key=lambda row: row[2]))
            self._tails.clear()
            if self.lines_left_out:
                conn.execute(
                    "INSERT INTO events VALUES (?,?,?,?,?)",
                    (
                        self.run_id,
                        time.time(),
                        None,
                        "lines_left_out",
                        f"{self.lines_left_out} lines in the rank logs only",
                    ),
                )
            if self.bytes_left_out:
                conn.execute(
                    "INSERT INTO events VALUES (?,?,?,?,?)",
                    (
                        self.run_id,
                        time.time(),
                        None,
                        "output_left_out",
                        f"{self.bytes_left_out} bytes of output in the rank logs only: the store fell behind",
                    ),
                )
        if logs:
            conn.executemany(_INSERT_LOGS, logs)
        for rank, (ts, n) in last.items():
            conn.execute(
                "UPDATE ranks SET last_output_at = ?, lines = coalesce(lines, 0) + ? WHERE run_id = ? AND rank = ?",
                (ts, n, self.run_id, rank),
            )
        conn.execute("COMMIT")
        for w in waiters:
            w.set()

    def set_rank_count(self, n: int) -> None:
        """How many ranks share the tail budget (before their output arrives)."""
        self._rank_count = max(1, n)

    def _keep(self, logs: list[tuple[Any, ...]], row: tuple[Any, ...]) -> None:
        """The run's first lines go in now; later ones wait in their rank's bounded tail (the oldest dropped)."""
        if self._head_left > 0:
            self._head_left -= 1
            logs.append(row)
            return
        tail = self._tails.get(row[1])
        if tail is None:
            size = self._tail_budget // self._rank_count
            if not size:  # more ranks than the tail budget: none keeps a tail (no empty deque per
                self.lines_left_out += 1  # rank: 22,768 of them were 14 MB of a 4,096 x 8 run's client)
                return
            tail = self._tails[row[1]] = collections.deque(maxlen=size)
        if len(tail) == tail.maxlen:
            self.lines_left_out += 1  # the oldest of the tail drops out
        tail.append(row)

    def end_of_rank(self, rank: int) -> None:
        """The rank's output is complete: store an unterminated last line."""
        self._queue.append(("end_rank", (rank, time.time())))

    def _prune(self, conn: sqlite3.Connection) -> None:
        """Retention by run: delete the oldest runs past ``keep_runs`` (this one not yet inserted)."""
        (count,) = conn.execute("SELECT count(*) FROM runs").fetchone()
        if count < self.keep_runs:
            return
        old = [
            r
            for (r,) in conn.execute(
                "SELECT run_id FROM runs ORDER BY run_id DESC LIMIT -1 OFFSET ?", (max(self.keep_runs - 1, 0),)
            )
        ]
        conn.execute("BEGIN IMMEDIATE")
        for table in TABLES:
            conn.executemany(f"DELETE FROM {table} WHERE run_id = ?", [(r,) for r in old])
        conn.execute("COMMIT")

    def _fail(self, e: BaseException) -> None:
        import sys

        self.error = f"{type(e).__name__}: {e}"
        for kind, item in list(self._queue):
            if kind == "flush":
                item.set()
        self._queue.clear()
        self._committed.set()
        print(f"monarch: telemetry disabled for this run ({self.error})", file=sys.stderr, flush=True)


def end_lost_run(path: Path, run_id: str, why: str, now: float) -> None:
    """End a run whose client died (it never wrote its end): the run, and each rank without an
    exit as lost (status 255), with a ``run_lost`` event. Does nothing to a run that has ended."""
    import sqlite3

    try:
        conn = _connect_rw(Path(path))
    except (OSError, sqlite3.Error) as e:
        raise StoreError(f"telemetry store {path}: {e}") from None
    try:
        conn.execute("BEGIN IMMEDIATE")
        ended = conn.execute("UPDATE runs SET ended_at = ? WHERE run_id = ? AND ended_at IS NULL", (now, run_id))
        if ended.rowcount:
            conn.execute(
                "UPDATE ranks SET status = 255, how = ?, ended_at = ? WHERE run_id = ? AND ended_at IS NULL",
                (f"lost: {why}", now, run_id),
            )
            conn.execute("INSERT INTO events VALUES (?, ?, NULL, 'run_lost', ?)", (run_id, now, why))
        conn.execute("COMMIT")
    except sqlite3.Error as e:
        raise StoreError(f"telemetry store {path}: {e}") from None
    finally:
        conn.close()
