"""The terminal or pipe a run prints to, treated as Unix tools treat it.

When the reader goes away (``monarch run-spmd | head -1``), a write fails with EPIPE. Like
``seq``, ``git log`` or ``torchrun`` under SIGPIPE, the CLI then stops quietly: nothing more
is written (no traceback per line), and the run is told once so it can end its ranks; the
per-rank logs keep every byte until they have.

A console that fails otherwise (a terminal gone: EIO; a full disk under a redirect: ENOSPC)
is dropped with one line on stderr, and the run goes on: the per-rank logs have everything.
"""

from __future__ import annotations

import contextlib
import os
import sys
import threading
from collections.abc import Callable
from typing import BinaryIO

#: Exit status of a command whose output pipe closed: 128 + SIGPIPE, as the shell reports
#: a tool killed by it (``git log | head`` exits 141 too).
CLOSED_PIPE_EXIT = 141


def silence(stream: object) -> None:
    """Point ``stream``'s file descriptor at /dev/null: later writes and the final flush at exit
    succeed quietly instead of raising BrokenPipeError again."""
    with contextlib.suppress(AttributeError, OSError, ValueError):
        fd = stream.fileno()  # type: ignore[attr-defined]
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, fd)
        os.close(devnull)


class ConsoleStream:
    """A binary stream that swallows writes once its reader has gone, and says so once."""

    def __init__(self, target: BinaryIO, on_closed: Callable[[], None] | None = None) -> None:
        self.target = target
        self.on_closed = on_closed
        self.reader_gone = False
        self.failed = False  # the console failed (not EPIPE): output goes to the logs only
        self._lock = threading.Lock()

    def write(self, data: bytes) -> int:
        if not (self.reader_gone or self.failed):
            try:
                return self.target.write(data)
            except BrokenPipeError:
                self._gone()
            except OSError as e:
                self._failed(e)
        return len(data)

    def flush(self) -> None:
        if not (self.reader_gone or self.failed):
            try:
                self.target.flush()
            except BrokenPipeError:
                self._gone()
            except OSError as e:
                self._failed(e)

    def isatty(self) -> bool:
        return self.target.isatty()

    def fileno(self) -> int:
        return self.target.fileno()

    def _failed(self, error: OSError) -> None:
        with self._lock:
            if self.failed:
                return
            self.failed = True
        with contextlib.suppress(OSError, ValueError):
            print(
                f"monarch: the console failed ({error.strerror or error}); output goes on to the per-rank logs only",
                file=sys.__stderr__,
                flush=True,
            )

    def _gone(self) -> None:
        with self._lock:
            if self.reader_gone:
                return
            self.reader_gone = True
        silence(self.target)
        if self.on_closed is not None:
            self.on_closed()
