"""The local backend: N host agents on this machine, each acting as a separate host.

Each agent has its own name (``local0``, ``local1``...), so it gets its own GROUP_RANK
and rank range, which makes multi-node logic testable on a laptop. Agents run in their
own sessions and outlive the CLI that started them.
"""

from __future__ import annotations

import os
import shlex
import signal
import sys
import time
import uuid
from pathlib import Path
from typing import List, Optional

from ..jobs.state import HostRecord, JobState
from ..runtime.keys import Keys
from .base import DryRun, Progress, Reservation, ReserveRequest, Scheduler


class LocalScheduler(Scheduler):
    name = "local"

    def _agent_command(self, i: int, request: ReserveRequest) -> List[str]:
        cmd = [sys.executable, "-m", "monarch_cli.runtime.agent", "--keys-stdin", "--name", f"local{i}", "--warm-up"]
        if request.preload is not None:
            cmd += ["--preload", request.preload]
        return cmd

    def dryrun(self, request: ReserveRequest, workdir: Path) -> DryRun:
        _no_options(request)
        commands = "\n".join(
            f"MONARCH_HOST=127.0.0.1 {shlex.join(self._agent_command(i, request))}  "
            f"# keys on stdin; log: {workdir / 'agents' / f'local{i}.log'}"
            for i in range(request.hosts)
        )
        summary = (
            f"start {request.hosts} host agent(s) on this machine, each in its own session, "
            f"with a fresh key pair written 0600 to the job state; default command: "
            f"{shlex.join(request.command) if request.command else '(none)'}"
        )
        return DryRun(self.name, summary, {"commands": commands})

    def reserve(self, request: ReserveRequest, keys: Keys, workdir: Path, progress: Progress) -> Reservation:
        _no_options(request)
        logs = workdir / "agents"
        logs.mkdir(parents=True, exist_ok=True)
        env = {**os.environ, "MONARCH_HOST": "127.0.0.1"}
        env.pop("MONARCH_KEYS", None)
        hosts: List[HostRecord] = []
        try:
            for i in range(request.hosts):
                progress(f"starting agent local{i}")
                with open(logs / f"local{i}.log", "ab") as log:
                    from ..runtime.agent_launch import launch_agent  # (not needed to run on the hosts)

                    proc, address = launch_agent(
                        keys,
                        name=f"local{i}",
                        preload=request.preload,
                        warm_up=True,
                        exit_with_parent=False,
                        detach=True,
                        env=env,
                        stdout=log,
                    )
                hosts.append(HostRecord(name=f"local{i}", agent=address, pid=proc.pid, node_rank=i))
                progress(f"local{i} ready at {address}")
        except BaseException:
            _kill_agents(hosts)
            raise
        return Reservation(f"local-{uuid.uuid4().hex[:8]}", hosts, {"logs": str(logs)})

    def release(self, state: JobState) -> None:
        _kill_agents(state.hosts)

    def gone(self, state: JobState) -> Optional[str]:
        dead = [h.name for h in state.hosts if not (h.pid and _is_agent(h.pid))]
        return f"agent process of {', '.join(dead)} is not running" if dead else None


def _no_options(request: ReserveRequest) -> None:
    if request.options:
        flags = ", ".join("--" + k.replace("_", "-") for k in sorted(request.options))
        raise ValueError(f"the local scheduler takes no cluster options (got {flags}); use --scheduler slurm")


def _is_agent(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:  # Linux only, like the runtime; cheaper than psutil
            return b"monarch_cli.runtime.agent" in f.read()
    except OSError:
        return False


def _kill_agents(hosts: List[HostRecord]) -> None:
    """SIGTERM each agent (it kills its procs and ranks), then SIGKILL what is left."""
    pids = [h.pid for h in hosts if h.pid and _is_agent(h.pid)]
    for pid in pids:
        os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline and any(_is_agent(p) for p in pids):
        time.sleep(0.05)
    for pid in pids:
        if _is_agent(pid):
            os.kill(pid, signal.SIGKILL)  # its zygotes and their children follow (PDEATHSIG)
