"""Writing the telemetry store: one run's rows, from a background thread.

A run writes through one :class:`TelemetryWriter` (a thread that batches rows, so the run never
waits on the disk) while any other process reads the file (WAL mode). Retention is by run: the
oldest runs past :data:`KEEP_RUNS` are deleted, with all their rows, when a new run starts.
"""

from __future__ import annotations

import collections
import itertools
import threading
import time
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..config import env
from ..errors import StoreError
from .schema import KEEP_RUNS, MAX_LINE_CHARS, TABLES, _connect_rw

if TYPE_CHECKING:
    import sqlite3


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
