"""torchx's local schedulers keep their apps inside the process that submitted them; ours must not.

torchx's ``local_cwd`` scheduler holds each app in memory: ``describe`` from another process
returns None, and closing the scheduler (or the submitting process's exit) kills the replicas.
That is the "reserve once is not real on the local scheduler" gap noted of Monarch. A
reservation must outlive ``monarch serve``, so right after torchx submits the app we take
its replicas out of torchx's in-memory table (each is a session leader that torchx started)
and track them by process group from then on: liveness by pid, release by signalling the
group. This touches torchx's private ``_apps`` table; ``tests/torchx`` fails loudly if a
torchx release changes it.
"""

from __future__ import annotations

import contextlib
import os
import signal
import time
import warnings
from collections.abc import Iterator
from typing import Any

from ...errors import SchedulerError


@contextlib.contextmanager
def keep_signal_handlers() -> Iterator[None]:
    """Around every call into torchx: its local scheduler installs its own SIGTERM/SIGINT handlers when
    created (ours stay), and its warnings (deprecations, a missing kube config) are not for our users."""
    saved = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGINT)}
    try:
        with warnings.catch_warnings():  # torchx's warnings speak to its own CLI's users; ours see one line
            warnings.simplefilter("ignore")
            yield
    finally:
        for sig, handler in saved.items():
            if handler is not None:
                with contextlib.suppress(ValueError):  # not the main thread: torchx did not touch them either
                    signal.signal(sig, handler)


def detach(runner: Any, scheduler: str, app_id: str) -> dict[str, Any]:
    """Take the app's replicas out of torchx's table; ``{"pids": [...], "log_dir": ...}``."""
    sched = runner._scheduler(scheduler)
    app = getattr(sched, "_apps", {}).pop(app_id, None)
    if app is None:
        raise SchedulerError(f"torchx {scheduler} did not keep app {app_id} where monarch expects it")
    replicas = sorted((r for rs in app.role_replicas.values() for r in rs), key=lambda r: r.replica_id)
    for replica in replicas:  # our copies of the log files; the replica writes to its own
        for stream in (replica.stdout, replica.stderr, replica.combined):
            with contextlib.suppress(Exception):
                if stream is not None:
                    stream.close()
    return {"pids": [r.proc.pid for r in replicas], "log_dir": app.log_dir}


def alive(pids: list[int]) -> list[bool]:
    """Whether each replica's process still runs (a zombie of an exited child counts as gone)."""
    found = []
    for pid in pids:
        try:
            with open(f"/proc/{pid}/stat", "rb") as f:
                state = f.read().rpartition(b")")[2].split()[0]
            found.append(state not in (b"Z", b"X"))
        except (OSError, IndexError):
            found.append(False)
    return found


def kill(pids: list[int], grace: float = 10.0) -> None:
    """SIGTERM each replica's process group (the agent takes its ranks down), then SIGKILL what is left."""
    for pid in pids:
        _signal_group(pid, signal.SIGTERM)
    deadline = time.monotonic() + grace
    while time.monotonic() < deadline and any(alive(pids)):
        time.sleep(0.05)
    for pid, up in zip(pids, alive(pids)):
        if up:
            _signal_group(pid, signal.SIGKILL)


def _signal_group(pid: int, sig: int) -> None:
    try:
        os.killpg(pid, sig)  # torchx started each replica as a session (and group) leader
    except (ProcessLookupError, PermissionError):
        pass


__all__ = ["alive", "detach", "keep_signal_handlers", "kill"]
