"""Running a torchrun-style command on a reservation's hosts, from the controller's side.

The runner places ranks on hosts, hands each host agent its ranks with torchrun's whole
environment contract, streams output to an :class:`OutputSink`, and decides the outcome:
the first rank to fail sets the exit status, the rest are stopped after a grace period,
and the first Ctrl-C is passed to the ranks as SIGINT (the second kills them).
"""

from __future__ import annotations

import dataclasses
import os
import signal
import threading
import time
import uuid
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Sequence

from ..config import settings
from ..runtime import wire
from ..runtime.future import Future, gather
from ..runtime.keys import Keys
from ..runtime.mailbox import Mailbox
from ..runtime.ranks import describe_status
from .errors import JobError
from .output import OutputSink
from .state import HostRecord
from .torchrun import SpmdSpec, rank_environment, resolve_nproc

_HOST_SPECIFIC = {"HOSTNAME", "PWD", "OLDPWD", "SHLVL", "_", "MONARCH_KEYS", "MONARCH_KEY_FILE", "TERM_SESSION_ID"}


class StaleReservation(JobError):
    """The reservation's agents are gone (allocation ended, processes killed)."""


@dataclasses.dataclass
class RankExit:
    """How one rank ended."""

    rank: int
    label: str
    host: str
    exitcode: Optional[int]
    signal: Optional[int]
    duration: float
    pid: Optional[int] = None
    tail: List[str] = dataclasses.field(default_factory=list)
    lost: str = ""  # set when the rank's host went away instead of reporting

    @property
    def status(self) -> int:
        if self.lost:
            return 255
        return describe_status(self.exitcode, self.signal)[1]

    @property
    def how(self) -> str:
        return self.lost or describe_status(self.exitcode, self.signal)[0]

    @property
    def ok(self) -> bool:
        return self.status == 0


@dataclasses.dataclass
class RunResult:
    run_id: str
    exit_code: int
    ranks: List[RankExit]
    duration: float
    log_dir: Path
    first_failure: Optional[RankExit] = None
    restarts: int = 0
    interrupted: bool = False

    def to_json(self) -> Dict[str, Any]:
        return {
            "run_id": self.run_id,
            "exit_code": self.exit_code,
            "duration": round(self.duration, 3),
            "log_dir": str(self.log_dir),
            "restarts": self.restarts,
            "interrupted": self.interrupted,
            "first_failure": self.first_failure.rank if self.first_failure else None,
            "ranks": [
                {
                    "rank": r.rank,
                    "host": r.host,
                    "exit_code": r.exitcode,
                    "signal": r.signal,
                    "status": r.status,
                    "how": r.how,
                    "duration": round(r.duration, 3),
                    "last_lines": r.tail,
                }
                for r in self.ranks
            ],
        }


@dataclasses.dataclass
class Launch:
    """One process to start: a rank of the SPMD run, or a host's shell for ``exec``."""

    rank: int
    label: str
    node: int
    spec: Dict[str, Any]


def new_run_id() -> str:
    """Sortable to the millisecond, unique by its suffix."""
    now = time.time()
    return time.strftime("%Y%m%d-%H%M%S", time.localtime(now)) + f"{int(now * 1000) % 1000:03d}-" + uuid.uuid4().hex[:4]


def user_environment() -> Dict[str, str]:
    """The caller's environment as ranks should see it (host-specific entries left out)."""
    return {k: v for k, v in os.environ.items() if k not in _HOST_SPECIFIC and not k.startswith("SLURM_")}


class HostSet:
    """The reservation's agents as this controller talks to them."""

    def __init__(self, hosts: List[HostRecord], keys: Keys, timeout: float = 5.0) -> None:
        self.hosts = hosts
        self.mb = Mailbox.for_keys(keys)
        pings = [self.mb.request(h.agent, lambda cid: ("ping", cid, self.mb.address)) for h in hosts]
        self.infos: List[Dict[str, Any]] = []
        for host, fut in zip(hosts, pings):
            try:
                self.infos.append(fut.get(timeout=timeout))
            except Exception:  # noqa: BLE001 - any failure to answer means the same thing here
                raise StaleReservation(
                    f"host {host.name} (agent {host.agent}) is not answering: the reservation is gone or unreachable; "
                    "run `monarch serve --replace` for a new one, or `monarch stop` to clear it"
                ) from None


class SpmdRunner:
    """Runs launches on a :class:`HostSet` and reports how each ended."""

    def __init__(self, hostset: HostSet, log_dir: Path, *, grace: float = 3.0) -> None:
        self.hs = hostset
        self.mb = hostset.mb
        self.log_dir = log_dir
        self.grace = grace

    def run(
        self,
        launches: List[Launch],
        run_id: str,
        sink: OutputSink,
        *,
        master_node_port: Optional[int] = None,
        on_interrupt: Optional[Callable[[int], None]] = None,
        on_pause: Optional[Callable[[int, str, Dict[str, Any]], None]] = None,
        on_notice: Optional[Callable[[str], None]] = None,
        forward_signals: Sequence[int] = (),
    ) -> List[RankExit]:
        mb = self.mb
        by_rank = {l.rank: l for l in launches}
        exits: Dict[int, RankExit] = {}
        done: Future[None] = Future()
        done._mailbox = mb
        first_failure: List[int] = []
        started = time.monotonic()
        lock = threading.Lock()
        nodes = sorted({l.node for l in launches})

        def on_output(header: Any, body: List[Any]) -> None:
            _, _, rid, rank, stream = header
            if rid == run_id:
                sink.write(rank, stream, bytes(body[0]))

        def finish(rank: int, exit_: RankExit) -> None:
            with lock:
                if rank in exits:
                    return
                sink.end_of_rank(rank)
                exit_.tail = sink.tail(rank)
                exits[rank] = exit_
                if not exit_.ok and not first_failure:
                    first_failure.append(rank)
                if len(exits) == len(launches) and not done.done():
                    done.set_result(None)

        def on_exit(header: Any, body: List[Any]) -> None:
            _, _, rid, rank, exitcode, sig, duration, pid = header
            if rid != run_id or rank not in by_rank:
                return
            launch = by_rank[rank]
            finish(rank, RankExit(rank, launch.label, self.hs.hosts[launch.node].name, exitcode, sig, duration, pid))

        def on_lost(agent: str, silence: float) -> None:
            for l in launches:
                if self.hs.hosts[l.node].agent == agent:
                    why = f"lost: host {self.hs.hosts[l.node].name} stopped answering ({silence:.1f} s)"
                    finish(l.rank, RankExit(l.rank, l.label, self.hs.hosts[l.node].name, None, None,
                                            time.monotonic() - started, lost=why))

        def on_paused(header: Any, body: List[Any]) -> None:
            _, _, rid, rank, host, where = header
            if rid == run_id and on_pause is not None:
                on_pause(rank, host, where)

        mb.event_handlers["output"] = on_output
        mb.event_handlers["rank_exit"] = on_exit
        mb.event_handlers["rank_paused"] = on_paused
        for n in nodes:
            info = self.hs.infos[n]
            mb.watch_agent(self.hs.hosts[n].agent, info["heartbeat"], on_lost)
        # Ctrl-C, plus what the caller forwards (e.g. Slurm's warning before a time limit).
        relay = _SignalRelay([signal.SIGINT, *(s for s in forward_signals if s != signal.SIGINT)])
        interrupts = 0
        try:
            acks = []
            for n in nodes:
                specs = [l.spec for l in launches if l.node == n]
                acks.append(
                    mb.request(
                        self.hs.hosts[n].agent,
                        lambda cid: ("run_ranks", cid, mb.address, run_id, settings().heartbeat_timeout),
                        wire.dumps(specs),
                    )
                )
            for n, reply in zip(nodes, gather(acks).get(timeout=30)):
                if on_notice is not None:
                    if reply["made_cold"]:
                        on_notice(_cold_notice(self.hs.hosts[n].name, reply["made_cold"]))
                    for notice in reply["notices"]:
                        on_notice(f"{self.hs.hosts[n].name}: {notice}")
            stop_at: Optional[float] = None
            kill_at: Optional[float] = None
            while not done.done():
                try:
                    done.get(timeout=0.2)
                except Exception:  # noqa: BLE001 - timeouts: time to check deadlines
                    pass
                now = time.monotonic()
                for sig in relay.take():
                    if sig == signal.SIGINT:  # the first Ctrl-C is passed on; a second kills
                        interrupts += 1
                        sig = signal.SIGINT if interrupts == 1 else signal.SIGKILL
                        if on_interrupt is not None:
                            on_interrupt(interrupts)
                    self._signal(nodes, run_id, sig)
                if first_failure and stop_at is None:
                    stop_at = now + self.grace
                if stop_at is not None and kill_at is None and now >= stop_at:
                    self._signal(nodes, run_id, signal.SIGTERM)
                    kill_at = now + self.grace
                if kill_at is not None and now >= kill_at:
                    self._signal(nodes, run_id, signal.SIGKILL)
                    kill_at = float("inf")
        finally:
            relay.restore()
            for n in nodes:
                mb.unwatch_agent(self.hs.hosts[n].agent)
            for kind in ("output", "rank_exit", "rank_paused"):
                mb.event_handlers.pop(kind, None)
        ordered = [exits[r] for r in sorted(exits)]
        if first_failure:
            ordered.sort(key=lambda e: (e.rank != first_failure[0], e.rank))
        self.interrupted = interrupts > 0
        return ordered

    def _signal(self, nodes: List[int], run_id: str, sig: int) -> None:
        for n in nodes:
            self.mb.send(self.hs.hosts[n].agent, ("signal_ranks", 0, self.mb.address, run_id, int(sig)))

    def reserve_port(self, node: int, run_id: str) -> int:
        return self.mb.request(self.hs.hosts[node].agent, lambda cid: ("reserve_port", cid, self.mb.address, run_id)).get(timeout=10)


class _SignalRelay:
    """Catches ``signals`` while a run is in progress so the run loop can pass them to the ranks.

    Handlers only record the signal; the loop sends it (no socket work inside a handler).
    Only the main thread can install handlers; elsewhere this relays nothing.
    """

    def __init__(self, signals: Sequence[int]) -> None:
        self._pending: List[int] = []
        self._old: Dict[int, Any] = {}
        if threading.current_thread() is threading.main_thread():
            for sig in signals:
                self._old[sig] = signal.signal(sig, lambda s, _f: self._pending.append(s))

    def take(self) -> List[int]:
        taken = []
        while self._pending:  # pop, not copy-and-clear: a signal may land in between
            taken.append(self._pending.pop(0))
        return taken

    def restore(self) -> None:
        for sig, old in self._old.items():
            signal.signal(sig, old)


def _cold_notice(host: str, names: List[str]) -> str:
    return (f"ranks on {host} start cold (about 1 s each): {', '.join(names)} differ from when `monarch serve` "
            "started its agents, and a warm rank keeps the interpreter's start-up settings; serve again "
            "(--replace) with them set to start warm")


def warm_capable(spec: SpmdSpec) -> bool:
    """A forked warm rank cannot take interpreter flags (``-O``, ``-X``, ``-W``...); ``-u`` it can."""
    return spec.mode != "no_python" and all(a == "-u" for a in spec.python_args)


def plan_exec(command: List[str], hostset: HostSet, environ: Optional[Dict[str, str]] = None) -> List[Launch]:
    """One shell per host for ``monarch exec``; GROUP_RANK/NODE_RANK tell the hosts apart."""
    env = dict(environ if environ is not None else user_environment())
    shell = command if len(command) > 1 else ["/bin/sh", "-c", command[0]]
    return [
        Launch(
            node,
            host.name,
            node,
            {"rank": node, "env": {**env, "GROUP_RANK": str(node), "NODE_RANK": str(node)},
             "cwd": os.getcwd(), "mode": "no_python", "program": shell,
             "python_args": [], "warm": False, "host_store": False},
        )
        for node, host in enumerate(hostset.hosts)
    ]


def plan_spmd(
    spec: SpmdSpec,
    hostset: HostSet,
    run_id: str,
    *,
    cold: bool,
    master_port: Optional[int],
    restart_count: int = 0,
    environ: Optional[Dict[str, str]] = None,
    post_mortem: bool = False,
) -> List[Launch]:
    """Place ranks on hosts and build each one's environment and program."""
    hosts = hostset.hosts
    nnodes = spec.nnodes or len(hosts)
    if nnodes > len(hosts):
        raise JobError(f"--nnodes {nnodes} asks for more hosts than the {len(hosts)} reserved; serve more hosts first")
    if spec.nnodes_min is not None and spec.nnodes_min > len(hosts):
        raise JobError(f"--nnodes {spec.nnodes_min}:{spec.nnodes} needs at least {spec.nnodes_min} hosts; {len(hosts)} are reserved")
    per_node = [resolve_nproc(spec.nproc_per_node, i["gpus"], i["cpus"]) for i in hostset.infos[:nnodes]]
    if len(set(per_node)) != 1:
        raise JobError(f"--nproc-per-node={spec.nproc_per_node} gives different counts per host ({per_node}); give a number")
    nproc = per_node[0]
    base = dict(environ if environ is not None else user_environment())
    base.setdefault("PYTHONUNBUFFERED", "1")  # live output, as a user watching ranks expects
    master_addr = spec.master_addr or hostset.infos[0]["addr"]
    host_store = spec.master_port is None
    port = spec.master_port if spec.master_port is not None else master_port
    if port is None:
        raise JobError("no master port")
    launches = []
    cwd = os.getcwd()
    for node in range(nnodes):
        for local in range(nproc):
            env = {
                **base,
                **rank_environment(
                    spec,
                    node_rank=node,
                    nnodes=nnodes,
                    local_rank=local,
                    nproc_per_node=nproc,
                    master_addr=master_addr,
                    master_port=port,
                    run_id=spec.rdzv_id or run_id,
                    restart_count=restart_count,
                    cpus_on_host=hostset.infos[node]["cpus"],
                    environ=base,
                ),
            }
            rank = node * nproc + local
            if host_store:
                env["TORCHELASTIC_USE_AGENT_STORE"] = "True"  # rank 0 serves the store we reserved
            launch_spec = {
                "rank": rank,
                "env": env,
                "cwd": cwd,
                "mode": spec.mode,
                "program": spec.program,
                "python_args": spec.python_args,
                "warm": not cold and warm_capable(spec),
                "host_store": host_store and rank == 0,
                "post_mortem": post_mortem,
            }
            launches.append(Launch(rank, f"rank{rank}", node, launch_spec))
    return launches
