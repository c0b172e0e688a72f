"""Where a user's local host agents say who they are, so they can be found without the state file.

Each agent started with ``--state-file`` writes ``agent-<pid>.json`` (pid, start time, state
file, reservation) into a per-user 0700 runtime directory and removes it when it exits.
``monarch stop --force`` on an unreadable state file finds that reservation's agents there;
the start time makes sure a recycled pid is never mistaken for an agent.
"""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import tempfile
import time
from pathlib import Path

import psutil

from .lineage import kill_tree


@dataclasses.dataclass
class AgentEntry:
    pid: int
    start_time: float
    state_file: str
    reservation: str
    name: str
    path: Path

    def alive(self) -> bool:
        try:
            proc = psutil.Process(self.pid)
            return proc.create_time() == self.start_time and proc.status() != psutil.STATUS_ZOMBIE
        except psutil.Error:
            return False


def registry_dir() -> Path | None:
    """``agents/`` in the per-user runtime directory the transport's sockets use
    (``$XDG_RUNTIME_DIR/monarch-<uid>``, else ``/tmp/monarch-<uid>``), 0700 and ours; None if
    that directory is someone else's or readable by others."""
    root = Path(os.environ.get("XDG_RUNTIME_DIR") or tempfile.gettempdir()) / f"monarch-{os.getuid()}"
    try:
        root.mkdir(mode=0o700, exist_ok=True)
        st = os.lstat(root)
    except OSError:
        return None
    if not os.path.isdir(root) or os.path.islink(root) or st.st_uid != os.getuid() or st.st_mode & 0o077:
        return None  # someone else's directory, or readable by others: never trust it
    agents = root / "agents"
    try:
        agents.mkdir(mode=0o700, exist_ok=True)
    except OSError:
        return None
    return agents


def register(state_file: str, reservation: str, name: str) -> Path | None:
    """Record this process as an agent of ``state_file``; returns the entry's path."""
    directory = registry_dir()
    if directory is None:
        return None
    pid = os.getpid()
    entry = {
        "pid": pid,
        "start_time": psutil.Process(pid).create_time(),
        "state_file": state_file,
        "reservation": reservation,
        "name": name,
    }
    path = directory / f"agent-{pid}.json"
    tmp = directory / f".agent-{pid}.tmp"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        json.dump(entry, f)
    os.replace(tmp, path)
    return path


def agents_of(state_file: str | None = None, reservation: str | None = None) -> list[AgentEntry]:
    """The living agents registered for ``state_file`` (absolute) or ``reservation``; stale
    entries are removed on the way."""
    directory = registry_dir()
    if directory is None:
        return []
    found = []
    for path in directory.glob("agent-*.json"):
        try:
            raw = json.loads(path.read_text())
            entry = AgentEntry(
                int(raw["pid"]),
                float(raw["start_time"]),
                str(raw["state_file"]),
                str(raw["reservation"]),
                str(raw["name"]),
                path,
            )
        except (OSError, ValueError, KeyError, TypeError):
            continue
        if not entry.alive():
            path.unlink(missing_ok=True)
            continue
        if (state_file is not None and entry.state_file == state_file) or (
            reservation is not None and entry.reservation == reservation
        ):
            found.append(entry)
    return found


def stop_agents(entries: list[AgentEntry], grace: float = 5.0) -> None:
    """SIGTERM each agent (it ends its ranks and warm processes), then SIGKILL what is left:
    the agent and every process under it."""
    for e in entries:
        if e.alive():
            os.kill(e.pid, signal.SIGTERM)
    deadline = time.monotonic() + grace
    while time.monotonic() < deadline and any(e.alive() for e in entries):
        time.sleep(0.05)
    for e in entries:
        if e.alive():
            kill_tree(e.pid)
            os.kill(e.pid, signal.SIGKILL)
        e.path.unlink(missing_ok=True)


def reservation_present(state_file: str, reservation: str) -> bool | None:
    """Whether ``state_file`` still records ``reservation``: False when it is gone or names
    another one; None when it cannot be told (unreadable). The reservation id appears
    verbatim in the state pickle, so no parsing (and no import of the jobs layer) is needed."""
    try:
        with open(state_file, "rb") as f:
            data = f.read(16 * 1024 * 1024)
    except FileNotFoundError:
        return False
    except OSError:
        return None
    return reservation.encode() in data
