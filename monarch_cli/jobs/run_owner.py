"""Who drives a run, written beside its logs, so a reader can tell a run that goes on from one
whose client died.

A run's client (``monarch run-spmd``, or the MCP server's detached runner) writes
``<log dir>/runner.json`` when the run starts: its pid, its start time as the kernel counts it
(``/proc/<pid>/stat``, with the boot id, so a pid the kernel handed to another process since is
not taken for the runner) and its host. ``result.json`` appears when the run ends. A client
killed with SIGKILL (or by the OOM killer) writes neither, and its run would read "running"
forever in the MCP server, the dashboard and ``monarch sql``. :func:`settle` is what every such
reader calls first: a "running" run whose runner is gone is rewritten as "lost" (here and in the
telemetry store), once, atomically, with a one-line reason.

A reader on another host (a Slurm login node and a compute node sharing the state directory)
cannot look up the runner's pid. The runner therefore renews a lease while it runs: it touches
``runner.json`` every :data:`RENEW_S` seconds, and a reader elsewhere takes a record untouched
for :data:`LEASE_S` as a runner gone (the hosts' clocks must agree within a minute).

Standard library only: ``monarch sql`` and ``monarch logs`` call it and must start fast.
"""

from __future__ import annotations

import json
import os
import socket
import threading
import time
from pathlib import Path
from typing import Any

from ..sysutil import atomic_write
from ..telemetry import StoreError, db_path, end_lost_run

RUNNER_FILE = "runner.json"
RESULT_FILE = "result.json"
RUNNING, LOST, FAILED = "running", "lost", "failed"
#: How often a runner touches its record, and how stale a record a reader on another host trusts.
RENEW_S = 20.0
LEASE_S = 120.0


def process_start(pid: int) -> str | None:
    """When ``pid`` started, as a string that differs for any later process given the same pid;
    None when no such process runs (a zombie has ended: it only waits for its parent)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            fields = f.read().rsplit(b")", 1)[1].split()
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
    except FileNotFoundError:
        return None if os.path.isdir("/proc/self") else _portable_start(pid)
    except (OSError, IndexError):
        return None
    if fields[0] in (b"Z", b"X"):  # state, then ppid...; starttime is the 22nd field of the whole line
        return None
    return f"{boot}:{int(fields[19])}"


def _portable_start(pid: int) -> str | None:
    """Where there is no /proc (macOS): psutil's creation time."""
    import psutil

    try:
        p = psutil.Process(pid)
        return None if p.status() == psutil.STATUS_ZOMBIE else repr(p.create_time())
    except psutil.Error:
        return None


def claim(log_dir: Path) -> None:
    """This process drives the run logged in ``log_dir`` (written before any rank starts); it
    renews the record's lease until the run has its result or this process ends."""
    pid = os.getpid()
    record = {"pid": pid, "start": process_start(pid), "host": socket.gethostname(), "state": RUNNING}
    atomic_write(log_dir / RUNNER_FILE, json.dumps(record))
    threading.Thread(target=_renew, args=(log_dir,), name="monarch-run-lease", daemon=True).start()


def _renew(log_dir: Path) -> None:
    path, result = log_dir / RUNNER_FILE, log_dir / RESULT_FILE
    while not result.exists():
        time.sleep(RENEW_S)  # a lease's clock: nothing waits on this thread
        try:
            os.utime(path)
        except OSError:
            return  # the run's directory went (stop, pruned)


def failed(log_dir: Path, error: str) -> None:
    """The run ended with no result (it failed to run): said so, so that it is not taken for lost."""
    record = {**(read(log_dir) or {}), "state": FAILED, "error": error, "ended_at": time.time()}
    try:
        atomic_write(log_dir / RUNNER_FILE, json.dumps(record))
    except OSError:
        pass  # its directory went (stop, pruned): the error the caller raises says it all


def read(log_dir: Path) -> dict[str, Any] | None:
    try:
        record = json.loads((log_dir / RUNNER_FILE).read_text())
    except (OSError, ValueError):
        return None
    return record if isinstance(record, dict) else None


def runner_gone(record: dict[str, Any], log_dir: Path | None = None) -> bool:
    """Whether the record's runner has ended: on this host, by its pid; on another, by its lease
    (the age of ``log_dir``'s record, when given)."""
    pid, start = record.get("pid"), record.get("start")
    if not isinstance(pid, int) or pid <= 0 or start is None:
        return False
    if record.get("host") == socket.gethostname():
        return process_start(pid) != start
    try:
        return log_dir is not None and time.time() - (log_dir / RUNNER_FILE).stat().st_mtime > LEASE_S
    except OSError:
        return False


def settle(log_dir: Path, state_dir: Path | None = None) -> dict[str, Any] | None:
    """The run's runner record, with a "running" run whose runner is gone rewritten as lost
    (and ended in ``state_dir``'s telemetry store); None for a run with no record (an older
    client's) or one that has its result."""
    record = read(log_dir)
    if record is None or (log_dir / RESULT_FILE).exists():
        return None
    if record.get("state") != RUNNING or not runner_gone(record, log_dir):
        return record
    if (log_dir / RESULT_FILE).exists():  # it ended between our two looks
        return None
    now = time.time()
    where = (
        ""
        if record.get("host") == socket.gethostname()
        else f" on {record.get('host')}, silent for over {LEASE_S:.0f} s,"
    )
    why = f"its client (pid {record['pid']}){where} ended without a result (killed?)"
    lost = {**record, "state": LOST, "error": f"run {log_dir.name}: {why}", "ended_at": now}
    if state_dir is not None and db_path(state_dir).exists():
        try:
            end_lost_run(db_path(state_dir), log_dir.name, why, now)
        except StoreError:
            return lost  # not rewritten: the next reader tries the store again
    try:
        atomic_write(log_dir / RUNNER_FILE, json.dumps(lost))
    except OSError:
        pass  # a directory we cannot write (another user's logs): said, not kept
    return lost


def settle_open(state_dir: Path, logs_root: Path | None = None) -> list[str]:
    """Settle every run of a reservation that has no result yet; the ids found lost.

    The runs are those under ``logs_root`` (default: ``state_dir/logs``) and those the telemetry
    store still has open; a few stats each."""
    from .output import list_runs

    root = logs_root if logs_root is not None else Path(state_dir) / "logs"
    dirs = {p for p in list_runs(root) if not (p / RESULT_FILE).exists()}
    dirs.update(_open_in_store(Path(state_dir)))
    lost = []
    for d in sorted(dirs):
        record = settle(d, state_dir)
        if record is not None and record.get("state") == LOST:
            lost.append(d.name)
    return lost


def _open_in_store(state_dir: Path) -> list[Path]:
    """The log directories of the runs the store has no end for."""
    from ..telemetry import query

    if not db_path(state_dir).exists():
        return []
    try:
        _, rows = query(db_path(state_dir), "SELECT log_dir FROM runs WHERE ended_at IS NULL AND log_dir IS NOT NULL")
    except StoreError:
        return []
    return [Path(r[0]) for r in rows if Path(r[0]).is_dir()]
