"""The agent's side of the actor API: fork procs for a client, report each exit to its owner,
stop them on request (SIGTERM, then SIGKILL after the grace) and kill them when their owner
goes."""

from __future__ import annotations

import dataclasses
import os
import signal
import sys
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import zmq

from ...sysutil import signal_if_alive as _signal
from .. import protocol
from ..errors import Failure
from ..transport import wire

if TYPE_CHECKING:
    from .core import AgentCore


@dataclasses.dataclass
class _Proc:
    proc_id: str
    owner: str
    pid: int
    stopping: bool = False
    kill_at: float | None = None
    cause: str = ""


class ProcHost:
    def __init__(self, agent: AgentCore) -> None:
        self.agent = agent
        self.by_pid: dict[int, _Proc] = {}
        self.forking: dict[int, tuple[str, str]] = {}  # fork request -> (proc_id, owner)
        self.stops: list[tuple[int, str, set[str]]] = []  # (call id, reply to, proc ids left)
        self.relayed: dict[str, zmq.Socket | None] = {}  # relayed proc -> our connection to its inbox

    def handlers(self) -> dict[type, Callable[[Any, list[Any]], None]]:
        """The messages this part of the agent answers."""
        return {
            protocol.SpawnProcs: self._on_spawn,
            protocol.StopProcs: lambda m, _: self._stop(m.cid, m.reply_to, set(m.proc_ids), m.grace),
            protocol.RelayToProc: self._relay_to_proc,
            protocol.RelayToClient: lambda m, body: self.agent.send_frames(m.client, body),
        }

    def _on_spawn(self, msg: protocol.SpawnProcs, body: list[Any]) -> None:
        specs, client_settings, import_context = wire.loads(body)
        self._spawn(msg.reply_to, specs, client_settings, import_context, msg.relay)
        self.agent.reply(msg.reply_to, msg.cid, True, None)

    def _spawn(
        self,
        owner: str,
        specs: list[tuple[str, int]],
        client_settings: dict[str, Any],
        import_context: dict[str, Any],
        relay: bool,
    ) -> None:
        agent = self.agent
        agent.register_client(owner, float(client_settings.get("heartbeat_timeout", 5.0)))
        for proc_id, ready_cid in specs:
            req = agent.next_request()
            boot: protocol.ProcBoot = {
                "keys": agent.keys.encode(),
                "proc_id": proc_id,
                "ready_call_id": ready_cid,
                "owner": owner,
                "agent": agent.address,
                "host": agent.host,
                "settings": client_settings,
                "import": import_context,
                "relay": relay,
            }
            self.forking[req] = (proc_id, owner)
            if relay:
                self.relayed[proc_id] = None
            agent.fork_server().fork(req, boot)

    # ------------------------------------------------------------------ events
    def forked(self, req: int, pid: int) -> bool:
        entry = self.forking.pop(req, None)
        if entry is None:
            return False
        self.by_pid[pid] = _Proc(entry[0], entry[1], pid)
        return True

    def exited(self, pid: int, status: int) -> bool:
        proc = self.by_pid.pop(pid, None)
        if proc is None:
            return False
        failure = Failure(
            proc=proc.proc_id,
            host=self.agent.host,
            pid=pid,
            exitcode=os.WEXITSTATUS(status) if os.WIFEXITED(status) else None,
            signal=os.WTERMSIG(status) if os.WIFSIGNALED(status) else None,
            reason="stopped" if proc.stopping else proc.cause,
        )
        self._unrelay(proc.proc_id)
        self.agent.send(proc.owner, protocol.ProcExited(proc.proc_id, failure, proc.stopping))
        for _, _, left in self.stops:
            left.discard(proc.proc_id)
        return True

    def zygote_died(self, cause: str) -> None:
        """The fork server died: its procs (dying with it) are reported with ``cause``, and
        those it never forked are reported now."""
        for proc in self.by_pid.values():
            proc.cause = cause
        for proc_id, owner in self.forking.values():
            failure = Failure(proc_id, self.agent.host, None, reason=cause)
            self._unrelay(proc_id)
            self.agent.send(owner, protocol.ProcExited(proc_id, failure, False))
        self.forking.clear()

    # ------------------------------------------------------------------ relaying
    def _relay_to_proc(self, msg: protocol.RelayToProc, body: list[Any]) -> None:
        """Pass a client's message, frames as they are, to a proc of ours it cannot reach."""
        if msg.proc_id not in self.relayed:
            return  # not ours, or it has exited: its owner was told with a proc_exit
        sock = self.relayed[msg.proc_id]
        if sock is None:
            sock = self.relayed[msg.proc_id] = self.agent.transport.dealer(msg.inbox)
        sock.send_multipart(body, copy=False)

    def _unrelay(self, proc_id: str) -> None:
        sock = self.relayed.pop(proc_id, None)
        if sock is not None:
            sock.close(linger=0)

    # ---------------------------------------------------------------- stopping
    def _stop(self, cid: int, reply_to: str, proc_ids: set[str], grace: float) -> None:
        deadline = time.monotonic() + grace
        for p in self.by_pid.values():
            if p.proc_id in proc_ids and not p.stopping:
                p.stopping = True
                p.kill_at = deadline
                _signal(p.pid, signal.SIGTERM)
        live = {p.proc_id for p in self.by_pid.values()}
        self.stops.append((cid, reply_to, proc_ids & live))

    def tick(self) -> None:
        """SIGKILL procs past their stop grace; answer stop requests whose procs are all gone."""
        now = time.monotonic()
        for p in self.by_pid.values():
            if p.kill_at is not None and now >= p.kill_at:
                _signal(p.pid, signal.SIGKILL)
                p.kill_at = None
        for cid, reply_to, _ in [s for s in self.stops if not s[2]]:
            self.agent.reply(reply_to, cid, True, None)
        self.stops = [s for s in self.stops if s[2]]

    def reap_owner(self, owner: str, why: str) -> None:
        victims = [p for p in self.by_pid.values() if p.owner == owner]
        if victims and why != "client exited":
            print(f"monarch agent: {why}; killing its {len(victims)} proc(s)", file=sys.stderr, flush=True)
        for p in victims:
            p.stopping = True
            _signal(p.pid, signal.SIGKILL)

    def kill_all(self) -> None:
        for p in self.by_pid.values():
            _signal(p.pid, signal.SIGKILL)
