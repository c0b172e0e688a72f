"""The agent's side of ``monarch debug``: one session per rank, relayed to at most one client.

The agent keeps each rank's pdb transcript, so output produced while nobody was attached
(or after a client vanished) is replayed on the next attach. A rank is held by one client
at a time; others get a clear answer naming the holder. A holder that stops heartbeating
loses its holds, never the rank.

DAP: the rank's debugpy connects to a loopback listener here that accepts only this user's
sockets (see :mod:`..dap_link`); whole DAP messages then travel between that connection and
the ``monarch debug --dap`` client that has bound the rank, over the authenticated runtime.
"""

from __future__ import annotations

import dataclasses
import json
import socket
import sys
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from .. import protocol
from ..dap_link import GOODBYE, DapFrames, accept_same_user, listen_loopback

if TYPE_CHECKING:
    from .core import AgentCore

_PROMPTS = ("(Pdb) ", ">>> ", "... ")
_STEPS = {"n", "next", "s", "step", "unt", "until", "r", "return", "j", "jump"}
_TRANSCRIPT_CHARS = 1 << 18
_KEEP_EXITED = 600.0  # seconds a finished rank's session is remembered
_DAP_SEND_TIMEOUT = 2.0  # seconds a rank's debugpy may take to read what the IDE sent


@dataclasses.dataclass
class _Session:
    run_id: str
    rank: int
    owner: str
    sock: socket.socket | None
    coords: dict[str, int] = dataclasses.field(default_factory=dict)  # hosts (node), gpus (local rank)
    started: float = dataclasses.field(default_factory=time.time)  # orders runs (ids can tie in a second)
    pid: int | None = None
    state: str = "running"  # running | paused | exited
    where: dict[str, Any] = dataclasses.field(default_factory=dict)
    transcript: str = ""
    seen: int = 0  # transcript offset already sent to a user
    confirmed: int = 0  # offset a user surely saw (typed after it, or detached cleanly)
    holder: str | None = None
    holder_name: str = ""
    casts: list[tuple[int, str, int]] = dataclasses.field(default_factory=list)  # (cid, reply_to, offset)
    dap: list[tuple[int, str]] = dataclasses.field(default_factory=list)
    last_input: str = ""
    exit_how: str = ""
    ended_at: float | None = None
    dap_listener: socket.socket | None = None  # waiting for the rank's debugpy to connect
    dap_sock: socket.socket | None = None  # the rank's debugpy
    dap_frames: DapFrames = dataclasses.field(default_factory=DapFrames)
    dap_pending: list[bytes] = dataclasses.field(default_factory=list)  # from the IDE, before the rank connected
    dap_client: str | None = None  # the `monarch debug --dap` relay bound to this rank
    dap_lost: str = ""

    def describe(self, host: str) -> dict[str, Any]:
        return {
            "run_id": self.run_id,
            "rank": self.rank,
            "host": host,
            "pid": self.pid,
            "state": self.state,
            "file": self.where.get("file"),
            "line": self.where.get("line"),
            "function": self.where.get("function"),
            "reason": self.where.get("reason"),
            "holder": self.holder_name or None,
            "exit": self.exit_how or None,
            "coords": dict(self.coords),
            "started": self.started,
        }


class DebugHost:
    def __init__(self, agent: AgentCore) -> None:
        self.agent = agent
        self.sessions: dict[tuple[str, int], _Session] = {}
        self.by_fd: dict[int, _Session] = {}

    # ------------------------------------------------------------ rank side
    def add(self, run_id: str, rank: int, owner: str, sock: socket.socket, coords: dict[str, int]) -> None:
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
        if session.sock is None or fd != session.sock.fileno():
            self._dap_readable(session, fd)
            return True
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
            try:
                msg = json.loads(data)
            except ValueError:  # a rank's packet that is not one message: its own bug, not the agent's end
                print(f"monarch agent: an unreadable debugger message from pid {session.pid}", file=sys.stderr)
                continue
            self._from_rank(session, msg)
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
        self._dap_close(session, f"rank {rank} exited ({how})")
        if session.holder:
            self.agent.send(session.holder, protocol.DebugState(run_id, rank, "exited", how))

    def _from_rank(self, s: _Session, msg: Any) -> None:
        """One :data:`~..protocol.RankDebugMessage` from the rank's debugger channel."""
        kind = msg["type"]
        if kind == "exiting":  # the rank's last word: its status, before the kernel tears it down
            if s.pid is not None:
                self.agent.ranks.exiting(s.pid, int(msg["status"]), bool(msg.get("kept")))
            return
        if kind == "output":
            s.transcript += msg["data"]
            if len(s.transcript) > _TRANSCRIPT_CHARS:
                cut = len(s.transcript) - _TRANSCRIPT_CHARS
                s.transcript, s.seen = s.transcript[cut:], max(0, s.seen - cut)
                s.confirmed = max(0, s.confirmed - cut)
                s.casts = [(c, r, max(0, o - cut)) for c, r, o in s.casts]
            if s.holder:
                self.agent.send(s.holder, protocol.DebugOutput(s.run_id, s.rank, msg["data"]))
                s.seen = len(s.transcript)
            if s.transcript.endswith(_PROMPTS):
                self._finish_casts(s)
        elif kind == "paused":
            was = s.state
            s.state, s.where = "paused", {k: msg[k] for k in ("file", "line", "function", "reason")}
            stepping = s.last_input.split(" ")[0] in _STEPS
            if was != "paused" and not stepping:
                self.agent.send(s.owner, protocol.RankPaused(s.run_id, s.rank, self.agent.host, dict(s.where)))
            if s.holder:
                self.agent.send(s.holder, protocol.DebugState(s.run_id, s.rank, "paused", dict(s.where)))
        elif kind == "resumed":
            s.state = "running"
            if s.last_input.split(" ")[0] not in _STEPS:  # a step pauses again at once: wait for that
                self._finish_casts(s)
                if s.holder:
                    self.agent.send(s.holder, protocol.DebugState(s.run_id, s.rank, "running", ""))
        elif kind in ("dap_ready", "dap_error"):
            ok = kind == "dap_ready"
            if not ok:
                self._dap_close(s, msg["error"])
            value = {"cwd": msg["cwd"]} if ok else msg["error"]
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

    def _to_rank(self, s: _Session, msg: protocol.AgentDebugMessage) -> None:
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
    def handlers(self) -> dict[type, Callable[[Any, list[Any]], None]]:
        """The messages this part of the agent answers (``monarch debug``'s requests)."""
        on_rank = lambda m, _: self._on_rank_request(m)  # noqa: E731
        return {
            protocol.DebugList: lambda m, _: self._list(m),
            **{
                cls: on_rank
                for cls in (
                    protocol.DebugAttach,
                    protocol.DebugDetach,
                    protocol.DebugInput,
                    protocol.DebugCast,
                    protocol.DebugContinue,
                    protocol.DebugDap,
                    protocol.DebugDapData,
                    protocol.DebugDapEnd,
                )
            },
        }

    def _list(self, msg: protocol.DebugList) -> None:
        rows = [
            s.describe(self.agent.host)
            for s in self.sessions.values()
            if msg.everything or s.state != "running" or s.holder
        ]
        self.agent.reply(msg.reply_to, msg.cid, True, rows)

    def _on_rank_request(self, msg: Any) -> None:
        """One request about one rank's session (every such message has run_id and rank)."""
        kind, cid, reply_to, run_id, rank = msg.KIND, msg.cid, msg.reply_to, msg.run_id, msg.rank
        s = self.sessions.get((run_id, rank))
        if s is None:
            self.agent.reply(reply_to, cid, False, f"rank {rank} of run {run_id} is not on host {self.agent.host}")
            return
        if kind == "debug_continue" and s.state != "paused" and (not s.holder or s.holder == reply_to):
            done = f"already finished ({s.exit_how})" if s.state == "exited" else f"not paused (it is {s.state})"
            self.agent.reply(reply_to, cid, True, f"rank {rank} {done}; nothing to continue")
            return
        error = self._refuse(kind, s, reply_to)
        if error:
            self.agent.reply(reply_to, cid, False, error)
            return
        if kind == "debug_attach":
            s.holder, s.holder_name = reply_to, msg.holder_name
            self.agent.register_client(reply_to, msg.heartbeat_timeout)
            unseen = s.transcript[s.seen :] or (s.transcript.rsplit("\n", 1)[-1] if s.state == "paused" else "")
            s.seen = s.confirmed = len(s.transcript)
            self.agent.reply(reply_to, cid, True, {"unseen": unseen, "state": s.state, "where": dict(s.where)})
        elif kind == "debug_detach":
            if s.holder == reply_to:
                s.holder, s.holder_name = None, ""
                s.confirmed = s.seen
            self.agent.reply(reply_to, cid, True, None)
        elif kind == "debug_input":
            s.last_input = msg.line.strip()
            s.confirmed = s.seen
            self._to_rank(s, {"type": "input", "line": msg.line})
            self.agent.reply(reply_to, cid, True, None)
        elif kind == "debug_cast":
            s.last_input = msg.line.strip()
            s.casts.append((cid, reply_to, len(s.transcript)))
            self._to_rank(s, {"type": "input", "line": msg.line})
        elif kind == "debug_continue":
            s.last_input = "continue"
            self._to_rank(s, {"type": "input", "line": "continue\n"})
            self.agent.reply(reply_to, cid, True, "continued")
        elif kind == "debug_dap":
            self._dap_bind(s, cid, reply_to, msg.heartbeat_timeout)
        elif kind == "debug_dap_data":
            if s.dap_client == reply_to:
                self._dap_to_rank(s, msg.message)
        elif kind == "debug_dap_end":
            if s.dap_client == reply_to:
                s.dap_client = None

    # ------------------------------------------------------------------- DAP
    def _dap_bind(self, s: _Session, cid: int, client: str, heartbeat_timeout: float) -> None:
        """Route the rank's debugpy to ``client`` (connecting it first if this is the first IDE)."""
        if s.dap_client is not None and s.dap_client != client:
            self.agent.reply(
                client,
                cid,
                False,
                f"rank {s.rank} is already relayed to an IDE by another `monarch debug --dap`; stop that one first",
            )
            return
        if s.dap_lost:
            self.agent.reply(client, cid, False, f"rank {s.rank}'s debugger link is gone ({s.dap_lost})")
            return
        s.dap_client = client
        self.agent.register_client(client, heartbeat_timeout)
        s.dap.append((cid, client))
        port = 0  # the rank's debugpy is connected (or connecting) already: this IDE reuses that link
        if s.dap_sock is None and s.dap_listener is None:
            s.dap_listener = listen_loopback()
            self.by_fd[s.dap_listener.fileno()] = s
            self.agent.watch_fd(s.dap_listener.fileno())
            port = s.dap_listener.getsockname()[1]
        self._to_rank(s, {"type": "dap", "port": port, "handoff": s.state == "paused"})

    def _dap_readable(self, s: _Session, fd: int) -> None:
        if s.dap_listener is not None and fd == s.dap_listener.fileno():
            conn, refused = accept_same_user(s.dap_listener)
            if conn is None:
                print(f"monarch agent: rank {s.rank}: {refused}", file=sys.stderr, flush=True)
                return
            self._unwatch(s.dap_listener)
            s.dap_listener.close()
            s.dap_listener = None
            conn.settimeout(_DAP_SEND_TIMEOUT)
            s.dap_sock = conn
            self.by_fd[conn.fileno()] = s
            self.agent.watch_fd(conn.fileno())
            pending, s.dap_pending = s.dap_pending, []
            for message in pending:
                self._dap_to_rank(s, message)
            return
        if s.dap_sock is None or fd != s.dap_sock.fileno():
            return
        try:
            data = s.dap_sock.recv(1 << 16)
            messages = s.dap_frames.feed(data) if data else []
        except (OSError, ValueError) as e:
            data, messages = b"", []
            print(f"monarch agent: rank {s.rank}: debugger link: {e}", file=sys.stderr, flush=True)
        if s.dap_client is not None:
            for message in messages:
                self.agent.send(s.dap_client, protocol.DebugDapToIde(s.run_id, s.rank, message))
        if not data:
            self._dap_close(s, "the rank's debugger closed its connection")

    def _dap_to_rank(self, s: _Session, message: bytes) -> None:
        if s.dap_sock is None:
            if s.dap_listener is not None:
                s.dap_pending.append(message)  # the rank is connecting: keep it for then
            return
        try:
            s.dap_sock.sendall(message)
        except OSError as e:
            self._dap_close(s, f"the rank's debugger stopped reading ({e})")

    def _dap_close(self, s: _Session, why: str) -> None:
        """The rank's debugger link is over: tell the relay bound to it, and free the sockets."""
        for sock in (s.dap_listener, s.dap_sock):
            if sock is not None:
                self._unwatch(sock)
                sock.close()
        if s.dap_sock is not None or s.dap_listener is not None:
            s.dap_lost = why
        s.dap_listener = s.dap_sock = None
        if s.dap_client is not None:
            self.agent.send(s.dap_client, protocol.DebugDapClosed(s.run_id, s.rank, why))
            s.dap_client = None

    def _unwatch(self, sock: socket.socket) -> None:
        self.by_fd.pop(sock.fileno(), None)
        self.agent.unwatch_fd(sock.fileno())

    def _refuse(self, kind: str, s: _Session, client: str) -> str | None:
        """Why ``client`` may not do ``kind`` on this rank now, or None."""
        if s.state == "exited" and kind != "debug_detach":
            return f"rank {s.rank} has finished ({s.exit_how})"
        if (
            s.holder
            and s.holder != client
            and kind not in ("debug_detach", "debug_dap", "debug_dap_data", "debug_dap_end")
        ):
            return f"rank {s.rank} is attached by {s.holder_name}; detach there first"
        if kind in ("debug_cast", "debug_input") and s.state != "paused":
            return f"rank {s.rank} is not paused (it is {s.state})"
        return None

    def client_gone(self, client: str) -> None:
        """A holder vanished: release its ranks, and show its undelivered output to the next one.

        A vanished DAP relay's IDE never said goodbye: the rank's debugger is told, so its
        breakpoints go and its threads run on, as when an IDE disconnects."""
        for s in self.sessions.values():
            if s.holder == client:
                s.holder, s.holder_name = None, ""
                s.seen = s.confirmed
            s.casts = [c for c in s.casts if c[1] != client]
            if s.dap_client == client:
                s.dap_client = None
                self._dap_to_rank(s, GOODBYE)
