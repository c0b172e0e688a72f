"""The client side of ``monarch debug``: find paused ranks, attach, cast, continue, DAP.

Talks to every host agent of the reservation with the reservation's keys; any number of
clients may look, one at a time may hold a rank.
"""

from __future__ import annotations

import builtins
import dataclasses
import getpass
import os
import queue
import socket
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from ..config import settings
from ..runtime import protocol
from ..runtime.dap_link import GOODBYE, LOOPBACK, DapFrames, accept_same_user, is_goodbye, listen_loopback
from ..runtime.errors import ActorError
from ..runtime.mailbox.events import Subscription
from ..runtime.mailbox.future import Future
from ..sysutil import ready_fds
from .errors import JobError
from .ranks import parse_rank_list

if TYPE_CHECKING:  # the job (and the runtime) load when a client is made, not when the CLI starts
    from .model import HostSet

Event = tuple[
    str, int, str, Any
]  # (kind, rank, what, detail): ("output", 3, text, None), ("state", 3, "paused", where)


@dataclasses.dataclass
class PausedRank:
    run_id: str
    rank: int
    host: str
    agent: str
    pid: int | None
    state: str
    file: str | None
    line: int | None
    function: str | None
    reason: str | None
    holder: str | None
    exit: str | None
    coords: dict[str, int]
    started: float = 0.0

    @property
    def where(self) -> str:
        return f"{self.file}:{self.line}" if self.file else "-"

    def to_json(self) -> dict[str, Any]:
        return {k: v for k, v in dataclasses.asdict(self).items() if k != "agent"}


def select_ranks(expr: str, rows: list[PausedRank]) -> set[int]:
    """Ranks named by ``expr``: ``*``, ``0,3``, ``2-5``, ``0:8:2``, or ``hosts=1,gpus=0:2``."""
    expr = expr.strip()
    known = {r.rank for r in rows}
    if expr in ("*", "all", ""):
        return known
    try:
        if "=" in expr:
            picked = set(known)
            for part in expr.split(","):
                dim, _, sel = part.partition("=")
                allowed = _numbers(sel, 1 + max((r.coords.get(dim.strip(), 0) for r in rows), default=0))
                picked &= {r.rank for r in rows if r.coords.get(dim.strip()) in allowed}
            return picked
        return _numbers(expr, 1 + max(known, default=0))
    except (ValueError, JobError):
        raise JobError(f"cannot read ranks {expr!r}: use *, 0,3, 2-5, 0:8:2 or hosts=1,gpus=0:2") from None


def _numbers(text: str, size: int) -> set[int]:
    return parse_rank_list(text, size)


class DebugClient:
    def __init__(self, hostset: HostSet, run_id: str | None = None) -> None:
        """``hostset``: the reservation's agents (``Job.hostset()``); ``run_id``: that run's ranks (default: the newest)."""
        self.hs = hostset
        self.mb = self.hs.mb
        self.run_id = run_id
        self.name = f"{getpass.getuser()}@{socket.gethostname()} (pid {os.getpid()})"
        self.events: queue.Queue[Event] = queue.Queue()
        self._subscription: Subscription | None = None  # opened by the first attach
        self._rows: dict[int, PausedRank] = {}

    # ---------------------------------------------------------------- queries
    def list(self, everything: bool = False) -> builtins.list[PausedRank]:
        """Paused (or held, or just finished) ranks of the newest run that has any; all its ranks with ``everything``."""
        futs = [
            self.mb.request(h.agent, lambda cid: protocol.DebugList(cid, self.mb.address, everything))
            for h in self.hs.hosts
        ]
        rows: list[PausedRank] = []
        for host, fut in zip(self.hs.hosts, futs):
            rows += [PausedRank(agent=host.agent, **row) for row in fut.get(timeout=10)]
        newest = max(rows, key=lambda r: r.started, default=None)  # not by id: ids can tie within a second
        run = self.run_id or (newest.run_id if newest else None)
        rows = sorted((r for r in rows if r.run_id == run), key=lambda r: r.rank)
        self._rows = {r.rank: r for r in rows}
        return rows

    def _row(self, rank: int, everything: bool = False) -> PausedRank:
        if rank not in self._rows:
            self.list(everything)
        if rank not in self._rows:
            paused = ", ".join(str(r) for r in self._rows) or "none"
            raise JobError(f"rank {rank} is not paused in a breakpoint (paused ranks: {paused})")
        return self._rows[rank]

    def _ask(self, rank: int, request: Any, *args: Any) -> Future[Any]:
        """Send ``request`` (a :mod:`~monarch_cli.runtime.protocol` ``Debug*`` class) about ``rank``."""
        row = self._row(rank, everything=request is protocol.DebugDap)
        return self.mb.request(row.agent, lambda cid: request(cid, self.mb.address, row.run_id, rank, *args))

    @staticmethod
    def _get(fut: Future[Any], timeout: float) -> Any:
        try:
            return fut.get(timeout=timeout)
        except ActorError as e:
            raise JobError(str(e).split("\n")[0]) from None

    # ---------------------------------------------------------------- actions
    def attach(self, rank: int) -> dict[str, Any]:
        """Hold ``rank``: its pdb output now comes here. Returns what the user has not seen."""
        row = self._row(rank)
        if self._subscription is None:  # the held ranks' pdb output and states, whichever run they are in
            self._subscription = self.mb.subscribe(
                None,
                {
                    protocol.DebugOutput: lambda e, _: self.events.put(("output", e.rank, e.data, None)),
                    protocol.DebugState: lambda e, _: self.events.put(("state", e.rank, e.state, e.detail)),
                },
            )
        info = self._get(self._ask(rank, protocol.DebugAttach, self.name, settings().heartbeat_timeout), 10)
        self.mb.watch_agent(
            row.agent,
            lambda agent, silence: self.events.put(
                ("state", rank, "lost", f"host agent stopped answering ({silence:.0f} s)")
            ),
        )
        return info

    def send(self, rank: int, line: str) -> None:
        self._get(self._ask(rank, protocol.DebugInput, line if line.endswith("\n") else line + "\n"), 10)

    def detach(self, rank: int) -> None:
        try:
            self._get(self._ask(rank, protocol.DebugDetach), 10)
        except JobError:
            pass  # already gone: nothing to let go of

    def cast(self, ranks: set[int], command: str, timeout: float = 60.0) -> dict[int, Any]:
        """One pdb command to many ranks; each rank's output, or the reason it was refused."""
        futs: dict[int, Future[Any] | JobError] = {}
        for r in sorted(ranks):
            try:
                futs[r] = self._ask(r, protocol.DebugCast, command + "\n")
            except JobError as e:
                futs[r] = e
        out: dict[int, Any] = {}
        for r, fut in futs.items():
            try:
                out[r] = fut if isinstance(fut, JobError) else self._get(fut, timeout)
            except JobError as e:
                out[r] = e
        return out

    def continue_(self, ranks: set[int]) -> dict[int, str]:
        out: dict[int, str] = {}
        for r in sorted(ranks):
            try:
                out[r] = self._get(self._ask(r, protocol.DebugContinue), 10)
            except JobError as e:
                out[r] = f"error: {e}"
        return out

    def dap(self, rank: int, timeout: float = 60.0) -> DapRelay:
        """Connect ``rank``'s debugpy and open a port on this machine for an IDE (see :class:`DapRelay`)."""
        relay = DapRelay(self, rank)
        try:
            relay.bind(timeout)
        except BaseException:
            relay.close()
            raise
        return relay

    def close(self) -> None:
        for r in list(self._rows):
            self.mb.unwatch_agent(self._rows[r].agent)
        if self._subscription is not None:
            self._subscription.close()
            self._subscription = None


class DapRelay:
    """An IDE's way to one rank's debugpy: a loopback port here that only this user may use.

    Whole DAP messages go between the IDE and the rank over the reservation's authenticated
    runtime (the rank itself listens on no port). One IDE at a time; when it disconnects,
    the rank runs on without its breakpoints and the next IDE may attach. :meth:`serve`
    relays until the rank exits or :meth:`close`.
    """

    def __init__(self, client: DebugClient, rank: int) -> None:
        self.client = client
        self.rank = rank
        self.row = client._row(rank, everything=True)
        self.cwd = ""
        self._events: queue.Queue[tuple[str, Any]] = queue.Queue()
        mb = client.mb
        self._subscription = mb.subscribe(
            self.row.run_id,
            {
                protocol.DebugDapToIde: lambda e, _: self._events.put(("data", e.message)) if e.rank == rank else None,
                protocol.DebugDapClosed: lambda e, _: self._events.put(("closed", e.why)) if e.rank == rank else None,
            },
        )
        mb.watch_agent(
            self.row.agent,
            lambda agent, silence: self._events.put(("closed", f"its host agent stopped answering ({silence:.0f} s)")),
        )
        self.listener = listen_loopback()
        self.host, self.port = LOOPBACK, self.listener.getsockname()[1]
        self.ide: socket.socket | None = None
        self._frames = DapFrames()
        self._ide_said_bye = False
        self._bound = False
        self._ended: str | None = None

    def info(self) -> dict[str, Any]:
        return {"host": self.host, "port": self.port, "cwd": self.cwd}

    def bind(self, timeout: float = 60.0) -> None:
        """Route the rank's debugger here (first time: it connects; paused in pdb: pdb hands over)."""
        reply = self.client._get(self.client._ask(self.rank, protocol.DebugDap, settings().heartbeat_timeout), timeout)
        self.cwd = reply["cwd"]
        self._bound = True
        self._drain_stale()

    def serve(self, on_notice: Callable[[str], None] | None = None) -> str:
        """Relay IDE sessions until the rank's debugger goes away; returns why it ended."""
        say = on_notice or (lambda _msg: None)
        while self._ended is None:
            watch = [self.listener] + ([self.ide] if self.ide is not None else [])
            readable = ready_fds(watch, timeout=0.2)[0]
            if self.listener in readable:
                self._accept(say)
            if self.ide is not None and self.ide in readable:
                self._from_ide()
            self._to_ide()
        return self._ended

    def close(self) -> None:
        if self._bound and self._ended is None:
            self._end_ide_session()
        self.listener.close()
        mb = self.client.mb
        mb.unwatch_agent(self.row.agent)
        self._subscription.close()

    # --------------------------------------------------------------- private
    def _accept(self, say: Callable[[str], None]) -> None:
        conn, refused = accept_same_user(self.listener)
        if conn is None:
            say(refused or "refused a connection")
            return
        if self.ide is not None:
            conn.close()
            say("refused a second IDE connection: one IDE at a time per rank")
            return
        if not self._bound:  # the last IDE left: route the rank here again (pdb hands over if it paused)
            try:
                self.bind()
            except JobError as e:
                conn.close()
                self._ended = str(e)
                return
        self.ide, self._frames, self._ide_said_bye = conn, DapFrames(), False
        say(f"IDE attached to rank {self.rank}")

    def _from_ide(self) -> None:
        assert self.ide is not None
        try:
            data = self.ide.recv(1 << 16)
            messages = self._frames.feed(data) if data else []
        except (OSError, ValueError):
            data, messages = b"", []
        mb = self.client.mb
        for message in messages:
            self._ide_said_bye = self._ide_said_bye or is_goodbye(message)
            mb.send(self.row.agent, protocol.DebugDapData(0, mb.address, self.row.run_id, self.rank, message))
        if not data:
            self._end_ide_session()

    def _to_ide(self) -> None:
        while True:
            try:
                kind, what = self._events.get_nowait()
            except queue.Empty:
                return
            if kind == "closed":
                self._ended = f"rank {self.rank}'s debugger is gone: {what}"
                if self.ide is not None:
                    self.ide.close()
                    self.ide = None
                return
            if self.ide is not None:
                try:
                    self.ide.sendall(what)
                except OSError:
                    self._end_ide_session()

    def _end_ide_session(self) -> None:
        """The IDE left: a goodbye for the rank if it gave none, then unbind (its later output is dropped)."""
        mb = self.client.mb
        if self.ide is not None and not self._ide_said_bye:
            mb.send(self.row.agent, protocol.DebugDapData(0, mb.address, self.row.run_id, self.rank, GOODBYE))
        mb.send(self.row.agent, protocol.DebugDapEnd(0, mb.address, self.row.run_id, self.rank))
        if self.ide is not None:
            self.ide.close()
            self.ide = None
        self._bound = False

    def _drain_stale(self) -> None:
        """Drop rank output meant for an IDE that has left (a closed link still counts)."""
        keep = []
        while True:
            try:
                event = self._events.get_nowait()
            except queue.Empty:
                break
            if event[0] == "closed":
                keep.append(event)
        for event in keep:
            self._events.put(event)


def vscode_config(rank: int, dap: dict[str, Any]) -> dict[str, Any]:
    """A launch.json entry that attaches VS Code to the rank, paths mapped to this checkout."""
    return {
        "name": f"monarch: attach to rank {rank}",
        "type": "debugpy",
        "request": "attach",
        "connect": {"host": dap["host"], "port": dap["port"]},
        "pathMappings": [{"localRoot": "${workspaceFolder}", "remoteRoot": dap["cwd"]}],
        "justMyCode": False,
    }
