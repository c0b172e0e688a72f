"""What a request handler may use of the host agent: :class:`AgentCore`, a typed interface.

The handlers (:mod:`.procs`, :mod:`.ranks`, :mod:`.debug`, :mod:`.sync`, :mod:`.telemetry`) are
given the agent as an :class:`AgentCore`, never as :class:`.HostAgent`, so the agent's core
imports its handlers and no handler imports the core: each can be read, and tested, against this
page alone. What one handler asks of another goes through the small interfaces below.
"""

from __future__ import annotations

import socket
import subprocess
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Protocol

from ..transport.keys import Keys
from ..transport.sockets import Transport

if TYPE_CHECKING:
    from ..protocol import ProcBoot, RankSpec


class ForkServer(Protocol):
    """A fork server (zygote): forks a proc or a rank on request."""

    @property
    def process(self) -> subprocess.Popen[bytes]: ...

    def fork(self, req_id: int, boot: RankSpec | ProcBoot, fds: Sequence[int] = ..., kind: str = ...) -> None: ...


class DebugSessions(Protocol):
    """The agent's debugger relay, as the ranks' handler feeds it (:class:`.debug.DebugHost`)."""

    def add(self, run_id: str, rank: int, owner: str, sock: socket.socket, coords: dict[str, int]) -> None: ...

    def set_pid(self, run_id: str, rank: int, pid: int) -> None: ...

    def rank_exited(self, run_id: str, rank: int, how: str) -> None: ...


class RankObserver(Protocol):
    """Telemetry, as told that a rank ended (:class:`.telemetry.TelemetryHost`)."""

    def rank_ended(self, rank: Any) -> None: ...


class WarmForks(Protocol):
    """The learned warm processes, as runs use them (:class:`.warm.WarmRanks`)."""

    @property
    def learning(self) -> bool: ...

    def for_run(self, keep: bool = False) -> tuple[ForkServer, list[str]]: ...

    def fork_asked(self, zygote: ForkServer) -> None: ...

    def rank_kept(self, zygote_pid: int) -> None: ...

    def keep_spares(self, count: int, busy: set[int]) -> None: ...

    def report_path(self, run_id: str, rank: int) -> str: ...

    def learn(self, run_id: str) -> None: ...


class RankTable(Protocol):
    """The live ranks of this host, by pid (:class:`.ranks.RankHost`)."""

    @property
    def by_pid(self) -> dict[int, Any]: ...

    def exiting(self, pid: int, status: int, kept: bool = False) -> None: ...


class AgentCore(Protocol):
    """The host agent as its handlers see it: its identity, its socket, its poller, its siblings.

    Attributes are read-only properties here, so the agent's richer types (``DebugHost`` for
    :class:`DebugSessions`, ...) satisfy them.
    """

    @property
    def host(self) -> str: ...
    @property
    def address(self) -> str: ...
    @property
    def keys(self) -> Keys: ...
    @property
    def transport(self) -> Transport: ...
    def fork_server(self) -> ForkServer:
        """The plain fork server (cold ranks, procs), started at the first call."""
        ...

    @property
    def debug(self) -> DebugSessions: ...
    @property
    def telemetry(self) -> RankObserver: ...
    @property
    def warm(self) -> WarmForks: ...
    @property
    def ranks(self) -> RankTable: ...

    def send(self, address: str, msg: Any, body: list[Any] = ...) -> None:
        """Send one message to ``address`` (a client's mailbox or a proc)."""

    def send_frames(self, address: str, frames: list[Any]) -> None:
        """Send frames already encoded."""

    def reply(self, address: str, cid: int, ok: bool, value: Any) -> None:
        """Answer request ``cid`` of ``address`` with a value or a failure."""

    def next_request(self) -> int:
        """A fresh request id for a fork server."""

    def register_client(self, addr: str, heartbeat_timeout: float) -> None:
        """Watch a client's heartbeats (its clock restarts now): what it owns dies with it."""

    def watch_fd(self, fd: int) -> None:
        """Add ``fd`` to the agent's poller; its handler is called when it is readable."""

    def unwatch_fd(self, fd: int) -> None:
        """Remove ``fd`` from the agent's poller."""

    def zygote_pids(self) -> set[int]:
        """The pids of this agent's fork servers."""
