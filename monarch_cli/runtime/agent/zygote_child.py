"""What a fork server's child runs (:mod:`.zygote` forks it): a proc, a warm rank, a cold rank
(exec'd at once), a spare waiting for a rank's spec, and a kept rank (``--keep-ranks``) that runs
run after run, put back between them (:mod:`..rank.keep`), telling its zygote over a socket of its
own when its run is ``ending`` and when it is ``idle`` again."""

from __future__ import annotations

import ctypes
import fcntl
import os
import pickle
import signal
import socket
import sys
import traceback
from typing import TYPE_CHECKING, Any, cast

from .. import protocol

if TYPE_CHECKING:
    from ..protocol import RankSpec

_PR_SET_PDEATHSIG = 1


def die_with_parent() -> None:
    """Ask the kernel to SIGKILL this process when its parent dies (Linux)."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    except (OSError, AttributeError):
        pass


def _leave_the_zygote(inherited: list[Any]) -> None:
    """First thing in a child: the zygote's signal set-up and its descriptors are not its own."""
    signal.set_wakeup_fd(-1)
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    die_with_parent()
    for f in inherited:
        try:
            f.close() if isinstance(f, socket.socket) else os.close(f)
        except OSError:
            pass


def _child(
    inherited: list[Any], kind: str, boot: dict[str, Any], fds: list[int], keep: socket.socket | None = None
) -> None:
    """Be the child asked for; never returns. A kept rank (``keep``: its socket to the zygote, and
    a spec that says ``keep``) runs run after run: put back after each (:mod:`..rank.keep`), it
    says ``idle`` and is handed the next run's spec and fds as a spare is."""
    while True:
        code = _be(inherited, kind, boot, fds)
        inherited = []
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except Exception:  # noqa: BLE001 - a reader gone
                pass
        if kind != "rank":
            os._exit(code)
        kept = keep is not None and bool(boot.get("keep")) and _kept(boot)
        if kept and keep is not None:
            _tell(keep, b"ending")  # (the zygote holds the next run for it rather than forking)
        _say_exiting(code, kept)
        if not kept or keep is None or not _reset_kept():
            os._exit(code)
        kind, boot, fds = _next_run(keep, boot)


def _be(inherited: list[Any], kind: str, boot: dict[str, Any], fds: list[int]) -> int:
    code = 1
    try:
        parent = boot.pop("_zygote_pid")
        _leave_the_zygote(inherited)
        if os.getppid() != parent:
            os._exit(1)
        # A kept rank closed its stdio after its run, so the next run's fds may arrive as 0-2:
        # lift them above stdio first (dup2 onto itself, then close, would lose one).
        fds = [fcntl.fcntl(fd, fcntl.F_DUPFD, 3) if fd <= 2 else fd for fd in fds]
        extra = {role: fds[i] for role, i in boot.pop("_fd_roles", {}).items()}  # listen, debug
        for target, fd in zip((0, 1, 2), fds[:3]):
            os.dup2(fd, target)
            os.close(fd)
        if kind == "proc":
            from ..actor import proc

            code = proc.main(boot)
        elif kind == "rank":
            from ..rank import start as rank_start

            code = rank_start.become_rank(cast("RankSpec", boot), extra)
        elif kind == "cold":
            from ..rank import start as rank_start

            rank_start.exec_cold(cast("RankSpec", boot), extra)  # only returns by raising
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else 1
    except BaseException:  # noqa: BLE001
        traceback.print_exc()
    return code


def _kept(boot: dict[str, Any]) -> bool:
    try:
        from ..rank import start as rank_start

        return rank_start.keep_for_next(boot)  # type: ignore[arg-type]
    except BaseException:  # noqa: BLE001 - a fresh process is the safe answer
        return False


def _tell(keep: socket.socket, what: bytes) -> None:
    try:
        keep.send(what)
    except OSError:  # the zygote is gone: so is this process, soon (PDEATHSIG)
        os._exit(1)


def _reset_kept() -> bool:
    try:
        from ..rank import start as rank_start

        return rank_start.reset_kept()
    except BaseException:  # noqa: BLE001 - a fresh process is the safe answer
        return False


def _next_run(keep: socket.socket, boot: dict[str, Any]) -> tuple[str, dict[str, Any], list[int]]:
    """A kept rank between runs: idle, its debugger channel closed, until the zygote hands it the
    next run (a ``fork`` of kind rank with its fds) or lets it go (the socket closes)."""
    rank_debug = sys.modules.get("monarch_cli.runtime.rank.debug")
    if rank_debug is not None:
        rank_debug.uninstall()
    local = str(boot.get("env", {}).get("LOCAL_RANK", ""))
    try:
        keep.send(f"idle {local}".encode())
        data, fds, _, _ = socket.recv_fds(keep, 1 << 20, 16)
    except BaseException:  # noqa: BLE001 - a signal from outside: an idle kept rank just goes
        os._exit(1)
    if not data:
        os._exit(0)
    fork = protocol.decode(pickle.loads(data))
    return fork.kind, fork.boot, list(fds)


def _say_exiting(code: int, kept: bool = False) -> None:
    """A warm rank's last act (a kept one's last of its run): close its output and tell its agent
    the status (``RankHost.exiting``)."""
    rank_debug = sys.modules.get("monarch_cli.runtime.rank.debug")
    if rank_debug is None or not rank_debug.installed():
        return
    for fd in (0, 1, 2):  # what _exit would close: the agent sees the ends of output now
        try:
            os.close(fd)
        except OSError:
            pass
    rank_debug.say_exiting(code, kept)


def _spare(own: socket.socket, inherited: list[Any], title: str) -> None:
    """A spare child: wait, running nothing, for a rank's fork request; then be that rank."""
    data, fds = b"", cast(list[int], [])
    try:
        _leave_the_zygote(inherited)
        from ..title import set_title

        set_title(title)
        data, fds, _, _ = socket.recv_fds(own, 1 << 20, 16)
    except BaseException:  # noqa: BLE001 - a signal from outside: an idle spare just goes
        os._exit(1)
    if not data:  # the zygote went, or let it go
        os._exit(0)
    fork = protocol.decode(pickle.loads(data))
    keep = own if fork.boot.get("keep") else None
    if keep is None:
        own.close()
    _child([], fork.kind, fork.boot, list(fds), keep)
