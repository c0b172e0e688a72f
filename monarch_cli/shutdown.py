"""Ending a process as the interpreter would, without its finalization (the CLI and the ranks).

Tearing every module down one by one costs a command ~20-30 ms, and stops daemon threads
wherever they are; both the ``monarch`` command and a rank end with :func:`run_exit_steps`
and then ``os._exit``. Standard library only, so a cold rank pays nothing to import it.
"""

from __future__ import annotations

import atexit
import sys
import threading


def run_exit_steps() -> None:
    """What interpreter shutdown does before finalization: join the non-daemon threads, run the
    atexit handlers, flush stdout and stderr (a failure in any of them is passed over, as there)."""
    try:
        threading._shutdown()  # type: ignore[attr-defined]
    except Exception:  # noqa: BLE001 - as the interpreter: exit anyway
        pass
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:  # noqa: BLE001 - a reader gone (EPIPE) was handled where it was written
            pass


__all__ = ["run_exit_steps"]
