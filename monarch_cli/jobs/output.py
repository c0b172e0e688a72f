"""Where rank output goes: prefixed whole lines on the console, raw bytes in per-rank logs.

The console gets one ``[rankN]``-prefixed segment per line (a ``\\r`` ends a segment too,
so progress bars redraw in place); bytes are written as they came, so invalid UTF-8 is
kept. Log files are unbuffered (``monarch logs -f`` reads them while the run goes on) and
get exactly what the rank wrote, nothing added, a segment at a time: stdout
and stderr arrive through separate pipes, so an unfinished line of one stream is held back
until it ends rather than having the other stream's lines written into its middle.
"""

from __future__ import annotations

import collections
import os
import re
import sys
import threading
from pathlib import Path
from typing import BinaryIO, Deque, Dict, Iterable, List, Optional, Set, Tuple

_COLORS = [36, 33, 32, 35, 34, 31, 96, 93, 92, 95, 94, 91]
_SEGMENT = re.compile(rb"[^\r\n]*(?:\r\n|\n|\r)")
_TAIL_LINES = 5


class OutputSink:
    def __init__(
        self,
        log_dir: Path,
        labels: Dict[int, str],
        *,
        console: Optional[Set[int]] = None,
        hidden_streams: Optional[Dict[int, Set[int]]] = None,
        color: Optional[bool] = None,
        stdout: Optional[BinaryIO] = None,
        stderr: Optional[BinaryIO] = None,
        extra_logs: Optional[Dict[Tuple[int, int], Path]] = None,
    ) -> None:
        """``console``: ranks shown (None = all); ``hidden_streams``: rank -> streams (1, 2) kept off the console."""
        self.log_dir = log_dir
        log_dir.mkdir(parents=True, exist_ok=True)
        self.labels = labels
        self.console = console
        self.hidden = hidden_streams or {}
        self.out = stdout or sys.stdout.buffer
        self.err = stderr or sys.stderr.buffer
        use_color = color if color is not None else (self.out.isatty() and not os.environ.get("NO_COLOR"))
        width = max((len(label) for label in labels.values()), default=0)
        self.prefix: Dict[int, bytes] = {}
        for rank, label in labels.items():
            text = f"[{label}]".ljust(width + 2) + " "
            if use_color:
                text = f"\x1b[{_COLORS[rank % len(_COLORS)]}m{text}\x1b[0m"
            self.prefix[rank] = text.encode()
        self.partial: Dict[Tuple[int, int], bytes] = {}
        self.tails: Dict[int, Deque[str]] = {r: collections.deque(maxlen=_TAIL_LINES) for r in labels}
        self.logs: Dict[int, BinaryIO] = {r: open(log_dir / f"rank{r}.log", "ab", buffering=0) for r in labels}  # noqa: SIM115
        self.extra: Dict[Tuple[int, int], BinaryIO] = {}
        for key, path in (extra_logs or {}).items():
            path.parent.mkdir(parents=True, exist_ok=True)
            self.extra[key] = open(path, "ab", buffering=0)  # noqa: SIM115
        self._lock = threading.Lock()

    def write(self, rank: int, stream: int, data: bytes) -> None:
        with self._lock:
            log = self.logs.get(rank)
            if log is None:
                return
            extra = self.extra.get((rank, stream))
            if extra is not None:
                extra.write(data)
            buf = self.partial.pop((rank, stream), b"") + data
            end = 0
            segments: List[bytes] = []
            for m in _SEGMENT.finditer(buf):
                segments.append(m.group(0))
                end = m.end()
            if end < len(buf):
                self.partial[(rank, stream)] = buf[end:]
            if end:
                log.write(buf[:end] if end < len(buf) else buf)
            self._emit(rank, stream, segments)

    def end_of_rank(self, rank: int) -> None:
        """The rank exited: show an unterminated last line, and flush its log."""
        with self._lock:
            for stream in (1, 2):
                rest = self.partial.pop((rank, stream), b"")
                if rest:
                    if rank in self.logs:
                        self.logs[rank].write(rest)  # as written: no line end added to the log
                    self._emit(rank, stream, [rest + b"\n"])
            if rank in self.logs:
                self.logs[rank].flush()

    def tail(self, rank: int) -> List[str]:
        return list(self.tails.get(rank, ()))

    def close(self) -> None:
        with self._lock:
            for (rank, _), rest in self.partial.items():  # ranks that never reported an end
                if rank in self.logs:
                    self.logs[rank].write(rest)
            self.partial.clear()
            for f in (*self.logs.values(), *self.extra.values()):
                f.close()
            self.logs.clear()
            self.extra.clear()

    def _emit(self, rank: int, stream: int, segments: Iterable[bytes]) -> None:
        tail = self.tails[rank]
        shown = (self.console is None or rank in self.console) and stream not in self.hidden.get(rank, ())
        target = self.out if stream == 1 else self.err
        chunk = bytearray()
        for seg in segments:
            text = seg.rstrip(b"\r\n").decode("utf-8", "backslashreplace")
            if text.strip():
                tail.append(text)
            if shown:
                chunk += self.prefix[rank] + seg
        if chunk:
            target.write(bytes(chunk))
            target.flush()


def list_runs(logs_root: Path) -> List[Path]:
    """Runs under ``logs_root``, oldest first."""
    if not logs_root.is_dir():
        return []
    return sorted((p for p in logs_root.iterdir() if p.is_dir()), key=lambda p: p.stat().st_mtime)
