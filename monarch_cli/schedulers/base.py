"""What every scheduler backend does: reserve, show what it would do, check, release."""

from __future__ import annotations

import abc
import dataclasses
import os
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional

from ..jobs.state import HostRecord, JobState
from ..runtime.keys import Keys

Progress = Callable[[str], None]


@dataclasses.dataclass
class ReserveRequest:
    hosts: int = 1
    command: List[str] = dataclasses.field(default_factory=list)
    #: Backend-specific options (Slurm partition, time, ...), validated by the backend.
    options: Dict[str, Any] = dataclasses.field(default_factory=dict)
    #: Modules warm ranks import up front; None lets the agent decide (torch if installed).
    preload: Optional[str] = None
    #: The state file that will record the reservation (absolute), for agents on this machine.
    state_file: Optional[str] = None


@dataclasses.dataclass
class DryRun:
    """What a reservation would do, without doing it."""

    scheduler: str
    summary: str
    #: Named texts worth showing in full: an sbatch script, manifests, commands.
    artifacts: Dict[str, str] = dataclasses.field(default_factory=dict)

    def to_json(self) -> Dict[str, Any]:
        return dataclasses.asdict(self)


@dataclasses.dataclass
class Reservation:
    reservation_id: str
    hosts: List[HostRecord]
    scheduler_data: Dict[str, Any] = dataclasses.field(default_factory=dict)


@dataclasses.dataclass
class HostStatus:
    name: str
    agent: str
    alive: bool
    detail: str = ""


class Scheduler(abc.ABC):
    name: str = ""

    @abc.abstractmethod
    def dryrun(self, request: ReserveRequest, workdir: Path) -> DryRun:
        """Describe exactly what :meth:`reserve` would start."""

    @abc.abstractmethod
    def reserve(self, request: ReserveRequest, keys: Keys, workdir: Path, progress: Progress) -> Reservation:
        """Start one host agent per host and return once every agent answers."""

    @abc.abstractmethod
    def release(self, state: JobState) -> None:
        """End the reservation; no process of it may be left."""

    def can_serve(self, state: JobState, request: ReserveRequest) -> Optional[str]:
        """None if ``state`` can serve ``request``; otherwise why not, in a few words."""
        if state.scheduler != self.name:
            return f"it is a {state.scheduler} reservation, not {self.name}"
        if len(state.hosts) != request.hosts:
            return f"it has {len(state.hosts)} host(s), not {request.hosts}"
        return None

    def dead_hosts(self, state: JobState) -> List[str]:
        """Hosts known dead without asking them (no network round trip); may miss some."""
        return []

    def release_unreadable(self, state_file: Path) -> List[int]:
        """Stop what a reservation whose state file cannot be read left on this machine
        (found without the file); the pids stopped. Most backends cannot find any."""
        return []

    def default_hosts(self) -> Optional[int]:
        """How many hosts to reserve when the caller does not say (None: the usual 1)."""
        return None

    def gone(self, state: JobState) -> Optional[str]:
        """A quick reason the reservation is certainly gone (no network round trip), or None."""
        return None

    def describe(self, state: JobState) -> Dict[str, Any]:
        """Scheduler-specific facts for ``monarch status``."""
        return {}


def controller_host(agents: List[str]) -> Optional[str]:
    """An address of this machine that remote agents can reach, when the default would not do.

    The controller's mailbox advertises ``$MONARCH_HOST`` or what this host's name resolves
    to; on many login nodes that is a loopback address, useless to agents on other hosts.
    Then the right address is the one the kernel routes towards the agents (a UDP
    ``connect`` sends nothing). None when the default is fine or nothing better is known.
    """
    import socket

    from ..config import advertised_host, settings

    if settings().host or os.environ.get("MONARCH_HOST") or not advertised_host().startswith("127."):
        return None
    for address in agents:
        host = address.rpartition("//")[2].rpartition(":")[0]
        if not host or host.startswith("127.") or host in ("localhost", "*"):
            continue
        try:
            with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
                probe.connect((host, 9))
                return probe.getsockname()[0]
        except OSError:
            continue
    return None
