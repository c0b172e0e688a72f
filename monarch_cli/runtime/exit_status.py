"""Process exit statuses, decoded in one place: a wait status into (exit code, signal), and
either into the words and shell-style number (128+N for a signal) that every report uses.

Standard library only: the client imports it to describe rank exits without loading the
agent's code.
"""

from __future__ import annotations

import os
import signal

__all__ = ["describe_status", "from_wait_status", "signal_name"]


def signal_name(sig: int) -> str:
    """``SIGTERM``, or ``signal 99`` for a number with no name here."""
    try:
        return signal.Signals(sig).name
    except ValueError:
        return f"signal {sig}"


def from_wait_status(status: int) -> tuple[int | None, int | None]:
    """``(exit code, None)`` or ``(None, signal)`` from an ``os.waitpid`` status."""
    exitcode = os.WEXITSTATUS(status) if os.WIFEXITED(status) else None
    sig = os.WTERMSIG(status) if os.WIFSIGNALED(status) else None
    return exitcode, sig


def describe_status(exitcode: int | None, sig: int | None) -> tuple[str, int]:
    """A human description and the shell-style status (128+N for a signal)."""
    if sig is not None:
        return f"killed by {signal_name(sig)}", 128 + sig
    return f"exit {exitcode}", int(exitcode or 0)
