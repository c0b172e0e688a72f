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

from ...config import RUN_ID_ENV

_PR_SET_CHILD_SUBREAPER = 36
RUN_ENV = RUN_ID_ENV  #: set in every rank's environment; its descendants inherit it

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


def _stat(pid: int) -> list[bytes] | None:
    """``/proc/PID/stat``'s fields after the command name (state, ppid, ...), or None if gone.

    Read directly, not through psutil: the agent looks at its process tree at the end of every
    run, and psutil's objects (a pid-reuse check, a read per attribute) made that pass ~40 % of
    an agent's CPU for a one-rank run on a host of a few hundred processes."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            data = f.read()
    except OSError:
        return None
    return data[data.rfind(b")") + 2 :].split()  # the name may hold spaces and parentheses


def _start_time(pid: int) -> float | None:
    """When ``pid`` started (clock ticks since boot): with the pid, a process's identity."""
    fields = _stat(pid)
    return float(fields[19]) if fields is not None and len(fields) > 19 else None


def children_map() -> dict[int, list[int]]:
    """Every process's children, from one pass over the process table."""
    table: dict[int, list[int]] = {}
    for name in os.listdir("/proc"):
        if name.isdigit():
            fields = _stat(int(name))
            if fields is not None and len(fields) > 1:
                table.setdefault(int(fields[1]), []).append(int(name))
    return table


def _children(pid: int) -> list[int] | None:
    """``pid``'s children from ``/proc/PID/task/*/children`` (each thread's), or None where the
    kernel does not list them (CONFIG_PROC_CHILDREN): then the whole table is read."""
    try:
        tasks = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return []  # gone
    out: list[int] = []
    for tid in tasks:
        try:
            with open(f"/proc/{pid}/task/{tid}/children", "rb") as f:
                out.extend(int(c) for c in f.read().split())
        except FileNotFoundError:
            if not os.path.exists(f"/proc/{pid}/task/{tid}"):
                continue  # that thread ended
            return None
        except OSError:
            continue
    return out


def descendants(roots: Iterable[int], table: dict[int, list[int]] | None = None) -> set[Pid]:
    """Every living process below ``roots`` (whatever session or group they moved to): walked
    down from them, or looked up in ``table`` (:func:`children_map`) when given or needed."""
    found: set[Pid] = set()
    stack = list(roots)
    seen: set[int] = set()
    while stack:
        pid = stack.pop()
        if pid in seen:
            continue
        seen.add(pid)
        below = table.get(pid, []) if table is not None else _children(pid)
        if below is None:
            return descendants(roots, children_map())
        for child in below:
            start = _start_time(child)
            if start is not None and (child, start) not in found:
                found.add((child, start))
                stack.append(child)
    return found


def carrying(run_id: str, among: Iterable[Pid]) -> set[Pid]:
    """The processes among ``among`` whose environment says they belong to ``run_id``."""
    mark = f"{RUN_ENV}={run_id}".encode()
    found = set()
    for pid, start in among:
        try:
            with open(f"/proc/{pid}/environ", "rb") as f:
                if mark in f.read().split(b"\0"):
                    found.add((pid, start))
        except OSError:
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
        alive = [p for p in found if _status(p[0]) != "Z"]
        if not alive:
            return
        for proc in alive:
            signal_exact(proc, signal.SIGKILL)
        time.sleep(0.02)


def _status(pid: int) -> str | None:
    fields = _stat(pid)
    return fields[0].decode() if fields else None
