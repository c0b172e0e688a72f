"""The client side of ``monarch debug``: find paused ranks, attach, cast, continue, DAP.

Talks to every host agent of the reservation with the reservation's keys; any number of
clients may look, one at a time may hold a rank.
"""

from __future__ import annotations

import dataclasses
import getpass
import os
import queue
import socket
from typing import TYPE_CHECKING, Any, Dict, List, Optional, Set, Tuple

from ..config import settings
from ..runtime.errors import ActorError
from ..runtime.future import Future
from .errors import JobError
from .ranks import parse_rank_list

if TYPE_CHECKING:  # the job (and the runtime) load when a client is made, not when the CLI starts
    from .job import Job

Event = Tuple[str, int, str, Any]  # (kind, rank, what, detail): ("output", 3, text, None), ("state", 3, "paused", where)


@dataclasses.dataclass
class PausedRank:
    run_id: str
    rank: int
    host: str
    agent: str
    pid: Optional[int]
    state: str
    file: Optional[str]
    line: Optional[int]
    function: Optional[str]
    reason: Optional[str]
    holder: Optional[str]
    exit: Optional[str]
    coords: Dict[str, int]
    started: float = 0.0

    @property
    def where(self) -> str:
        return f"{self.file}:{self.line}" if self.file else "-"

    def to_json(self) -> Dict[str, Any]:
        return {k: v for k, v in dataclasses.asdict(self).items() if k != "agent"}


def select_ranks(expr: str, rows: List[PausedRank]) -> Set[int]:
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


def _numbers(text: str, size: int) -> Set[int]:
    return parse_rank_list(text, size)


class DebugClient:
    def __init__(self, job: "Job", run_id: Optional[str] = None) -> None:
        self.job = job
        self.hs = job._hostset()
        self.mb = self.hs.mb
        self.run_id = run_id
        self.name = f"{getpass.getuser()}@{socket.gethostname()} (pid {os.getpid()})"
        self.events: "queue.Queue[Event]" = queue.Queue()
        self.mb.event_handlers["debug_output"] = lambda h, f: self.events.put(("output", h[3], h[4], None))
        self.mb.event_handlers["debug_state"] = lambda h, f: self.events.put(("state", h[3], h[4], h[5]))
        self._rows: Dict[int, PausedRank] = {}

    # ---------------------------------------------------------------- queries
    def list(self, everything: bool = False) -> List[PausedRank]:
        """Paused (or held, or just finished) ranks of the newest run that has any; all its ranks with ``everything``."""
        futs = [self.mb.request(h.agent, lambda cid: ("debug_list", cid, self.mb.address, everything))
                for h in self.hs.hosts]
        rows: List[PausedRank] = []
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

    def _ask(self, rank: int, kind: str, *args: Any) -> Future[Any]:
        row = self._row(rank, everything=kind == "debug_dap")
        return self.mb.request(row.agent, lambda cid: (kind, cid, self.mb.address, row.run_id, rank, *args))

    @staticmethod
    def _get(fut: Future[Any], timeout: float) -> Any:
        try:
            return fut.get(timeout=timeout)
        except ActorError as e:
            raise JobError(str(e).split("\n")[0]) from None

    # ---------------------------------------------------------------- actions
    def attach(self, rank: int) -> Dict[str, Any]:
        """Hold ``rank``: its pdb output now comes here. Returns what the user has not seen."""
        row = self._row(rank)
        info = self._get(self._ask(rank, "debug_attach", self.name, settings().heartbeat_timeout), 10)
        heartbeat = self.hs.infos[[h.agent for h in self.hs.hosts].index(row.agent)]["heartbeat"]
        self.mb.watch_agent(row.agent, heartbeat, lambda agent, silence: self.events.put(
            ("state", rank, "lost", f"host agent stopped answering ({silence:.0f} s)")))
        return info

    def send(self, rank: int, line: str) -> None:
        self._get(self._ask(rank, "debug_input", line if line.endswith("\n") else line + "\n"), 10)

    def detach(self, rank: int) -> None:
        try:
            self._get(self._ask(rank, "debug_detach"), 10)
        except JobError:
            pass  # already gone: nothing to let go of

    def cast(self, ranks: Set[int], command: str, timeout: float = 60.0) -> Dict[int, Any]:
        """One pdb command to many ranks; each rank's output, or the reason it was refused."""
        futs = {}
        for r in sorted(ranks):
            try:
                futs[r] = self._ask(r, "debug_cast", command + "\n")
            except JobError as e:
                futs[r] = e
        out: Dict[int, Any] = {}
        for r, fut in futs.items():
            try:
                out[r] = fut if isinstance(fut, JobError) else self._get(fut, timeout)
            except JobError as e:
                out[r] = e
        return out

    def continue_(self, ranks: Set[int]) -> Dict[int, str]:
        out: Dict[int, str] = {}
        for r in sorted(ranks):
            try:
                out[r] = self._get(self._ask(r, "debug_continue"), 10)
            except JobError as e:
                out[r] = f"error: {e}"
        return out

    def dap(self, rank: int, timeout: float = 60.0) -> Dict[str, Any]:
        """Make ``rank`` listen for a DAP client (debugpy); its address and working directory."""
        return self._get(self._ask(rank, "debug_dap"), timeout)

    def close(self) -> None:
        for r in list(self._rows):
            self.mb.unwatch_agent(self._rows[r].agent)
        for kind in ("debug_output", "debug_state"):
            self.mb.event_handlers.pop(kind, None)


def vscode_config(rank: int, dap: Dict[str, Any]) -> Dict[str, Any]:
    """A launch.json entry that attaches VS Code to the rank, paths mapped to this checkout."""
    return {
        "name": f"monarch: attach to rank {rank}",
        "type": "debugpy",
        "request": "attach",
        "connect": {"host": dap["host"], "port": dap["port"]},
        "pathMappings": [{"localRoot": "${workspaceFolder}", "remoteRoot": dap["cwd"]}],
        "justMyCode": False,
    }
