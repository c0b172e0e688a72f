"""What a host agent needs to keep track of every process its runs start, wherever they go.

The agent is a child subreaper (``PR_SET_CHILD_SUBREAPER``): a process whose parent dies
is re-parented to the agent, not to init. So the ranks of a warm process that died, and a
rank's grandchild that called ``setsid()`` and was orphaned, stay in the agent's process
tree, where they can be reaped, found and ended with their run.
"""

from __future__ import annotations

import ctypes
import os
import signal
import subprocess
import time
from collections.abc import Iterable

import psutil

_PR_SET_CHILD_SUBREAPER = 36
RUN_ENV = "MONARCH_RUN_ID"  #: set in every rank's environment; its descendants inherit it

Pid = tuple[int, float]  # (pid, start time): never confused with a later process given the pid


def become_subreaper() -> bool:
    """Adopt orphaned descendants (Linux >= 3.4); False where the kernel cannot."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return libc.prctl(_PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False


def reap_adopted(own: dict[int, subprocess.Popen[bytes]]) -> list[tuple[int, int]]:
    """Collect the exit of every dead child: ``own`` (Popen) children collect their own
    status; adopted orphans are reaped here and returned as (pid, wait status)."""
    found: list[tuple[int, int]] = []
    seen: set[int] = set()
    while True:
        try:
            info = os.waitid(os.P_ALL, 0, os.WEXITED | os.WNOHANG | os.WNOWAIT)
        except ChildProcessError:
            break
        if info is None or info.si_pid in seen:
            break
        pid = info.si_pid
        seen.add(pid)
        if pid in own:
            own[pid].poll()
            continue
        try:
            _, status = os.waitpid(pid, os.WNOHANG)
        except ChildProcessError:
            continue
        found.append((pid, status))
    return found


def _start_time(pid: int) -> float | None:
    try:
        return psutil.Process(pid).create_time()
    except psutil.Error:
        return None


def children_map() -> dict[int, list[int]]:
    """Every process's children, from one pass over the process table."""
    table: dict[int, list[int]] = {}
    for p in psutil.process_iter(["ppid"]):
        table.setdefault(p.info["ppid"] or 0, []).append(p.pid)
    return table


def descendants(roots: Iterable[int], table: dict[int, list[int]] | None = None) -> set[Pid]:
    """Every living process below ``roots`` (whatever session or group they moved to)."""
    table = children_map() if table is None else table
    found: set[Pid] = set()
    stack = [c for r in roots for c in table.get(r, ())]
    while stack:
        pid = stack.pop()
        start = _start_time(pid)
        if start is not None and (pid, start) not in found:
            found.add((pid, start))
            stack.extend(table.get(pid, ()))
    return found


def carrying(run_id: str, among: Iterable[Pid]) -> set[Pid]:
    """The processes among ``among`` whose environment says they belong to ``run_id``."""
    found = set()
    for pid, start in among:
        try:
            if psutil.Process(pid).environ().get(RUN_ENV) == run_id:
                found.add((pid, start))
        except psutil.Error:
            pass
    return found


def signal_exact(proc: Pid, sig: int) -> bool:
    """Signal ``proc`` only if it is still the process that started at that time."""
    pid, start = proc
    if _start_time(pid) != start:
        return False
    try:
        os.kill(pid, sig)
        return True
    except (ProcessLookupError, PermissionError):
        return False


def kill_tree(root: int = 0, passes: int = 20) -> None:
    """SIGKILL every descendant of ``root`` (default: this process).

    Pass after pass: a process that dies while the table is read can hide its children
    (they still name it as parent); once re-parented they are found by the next pass.
    """
    for _ in range(passes):
        found = [p for p in descendants([root or os.getpid()]) if _start_time(p[0]) is not None]
        alive = [p for p in found if _status(p[0]) != psutil.STATUS_ZOMBIE]
        if not alive:
            return
        for proc in alive:
            signal_exact(proc, signal.SIGKILL)
        time.sleep(0.02)


def _status(pid: int) -> str | None:
    try:
        return psutil.Process(pid).status()
    except psutil.Error:
        return None
