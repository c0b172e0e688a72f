"""Where rank output goes: prefixed whole lines on the console, raw bytes in the run's log.

The console gets one ``[rankN]``-prefixed segment per line (a ``\\r`` ends a segment too,
so progress bars redraw in place); bytes are written as they came, so invalid UTF-8 is
kept. The run's log (``output.log``, one file for all ranks: :mod:`.run_log`, which splits
it into ``rankN.log`` files when they are first read) is written as output comes
(``monarch logs -f`` reads it while the run goes on) and gets exactly what each rank wrote,
nothing added, a segment at a time: stdout and stderr arrive through separate pipes, so an
unfinished line of one stream is held back until it ends rather than having the other
stream's lines written into its middle.

Every byte is looked at a bounded number of times, whatever the shape of the output: only
the new chunk is searched for line ends, never the held-back part, and a line longer than
:data:`MAX_HELD_LINE` is not held whole: what has come of it goes to the log and, wrapped, to
the console, so a 10 MB line with no newline costs memory of one chunk, not of the line.

Logs are private (files 0600 in 0700 directories): ranks print tokens and paths. Only the
last ``MONARCH_KEEP_RUNS`` runs (default 20) are kept; older run directories are removed
when a new run starts.
"""

from __future__ import annotations

import os
import queue
import re
import shutil
import sys
import threading
from pathlib import Path
from typing import BinaryIO

from ..config import EnvSettings, env
from . import run_log
from .output_groups import LineGrouper, grouping_wanted

_COLORS = [36, 33, 32, 35, 34, 31, 96, 93, 92, 95, 94, 91]
_SEGMENT = re.compile(rb"[^\r\n]*(?:\r\n|\n|\r)")
_TAIL_LINES = 5
#: A tail line (failure table, ``--json``'s ``last_lines``) is cut to this many characters.
TAIL_WIDTH = 200
_TAIL_BYTES = 4 * TAIL_WIDTH  # enough bytes for TAIL_WIDTH characters of UTF-8
_TAIL_SCAN = 64  # segments looked at, from the end of a chunk, to find non-blank tail lines
#: An unfinished line held back longer than this is written out (logged, shown wrapped).
MAX_HELD_LINE = 1 << 20
#: Runs whose logs are kept when ``MONARCH_KEEP_RUNS`` is not set.
DEFAULT_KEEP_RUNS: int = EnvSettings.keep_runs.default
_LOG_BATCH = 1 << 20  # bytes of records the log thread joins into one write
#: Bytes of output queued for the run's log file, at most (see ``OutputSink._log_room``).
MAX_LOG_QUEUED = 64 << 20
_DIR_MODE = 0o700


class OutputSink:
    def __init__(
        self,
        log_dir: Path,
        labels: dict[int, str],
        *,
        console: set[int] | None = None,
        hidden_streams: dict[int, set[int]] | None = None,
        color: bool | None = None,
        stdout: BinaryIO | None = None,
        stderr: BinaryIO | None = None,
        extra_logs: dict[tuple[int, int], Path] | None = None,
        group: bool | None = None,
        group_noun: str = "rank",
    ) -> None:
        """``console``: ranks shown (None = all); ``hidden_streams``: rank -> streams (1, 2) kept off the console;
        ``group``: print identical lines of several ranks once (None: when many ranks are shown, see
        :mod:`.output_groups`)."""
        self.log_dir = log_dir
        _private_dir(log_dir)
        self.labels = labels
        self.console = console
        self.hidden = hidden_streams or {}
        self.out = stdout or sys.stdout.buffer
        self.err = stderr or sys.stderr.buffer
        use_color = color if color is not None else (self.out.isatty() and not os.environ.get("NO_COLOR"))
        width = max((len(label) for label in labels.values()), default=0)
        self.prefix: dict[int, bytes] = {}
        for rank, label in labels.items():
            text = f"[{label}]".ljust(width + 2) + " "
            if use_color:
                text = f"\x1b[{_COLORS[rank % len(_COLORS)]}m{text}\x1b[0m"
            self.prefix[rank] = text.encode()
        shown = [r for r in labels if console is None or r in console]
        self.grouper: LineGrouper | None = None
        if grouping_wanted(group, len(shown)):
            self.grouper = LineGrouper(self._print, self.prefix, shown, color=use_color, noun=group_noun)
        self.partial: dict[tuple[int, int], bytearray] = {}
        #: Streams whose current line was already written out in part (it was too long to hold).
        self.continued: set[tuple[int, int]] = set()
        #: Each rank's last lines, made at its first line: a list (~100 B), not a deque (760 B), per
        #: rank, 25 MB of a 32,768-rank client.
        self.tails: dict[int, list[str]] = {}
        self._closed = False
        #: The run's log, one file for every rank, its first line naming them (so a silent rank's
        #: file is made when the log is split); written by a thread of its own, started at the
        #: first output, so the thread handling the agents' events never waits on the disk.
        self.log = _open_private(log_dir / run_log.LOG_NAME)
        self.log.write(run_log.header(labels))
        self._log_queue: queue.SimpleQueue[bytes | None] = queue.SimpleQueue()
        #: Bytes queued for the log thread; past MAX_LOG_QUEUED the event thread waits for the disk
        #: (and, through the output credit, so do the ranks) instead of the client's memory growing.
        self._log_queued = 0
        self._log_room = threading.Condition()
        self._log_thread: threading.Thread | None = None
        self._log_error: OSError | None = None
        self.extra: dict[tuple[int, int], BinaryIO] = {}
        for key, path in (extra_logs or {}).items():
            path.parent.mkdir(parents=True, exist_ok=True)
            self.extra[key] = _open_private(path)
        #: Bytes searched for line ends and tail lines, for tests that the cost is linear.
        self.scanned = 0
        self._lock = threading.Lock()

    def write(self, rank: int, stream: int, data: bytes) -> None:
        with self._lock:
            if rank not in self.labels or self._closed:
                return
            extra = self.extra.get((rank, stream))
            if extra is not None:
                extra.write(data)
            key = (rank, stream)
            self.scanned += len(data)
            # Only the new bytes are searched: the held-back part has no line end by construction.
            last = max(data.rfind(b"\n"), data.rfind(b"\r")) + 1
            held = self.partial.get(key)
            if last == 0:
                if held is None:
                    held = self.partial[key] = bytearray()
                held += data
                if len(held) >= MAX_HELD_LINE:
                    self._write_held(rank, stream)
                return
            block = bytes(held) + data[:last] if held else bytes(data[:last])
            self.scanned += len(block)  # copied once, then shown and searched for tail lines
            rest = data[last:]
            if rest:
                self.partial[key] = bytearray(rest)
            else:
                self.partial.pop(key, None)
            self._to_log(rank, stream, block)
            self._emit(rank, stream, block, continued=key in self.continued)
            self.continued.discard(key)
            if len(rest) >= MAX_HELD_LINE:
                self._write_held(rank, stream)

    def end_of_rank(self, rank: int) -> None:
        """The rank exited: show an unterminated last line, and flush its log."""
        with self._lock:
            for stream in (1, 2):
                rest = self.partial.pop((rank, stream), None)
                if rest:
                    if rank in self.labels and not self._closed:
                        self._to_log(rank, stream, bytes(rest))  # as written: no line end added to the log
                    self._emit(rank, stream, bytes(rest) + b"\n", continued=(rank, stream) in self.continued)
                self.continued.discard((rank, stream))
            if self.grouper is not None:
                self.grouper.rank_ended(rank)

    def tail(self, rank: int) -> list[str]:
        """The rank's last few non-blank lines, each at most :data:`TAIL_WIDTH` characters."""
        return list(self.tails.get(rank, ()))

    def close(self) -> None:
        if self.grouper is not None:
            self.grouper.close()
            # The grouper holds our _print: without this the sink (and every rank's tail, 32,768
            # lists at 4,096 hosts) waited for a full collection instead of going with its last reference.
            self.grouper = None
        with self._lock:
            for (rank, stream), rest in self.partial.items():  # ranks that never reported an end
                if rank in self.labels and not self._closed:
                    self._to_log(rank, stream, bytes(rest))
            if self._log_thread is not None:
                self._log_queue.put(None)
                self._log_thread.join()
                self._log_thread = None
            self._closed = True
            self.partial.clear()
            for f in (self.log, *self.extra.values()):
                f.close()
            self.extra.clear()

    def _to_log(self, rank: int, stream: int, data: bytes) -> None:
        """Append to the run's log, from the log thread (lock held)."""
        if self._log_thread is None:
            self._log_thread = threading.Thread(target=self._write_logs, name="monarch-rank-logs", daemon=True)
            self._log_thread.start()
        record = run_log.record(rank, stream, data)
        with self._log_room:
            while self._log_queued > MAX_LOG_QUEUED and self._log_error is None and self._log_thread.is_alive():
                self._log_room.wait(1.0)
            self._log_queued += len(record)
        self._log_queue.put(record)

    def _written(self, size: int) -> None:
        with self._log_room:
            self._log_queued -= size
            self._log_room.notify_all()

    def _write_logs(self) -> None:
        """The log thread: writes records in order, what has queued up meanwhile in one write; None ends."""
        get, get_now = self._log_queue.get, self._log_queue.get_nowait
        while True:
            item = get()
            batch: list[bytes] = []
            size = 0
            while item is not None:
                batch.append(item)
                size += len(item)
                if size >= _LOG_BATCH:
                    break
                try:
                    item = get_now()
                except queue.Empty:
                    break
            if batch:
                self._append(b"".join(batch) if len(batch) > 1 else batch[0])
                self._written(size)
            if item is None:
                return

    def _append(self, data: bytes) -> None:
        view = memoryview(data)
        try:
            while view:
                view = view[self.log.write(view) or 0 :]
        except OSError as e:  # a full disk: say so once, keep the run going
            if self._log_error is None:
                self._log_error = e
                print(f"monarch: cannot write the run's log in {self.log_dir}: {e}", file=sys.stderr, flush=True)

    def _write_held(self, rank: int, stream: int) -> None:
        """Write out a held line grown too long: all of it to the log, a wrapped piece to the console."""
        key = (rank, stream)
        held = self.partial[key]
        cut = _utf8_boundary(held)  # never split a character across two console lines
        piece = bytes(held[:cut])
        del held[:cut]  # at most 3 bytes are left
        self.scanned += len(piece)
        self._to_log(rank, stream, piece)
        first = key not in self.continued
        self.continued.add(key)
        if self._shown(rank, stream):
            if self.grouper is not None:
                self.grouper.add(rank, stream, [piece + b"\n"])
            else:
                self._print(stream, self.prefix[rank] + piece + b"\n")
        if first and piece.strip():
            self._note_tail(rank, _tail_text(piece, cut_short=True))

    def _note_tail(self, rank: int, text: str) -> None:
        tail = self.tails.get(rank)
        if tail is None:
            self.tails[rank] = [text]
            return
        tail.append(text)
        if len(tail) > _TAIL_LINES:
            del tail[0]

    def _shown(self, rank: int, stream: int) -> bool:
        return (self.console is None or rank in self.console) and stream not in self.hidden.get(rank, ())

    def _target(self, stream: int) -> BinaryIO:
        return self.out if stream == 1 else self.err

    def _print(self, stream: int, data: bytes) -> None:
        target = self._target(stream)
        target.write(data)
        target.flush()

    def _emit(self, rank: int, stream: int, block: bytes, continued: bool) -> None:
        """Show ``block`` (whole segments: it ends with a line end) and note its last lines."""
        if self._shown(rank, stream) and self.grouper is not None:
            self.grouper.add(rank, stream, _SEGMENT.findall(block))
        elif self._shown(rank, stream):
            prefix = self.prefix[rank]
            if b"\r" in block:
                shown = prefix + prefix.join(_SEGMENT.findall(block))
            else:  # the usual case: one C-level pass
                shown = prefix + block[:-1].replace(b"\n", b"\n" + prefix) + b"\n"
            self._target(stream).write(shown)
            self._target(stream).flush()
        start = 0
        if continued:  # the first segment ends a line whose start is already in the tail
            start = _first_segment_end(block)
        for line, cut_short in _last_lines(block, start):
            self._note_tail(rank, _tail_text(line, cut_short))


def _first_segment_end(block: bytes) -> int:
    ends = [i for i in (block.find(b"\n"), block.find(b"\r")) if i >= 0]
    i = min(ends)
    if block[i : i + 2] == b"\r\n":
        i += 1
    return i + 1


def _last_lines(block: bytes, start: int) -> list[tuple[bytes, bool]]:
    """Up to the last few non-blank segments of ``block[start:]``, oldest first, each cut
    to a displayable length (with whether it was cut). Work is bounded by the segments
    looked at, not by the block: each search resumes where the last one stopped."""
    found: list[tuple[bytes, bool]] = []
    end = len(block)
    last_lf = last_cr = len(block)  # positions known to be the last of each at or after the stop
    has_cr = b"\r" in block
    looked = 0
    while end > start and len(found) < _TAIL_LINES and looked < _TAIL_SCAN:
        looked += 1
        stop = end - 1  # drop this segment's line end
        if stop > start and block[stop] == 0x0A and block[stop - 1] == 0x0D:
            stop -= 1
        if last_lf >= stop:
            last_lf = block.rfind(b"\n", start, stop)
        if has_cr and last_cr >= stop:
            last_cr = block.rfind(b"\r", start, stop)
        begin = max(last_lf, last_cr if has_cr else -1) + 1
        begin = max(begin, start)
        line = block[begin : min(stop, begin + _TAIL_BYTES)]
        if line.strip():
            found.append((line, stop - begin > _TAIL_BYTES))
        end = begin
    found.reverse()
    return found


def _tail_text(line: bytes, cut_short: bool) -> str:
    text = line[:_TAIL_BYTES].decode("utf-8", "backslashreplace").rstrip("\r\n")
    if cut_short or len(text) > TAIL_WIDTH:
        return text[:TAIL_WIDTH] + "…"
    return text


def _utf8_boundary(data: bytearray) -> int:
    """The largest cut point of ``data`` that does not split a UTF-8 character."""
    n = len(data)
    for back in range(1, min(4, n) + 1):
        byte = data[n - back]
        if byte & 0xC0 == 0x80:  # a continuation byte: its lead byte is further back
            continue
        if byte < 0xC0:  # ASCII, or a stray byte: nothing to keep together
            return n
        need = 2 if byte < 0xE0 else 3 if byte < 0xF0 else 4
        return n - back if need > back else n
    return n


# ---------------------------------------------------------------------- run directories
def keep_runs() -> int:
    """How many runs' logs to keep (``MONARCH_KEEP_RUNS``; 0 keeps every run)."""
    return env.keep_runs


def new_run_dir(logs_root: Path, run_id: str, keep: int | None = None) -> Path:
    """Create ``logs_root/run_id`` (private), removing the oldest runs beyond ``keep`` (counting this one)."""
    keep = keep_runs() if keep is None else keep
    _private_dir(logs_root)
    if keep > 0:
        old = [p for p in list_runs(logs_root) if p.name != run_id]
        for path in old[: max(0, len(old) - (keep - 1))]:
            shutil.rmtree(path, ignore_errors=True)
    run_dir = logs_root / run_id
    _private_dir(run_dir)
    return run_dir


def _private_dir(path: Path) -> None:
    path.mkdir(mode=_DIR_MODE, parents=True, exist_ok=True)
    if path.stat().st_mode & 0o777 != _DIR_MODE:
        os.chmod(path, _DIR_MODE)


def _open_private(path: Path) -> BinaryIO:
    """Open for appending, unbuffered, readable by its owner only (also if it existed)."""
    return open(run_log.open_private(path, os.O_WRONLY | os.O_APPEND), "ab", buffering=0)  # noqa: SIM115


def list_runs(logs_root: Path) -> list[Path]:
    """Runs under ``logs_root``, oldest first."""
    if not logs_root.is_dir():
        return []
    return sorted((p for p in logs_root.iterdir() if p.is_dir()), key=lambda p: p.stat().st_mtime)
