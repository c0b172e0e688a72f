"""Ctrl-C that always reaches a prompt blocked in `input()`.

CPython's readline waits in select() and looks at signals only when select() is interrupted.
A SIGINT that lands just before input() starts waiting (a Ctrl-C pressed while a rank's answer
is still being printed), or one the kernel hands to another thread, is left pending until the
next key press: the prompt looks hung. `reliable_ctrl_c()` closes that gap: the C-level handler
writes to a wakeup socket that only the Python-level handler drains; a watcher thread that still
finds it undrained a moment later signals the main thread again, which interrupts select().
"""

from __future__ import annotations

import contextlib
import signal
import socket
import threading
from collections.abc import Iterator
from typing import Any

from ..sysutil import ready_fds

_GRACE_S = 0.1  # how long the Python-level handler gets before the signal is sent again


@contextlib.contextmanager
def reliable_ctrl_c() -> Iterator[None]:
    """Within the block, Ctrl-C raises KeyboardInterrupt in the main thread, even inside input()."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    ours, theirs = socket.socketpair()
    ours.setblocking(False)
    theirs.setblocking(False)
    done = threading.Event()

    def drain() -> None:
        with contextlib.suppress(OSError):
            while ours.recv(4096):
                pass

    def on_sigint(signum: int, frame: Any) -> None:
        drain()
        raise KeyboardInterrupt

    def watch(main_ident: int) -> None:
        signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
        while not done.is_set():
            if not ready_fds([ours], timeout=0.5)[0]:
                continue
            done.wait(_GRACE_S)
            with contextlib.suppress(OSError):
                pending = ours.recv(4096, socket.MSG_PEEK)
                if pending and signal.SIGINT not in pending:
                    ours.recv(4096)  # another signal's byte: not ours to act on
                elif pending and not done.is_set():
                    signal.pthread_kill(main_ident, signal.SIGINT)

    old_fd = signal.set_wakeup_fd(theirs.fileno(), warn_on_full_buffer=False)
    old_handler = signal.signal(signal.SIGINT, on_sigint)
    watcher = threading.Thread(target=watch, args=(threading.get_ident(),), name="ctrl-c", daemon=True)
    watcher.start()
    try:
        yield
    finally:
        done.set()
        signal.signal(signal.SIGINT, old_handler)
        signal.set_wakeup_fd(old_fd)
        watcher.join(1.0)
        ours.close()
        theirs.close()
