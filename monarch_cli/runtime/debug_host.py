"""The agent's side of ``monarch debug``: one session per rank, relayed to at most one client.

The agent keeps each rank's pdb transcript, so output produced while nobody was attached
(or after a client vanished) is replayed on the next attach. A rank is held by one client
at a time; others get a clear answer naming the holder. A holder that stops heartbeating
loses its holds, never the rank.
"""

from __future__ import annotations

import dataclasses
import json
import socket
import time
from typing import TYPE_CHECKING, Any, Dict, List, Optional, Tuple

if TYPE_CHECKING:
    from .agent import HostAgent

_PROMPTS = ("(Pdb) ", ">>> ", "... ")
_STEPS = {"n", "next", "s", "step", "unt", "until", "r", "return", "j", "jump"}
_TRANSCRIPT_CHARS = 1 << 18
_KEEP_EXITED = 600.0  # seconds a finished rank's session is remembered


@dataclasses.dataclass
class _Session:
    run_id: str
    rank: int
    owner: str
    sock: Optional[socket.socket]
    coords: Dict[str, int] = dataclasses.field(default_factory=dict)  # hosts (node), gpus (local rank)
    started: float = dataclasses.field(default_factory=time.time)  # orders runs (ids can tie in a second)
    pid: Optional[int] = None
    state: str = "running"  # running | paused | exited
    where: Dict[str, Any] = dataclasses.field(default_factory=dict)
    transcript: str = ""
    seen: int = 0  # transcript offset already sent to a user
    confirmed: int = 0  # offset a user surely saw (typed after it, or detached cleanly)
    holder: Optional[str] = None
    holder_name: str = ""
    casts: List[Tuple[int, str, int]] = dataclasses.field(default_factory=list)  # (cid, reply_to, offset)
    dap: List[Tuple[int, str]] = dataclasses.field(default_factory=list)
    last_input: str = ""
    exit_how: str = ""
    ended_at: Optional[float] = None

    def describe(self, host: str) -> Dict[str, Any]:
        return {
            "run_id": self.run_id, "rank": self.rank, "host": host, "pid": self.pid, "state": self.state,
            "file": self.where.get("file"), "line": self.where.get("line"),
            "function": self.where.get("function"), "reason": self.where.get("reason"),
            "holder": self.holder_name or None, "exit": self.exit_how or None, "coords": dict(self.coords),
            "started": self.started,
        }


class DebugHost:
    def __init__(self, agent: "HostAgent") -> None:
        self.agent = agent
        self.sessions: Dict[Tuple[str, int], _Session] = {}
        self.by_fd: Dict[int, _Session] = {}

    # ------------------------------------------------------------ rank side
    def add(self, run_id: str, rank: int, owner: str, sock: socket.socket, coords: Dict[str, int]) -> None:
        sock.setblocking(False)
        session = _Session(run_id, rank, owner, sock, coords)
        self.sessions[(run_id, rank)] = session
        self.by_fd[sock.fileno()] = session
        self.agent.watch_fd(sock.fileno())
        self._prune()

    def set_pid(self, run_id: str, rank: int, pid: int) -> None:
        session = self.sessions.get((run_id, rank))
        if session is not None:
            session.pid = pid

    def readable(self, fd: int) -> bool:
        session = self.by_fd.get(fd)
        if session is None:
            return False
        while session.sock is not None:
            try:
                data = session.sock.recv(1 << 16)
            except BlockingIOError:
                return True
            except OSError:
                data = b""
            if not data:
                self._close(session)
                return True
            self._from_rank(session, json.loads(data))
        return True

    def rank_exited(self, run_id: str, rank: int, how: str) -> None:
        session = self.sessions.get((run_id, rank))
        if session is None:
            return
        if session.sock is not None:
            self.readable(session.sock.fileno())  # whatever it said last still counts
        session.state, session.exit_how, session.ended_at = "exited", how, time.monotonic()
        self._close(session)
        for cid, reply_to, _ in session.casts:
            self.agent.reply(reply_to, cid, False, f"rank {rank} exited ({how}) before answering")
        session.casts.clear()
        for cid, reply_to in session.dap:
            self.agent.reply(reply_to, cid, False, f"rank {rank} exited ({how})")
        session.dap.clear()
        if session.holder:
            self.agent.send(session.holder, ("event", "debug_state", run_id, rank, "exited", how))

    def _from_rank(self, s: _Session, msg: Dict[str, Any]) -> None:
        kind = msg["type"]
        if kind == "output":
            s.transcript += msg["data"]
            if len(s.transcript) > _TRANSCRIPT_CHARS:
                cut = len(s.transcript) - _TRANSCRIPT_CHARS
                s.transcript, s.seen = s.transcript[cut:], max(0, s.seen - cut)
                s.confirmed = max(0, s.confirmed - cut)
                s.casts = [(c, r, max(0, o - cut)) for c, r, o in s.casts]
            if s.holder:
                self.agent.send(s.holder, ("event", "debug_output", s.run_id, s.rank, msg["data"]))
                s.seen = len(s.transcript)
            if s.transcript.endswith(_PROMPTS):
                self._finish_casts(s)
        elif kind == "paused":
            was = s.state
            s.state, s.where = "paused", {k: msg[k] for k in ("file", "line", "function", "reason")}
            stepping = s.last_input.split(" ")[0] in _STEPS
            if was != "paused" and not stepping:
                self.agent.send(s.owner, ("event", "rank_paused", s.run_id, s.rank, self.agent.host, dict(s.where)))
            if s.holder:
                self.agent.send(s.holder, ("event", "debug_state", s.run_id, s.rank, "paused", dict(s.where)))
        elif kind == "resumed":
            s.state = "running"
            if s.last_input.split(" ")[0] not in _STEPS:  # a step pauses again at once: wait for that
                self._finish_casts(s)
                if s.holder:
                    self.agent.send(s.holder, ("event", "debug_state", s.run_id, s.rank, "running", ""))
        elif kind in ("dap_ready", "dap_error"):
            ok = kind == "dap_ready"
            value = {k: msg[k] for k in ("host", "port", "cwd")} if ok else msg["error"]
            for cid, reply_to in s.dap:
                self.agent.reply(reply_to, cid, ok, value)
            s.dap.clear()

    def _finish_casts(self, s: _Session) -> None:
        for cid, reply_to, offset in s.casts:
            text = s.transcript[offset:]
            for prompt in _PROMPTS:
                if text.endswith(prompt):
                    text = text[: -len(prompt)]
                    break
            self.agent.reply(reply_to, cid, True, {"output": text, "state": s.state, "where": dict(s.where)})
        if s.casts and not s.holder:
            s.seen = s.confirmed = len(s.transcript)
        s.casts.clear()

    def _close(self, s: _Session) -> None:
        if s.sock is None:
            return
        fd = s.sock.fileno()
        self.by_fd.pop(fd, None)
        self.agent.unwatch_fd(fd)
        s.sock.close()
        s.sock = None

    def _to_rank(self, s: _Session, msg: Dict[str, Any]) -> None:
        if s.sock is not None:
            s.sock.setblocking(True)
            try:
                s.sock.send(json.dumps(msg).encode())
            finally:
                s.sock.setblocking(False)

    def _prune(self) -> None:
        now = time.monotonic()
        for key, s in list(self.sessions.items()):
            if s.ended_at is not None and now - s.ended_at > _KEEP_EXITED:
                del self.sessions[key]

    # ----------------------------------------------------------- client side
    def handle(self, header: Tuple[Any, ...]) -> bool:
        """Serve one ``debug_*`` request; False if ``header`` is not one."""
        kind = header[0]
        if not kind.startswith("debug_"):
            return False
        cid, reply_to = header[1], header[2]
        if kind == "debug_list":
            everything = len(header) > 3 and header[3]
            rows = [s.describe(self.agent.host) for s in self.sessions.values()
                    if everything or s.state != "running" or s.holder]
            self.agent.reply(reply_to, cid, True, rows)
            return True
        run_id, rank = header[3], header[4]
        s = self.sessions.get((run_id, rank))
        if s is None:
            self.agent.reply(reply_to, cid, False, f"rank {rank} of run {run_id} is not on host {self.agent.host}")
            return True
        if kind == "debug_continue" and s.state != "paused" and (not s.holder or s.holder == reply_to):
            done = f"already finished ({s.exit_how})" if s.state == "exited" else f"not paused (it is {s.state})"
            self.agent.reply(reply_to, cid, True, f"rank {rank} {done}; nothing to continue")
            return True
        error = self._refuse(kind, s, reply_to)
        if error:
            self.agent.reply(reply_to, cid, False, error)
            return True
        if kind == "debug_attach":
            s.holder, s.holder_name = reply_to, header[5]
            self.agent.register_client(reply_to, header[6])
            unseen = s.transcript[s.seen:] or (s.transcript.rsplit("\n", 1)[-1] if s.state == "paused" else "")
            s.seen = s.confirmed = len(s.transcript)
            self.agent.reply(reply_to, cid, True, {"unseen": unseen, "state": s.state, "where": dict(s.where)})
        elif kind == "debug_detach":
            if s.holder == reply_to:
                s.holder, s.holder_name = None, ""
                s.confirmed = s.seen
            self.agent.reply(reply_to, cid, True, None)
        elif kind == "debug_input":
            s.last_input = header[5].strip()
            s.confirmed = s.seen
            self._to_rank(s, {"type": "input", "line": header[5]})
            self.agent.reply(reply_to, cid, True, None)
        elif kind == "debug_cast":
            s.last_input = header[5].strip()
            s.casts.append((cid, reply_to, len(s.transcript)))
            self._to_rank(s, {"type": "input", "line": header[5]})
        elif kind == "debug_continue":
            s.last_input = "continue"
            self._to_rank(s, {"type": "input", "line": "continue\n"})
            self.agent.reply(reply_to, cid, True, "continued")
        elif kind == "debug_dap":
            from ..config import advertised_host

            s.dap.append((cid, reply_to))
            self._to_rank(s, {"type": "dap", "host": advertised_host(), "handoff": s.state == "paused"})
        return True

    def _refuse(self, kind: str, s: _Session, client: str) -> Optional[str]:
        """Why ``client`` may not do ``kind`` on this rank now, or None."""
        if s.state == "exited" and kind != "debug_detach":
            return f"rank {s.rank} has finished ({s.exit_how})"
        if s.holder and s.holder != client and kind not in ("debug_detach", "debug_dap"):
            return f"rank {s.rank} is attached by {s.holder_name}; detach there first"
        if kind in ("debug_cast", "debug_input") and s.state != "paused":
            return f"rank {s.rank} is not paused (it is {s.state})"
        return None

    def client_gone(self, client: str) -> None:
        """A holder vanished: release its ranks, and show its undelivered output to the next one."""
        for s in self.sessions.values():
            if s.holder == client:
                s.holder, s.holder_name = None, ""
                s.seen = s.confirmed
            s.casts = [c for c in s.casts if c[1] != client]
