"""The local backend: N host agents on this machine, each acting as a separate host.

Each agent has its own name (``local0``, ``local1``...), so it gets its own GROUP_RANK
and rank range, which makes multi-node logic testable on a laptop. Agents run in their
own sessions and outlive the CLI that started them, named after their reservation in
``ps``; they are found through the address files they write, like agents on a cluster.
Each registers itself (:mod:`..runtime.agent.registry`), so ``stop --force`` finds it
even when the state file is unreadable, and exits on its own once the state file no
longer records its reservation (deleted, or replaced by another).
"""

from __future__ import annotations

import os
import shlex
import shutil
import signal
import time
from pathlib import Path
from typing import TYPE_CHECKING

from ...config import KEYS_ENV, EnvSettings
from ...errors import SchedulerError
from ...runtime.launch.command import AgentCommand, is_agent_command
from ...sysutil import signal_if_alive
from ..agents import read_address_files, wait_for_agents
from ..base import (
    HostRecord,
    Liveness,
    Plan,
    Probe,
    Progress,
    Reservation,
    ReservationRecord,
    ReserveRequest,
    Scheduler,
)

if TYPE_CHECKING:
    from ...runtime.transport.keys import Keys

#: How long agents may take to listen (they import torch to warm up, on a busy laptop).
AGENT_START_TIMEOUT = 60.0


class LocalScheduler(Scheduler):
    name = "local"
    options = ()

    def max_hosts(self) -> int:
        """Local "hosts" are agents on this machine (about 50 MB each, agent and warm process): 128
        at least (a scale rehearsal on a laptop), 16 per core beyond that."""
        return max(128, 16 * (os.cpu_count() or 1))

    def plan(self, request: ReserveRequest, workdir: Path) -> Plan:
        import uuid  # plan() (serve) only: every run-spmd loads this module to probe its agents

        self.check_options(request.options)
        rid = f"local-{uuid.uuid4().hex[:8]}"
        root = workdir.resolve() / "agents"
        agents = [
            request.agent_command(
                rid,
                name=f"local{i}",
                keys_stdin=True,
                port=None if request.agent_port is None else request.agent_port + i,  # one machine: one port each
                address_file=str(root / rid / f"local{i}.addr"),
                state_file=request.state_file,
            )
            for i in range(request.hosts)
        ]
        logs = [str(root / f"local{i}.log") for i in range(request.hosts)]
        steps = [
            f"{EnvSettings.host.var}=127.0.0.1 {shlex.join(a.argv())}  # keys on stdin; log: {log}"
            for a, log in zip(agents, logs)
        ]
        steps.append(f"wait until {request.hosts} agent(s) have written their address files")
        summary = (
            f"start {request.hosts} host agent(s) on this machine, each in its own session, with a fresh key "
            "pair written 0600 to the job state"
        )
        return Plan(
            self.name,
            rid,
            request.hosts,
            list(request.command),
            str(workdir.resolve()),
            summary,
            steps,
            data={"agents": [a.to_json() for a in agents], "logs": logs},
        )

    def reserve(self, plan: Plan, keys: Keys, progress: Progress) -> Reservation:
        self.check_plan(plan)
        agents = [AgentCommand.from_json(a) for a in plan.data["agents"]]
        logs = [Path(p) for p in plan.data["logs"]]
        addr_dir = Path(str(agents[0].address_file)).parent if agents else Path(plan.workdir)
        # Private like the state file next to it: agent logs hold ranks' tracebacks and paths.
        _private_dirs(addr_dir)
        for log_path in logs:
            _private_dirs(log_path.parent)
        env = {**os.environ, EnvSettings.host.var: "127.0.0.1"}
        env.pop(KEYS_ENV, None)
        import subprocess  # (to reserve, not to run: `run-spmd` loads this backend too)

        procs: list[subprocess.Popen] = []
        try:
            for agent, log_path in zip(agents, logs):
                progress(f"starting agent {agent.name}")
                with open(os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600), "ab") as log:
                    proc = subprocess.Popen(
                        agent.argv(), stdin=subprocess.PIPE, stdout=log, stderr=log, env=env, start_new_session=True
                    )
                procs.append(proc)
                assert proc.stdin is not None
                proc.stdin.write(keys.encode().encode() + b"\n")
                proc.stdin.close()
            names = [str(a.name) for a in agents]

            def check() -> None:
                for agent, proc, log_path in zip(agents, procs, logs):
                    if proc.poll() is not None:
                        raise SchedulerError(
                            f"agent {agent.name} exited with status {proc.returncode} during start-up: "
                            f"{_tail(log_path)}"
                        )

            hosts = wait_for_agents(
                lambda: read_address_files(addr_dir, names), names, progress, timeout=AGENT_START_TIMEOUT, check=check
            )
        except BaseException:
            _kill_agents([p.pid for p in procs])
            shutil.rmtree(addr_dir, ignore_errors=True)
            raise
        hosts = [HostRecord(h.name, h.agent, p.pid, h.node_rank) for h, p in zip(hosts, procs)]
        return Reservation(
            plan.reservation_id, hosts, {"logs": str(logs[0].parent) if logs else "", "addresses": str(addr_dir)}
        )

    def release(self, reservation: ReservationRecord) -> None:
        _kill_agents([h.pid for h in reservation.hosts if h.pid])
        from ...runtime.agent import registry as agent_registry  # psutil: only for stopping, not on every run's probe

        agent_registry.stop_agents(agent_registry.agents_of(reservation=reservation.reservation_id))
        if reservation.scheduler_data.get("addresses"):
            shutil.rmtree(reservation.scheduler_data["addresses"], ignore_errors=True)

    def release_unreadable(self, state_file: Path) -> list[int]:
        """Stop the agents registered for a state file that cannot be read; their pids."""
        from ...runtime.agent import registry as agent_registry

        found = agent_registry.agents_of(state_file=str(state_file.resolve()))
        agent_registry.stop_agents(found)
        return [e.pid for e in found]

    def dead_hosts(self, reservation: ReservationRecord) -> list[str]:
        alive: dict[int, bool] = {}  # per pid: an agent process may serve several hosts
        for h in reservation.hosts:
            if h.pid and h.pid not in alive:
                alive[h.pid] = _is_agent(h.pid)
        return [h.name for h in reservation.hosts if not (h.pid and alive[h.pid])]

    def probe(self, reservation: ReservationRecord) -> Probe:
        dead = self.dead_hosts(reservation)
        if dead:
            return Probe(Liveness.GONE, f"agent process of {', '.join(dead)} is not running")
        return Probe(Liveness.ALIVE)


def _tail(path: Path, lines: int = 3) -> str:
    try:
        text = path.read_text(errors="replace").strip().splitlines()
    except OSError:
        text = []
    return " | ".join(text[-lines:]) + f" (log: {path})" if text else f"no output (log: {path})"


def _is_agent(pid: int) -> bool:
    """Whether ``pid`` is still one of our agents (not a process that reused its pid)."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:  # what psutil reads, without importing it per run
            cmd = f.read().replace(b"\0", b" ").decode(errors="replace").strip()
    except OSError:
        return False
    return is_agent_command(cmd)


def _kill_agents(pids: list[int]) -> None:
    """SIGTERM each agent (it kills its procs and ranks), then SIGKILL what is left."""
    pids = [p for p in pids if _is_agent(p)]
    for pid in pids:
        signal_if_alive(pid, signal.SIGTERM)
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline and any(_is_agent(p) for p in pids):
        time.sleep(0.05)
    for pid in pids:
        if _is_agent(pid):
            signal_if_alive(pid, signal.SIGKILL)  # its zygotes and their children follow (PDEATHSIG)


__all__ = ["LocalScheduler"]


def _private_dirs(path: Path) -> None:
    """``path`` and its missing parents, each made 0700."""
    if path.is_dir():
        return
    _private_dirs(path.parent)
    path.mkdir(mode=0o700, exist_ok=True)
