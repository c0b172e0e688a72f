"""Running a torchrun-style command on a reservation's hosts, from the controller's side.

The runner places ranks on hosts, hands each host agent its ranks with torchrun's whole
environment contract, streams output to an :class:`OutputSink`, and decides the outcome:
the first rank to fail sets the exit status, the rest are stopped after a grace period.
How a run is ended from outside (Ctrl-C, SIGTERM, ``monarch stop``) is decided in
:mod:`.lifecycle`.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from ..config import settings
from ..runtime import protocol
from ..runtime.errors import CallTimeout
from ..runtime.mailbox.future import Future, gather
from ..runtime.transport import wire
from .errors import JobError
from .lifecycle import DEATH_SIGNALS, DEFAULT_SHUTDOWN_TIMEOUT, DEFAULT_STRAGGLER_GRACE, RunControl, SignalRelay
from .model import FixedSpec, HostSet, Launch, RankExit
from .output import OutputSink
from .partition import PartitionWatch
from .telemetry import NO_TELEMETRY, RunRecorder
from .telemetry import enabled as telemetry_enabled
from .torchrun import SpmdSpec, rank_environment, resolve_nproc

#: Output bytes from one host after which the runner credits them back (see ``ranks.OUTPUT_WINDOW``).
_CREDIT_EVERY = 1 << 20
_HOST_SPECIFIC = {"HOSTNAME", "PWD", "OLDPWD", "SHLVL", "_", "MONARCH_KEYS", "MONARCH_KEY_FILE", "TERM_SESSION_ID"}


def new_run_id() -> str:
    """Sortable to the millisecond, unique by its suffix."""
    now = time.time()
    return time.strftime("%Y%m%d-%H%M%S", time.localtime(now)) + f"{int(now * 1000) % 1000:03d}-" + os.urandom(2).hex()


def user_environment() -> dict[str, str]:
    """The caller's environment as ranks should see it (host-specific entries left out)."""
    return {k: v for k, v in os.environ.items() if k not in _HOST_SPECIFIC and not k.startswith("SLURM_")}


#: What reaches ranks on a host that does not share this machine's filesystem (a synced host)
#: without ``-e``: the client's PATH, HOME, PYTHONPATH or VIRTUAL_ENV would be wrong there.
FORWARDED_PREFIXES = (
    "TORCH_",
    "TORCHINDUCTOR_",
    "PYTORCH_",
    "NCCL_",
    "GLOO_",
    "OMP_",
    "MKL_",
    "HF_",
    "WANDB_",
    "TOKENIZERS_",
    "LOGLEVEL",
)
FORWARDED_NAMES = (
    "PYTHONUNBUFFERED",
    "PYTHONHASHSEED",
    "PYTHONFAULTHANDLER",
    "CUBLAS_WORKSPACE_CONFIG",
    "LANG",
    "LC_ALL",
)


def remote_environment() -> dict[str, str]:
    """The caller's variables that ranks on a synced host get by default (see docs/sync.md)."""
    return {k: v for k, v in os.environ.items() if k.startswith(FORWARDED_PREFIXES) or k in FORWARDED_NAMES}


def parse_env_flags(items: Sequence[str]) -> dict[str, str]:
    """``-e NAME=VALUE`` sets, ``-e NAME`` forwards this shell's value; an unset NAME is an error."""
    out: dict[str, str] = {}
    for item in items:
        name, eq, value = item.partition("=")
        if not name or not (name[0].isalpha() or name[0] == "_") or not all(c.isalnum() or c == "_" for c in name):
            raise JobError(f"-e takes NAME or NAME=VALUE, not {item!r}")
        if not eq:
            if name not in os.environ:
                raise JobError(f"-e {name}: {name} is not set here; give a value with -e {name}=VALUE")
            value = os.environ[name]
        out[name] = value
    return out


class SpmdRunner:
    """Runs launches on a :class:`HostSet` and reports how each ended.

    ``grace``: after a rank fails, the others get SIGTERM, and SIGKILL one grace later.
    ``shutdown_timeout``: after SIGTERM/SIGHUP/SIGQUIT to the caller, how long ranks have
    before SIGKILL. ``straggler_grace``: how long after the first rank ends the ranks still
    running are named (once) through ``say``. ``stall_timeout``: a run none of whose ranks printed
    or finished a step for this long while every host answered is ended (None: never).
    """

    def __init__(
        self,
        hostset: HostSet,
        log_dir: Path,
        *,
        grace: float = 3.0,
        shutdown_timeout: float = DEFAULT_SHUTDOWN_TIMEOUT,
        straggler_grace: float = DEFAULT_STRAGGLER_GRACE,
        say: Callable[[str], None] | None = None,
        stall_timeout: float | None = None,
    ) -> None:
        self.hs = hostset
        self.mb = hostset.mb
        self.log_dir = log_dir
        self.grace = grace
        self.shutdown_timeout = shutdown_timeout
        self.straggler_grace = straggler_grace
        self.stall_timeout = stall_timeout
        self.say = say or (lambda _msg: None)
        self.control: RunControl | None = None  # the last run's
        self._console_closed = threading.Event()

    def console_closed(self) -> None:
        """From any thread: the run's output has no reader any more (`| head`); end the run."""
        self._console_closed.set()

    def run(
        self,
        launches: list[Launch],
        run_id: str,
        sink: OutputSink,
        *,
        on_pause: Callable[[int, str, dict[str, Any]], None] | None = None,
        on_notice: Callable[[str], None] | None = None,
        forward_signals: Sequence[int] = (),
        telemetry: RunRecorder = NO_TELEMETRY,
        attempt: int = 0,
    ) -> list[RankExit]:
        """Start ``launches``, stream their output into ``sink`` (and ``telemetry``), and wait until every rank
        has ended (or is given up on); how each ended, the first failure first."""
        nodes = sorted({l.node for l in launches})
        host_of = {l.rank: self.hs.hosts[l.node].name for l in launches}
        control = self.control = RunControl(
            host_of,
            lambda sig: self._signal(nodes, run_id, sig),
            self.say,
            failure_grace=self.grace,
            shutdown_timeout=self.shutdown_timeout,
            straggler_grace=self.straggler_grace,
        )
        state = _RunState(self.hs, launches, run_id, sink, telemetry, control)
        handlers = state.handlers(on_pause)
        telemetry.started(launches, self.hs, attempt)
        # This run's events only, until it ends, on a thread of their own: printing may block (a
        # paused terminal), and the mailbox's I/O thread must go on heartbeating the agents.
        subscription = self.mb.subscribe(run_id, handlers, thread="monarch-run-events")
        on_lost = lambda agent, silence: subscription.call_soon(state.on_lost, agent, silence)  # noqa: E731
        for n in nodes:
            self.mb.watch_agent(self.hs.hosts[n].agent, on_lost)
        # Ctrl-C, torchrun's death signals, plus what the caller forwards (e.g. Slurm's SIGUSR1).
        relay = SignalRelay([signal.SIGINT, *DEATH_SIGNALS, *forward_signals])
        try:
            acks = self._start(launches, nodes, run_id)
            telemetry.start()  # its thread opens the store now, not while the launch is on its way
            early = self._await_started(acks, nodes, relay, on_notice)
            self._wait(state, relay, early, nodes)
        finally:
            relay.restore()
            for n in nodes:
                self.mb.unwatch_agent(self.hs.hosts[n].agent)
            subscription.close()
        self.interrupted = control.interrupts > 0
        return state.ordered()

    def _start(self, launches: list[Launch], nodes: list[int], run_id: str) -> list[Future[Any]]:
        """Hand every host its ranks, at once; each agent's acknowledgement, in ``nodes`` order."""
        mb = self.mb
        acks = []
        launches_of: dict[int, list[Launch]] = {n: [] for n in nodes}
        for l in launches:  # one pass: a loop over hosts per host is quadratic at thousands
            launches_of[l.node].append(l)
        for n in nodes:
            # A host's specs are built, pickled and dropped here: none is held for the run.
            body = wire.dumps_data([l.spec for l in launches_of.pop(n)])
            acks.append(
                mb.request(
                    self.hs.hosts[n].agent,
                    lambda cid: protocol.RunRanks(cid, mb.address, run_id, settings().heartbeat_timeout),
                    body,
                )
            )
        return acks

    def _await_started(
        self, parts: list[Future[Any]], nodes: list[int], relay: SignalRelay, on_notice: Callable[[str], None] | None
    ) -> list[int]:
        """Wait for the hosts to start their ranks and pass on what they noticed; a signal that arrives
        meanwhile (a Ctrl-C while a host is slow) ends the wait and is returned, to be acted on."""
        deadline = time.monotonic() + 30
        acks = gather(parts)
        while True:
            try:
                made = acks.get(timeout=0.2)
            except CallTimeout:
                if time.monotonic() > deadline:
                    slow = [self.hs.hosts[n].name for n, a in zip(nodes, parts) if not a.done()]
                    raise JobError(
                        f"{', '.join(slow) or 'a host'} did not start the run's ranks within 30 s; "
                        "`monarch status` says whether its agent still answers"
                    ) from None
                early = relay.take()
                if early:
                    return early
                continue
            for n, reply in zip(nodes, made):
                if on_notice is not None:
                    if reply["made_cold"]:
                        on_notice(_cold_notice(self.hs.hosts[n].name, reply["made_cold"]))
                    for notice in reply["notices"]:
                        on_notice(f"{self.hs.hosts[n].name}: {notice}")
            return []

    def _wait(self, state: _RunState, relay: SignalRelay, early: list[int], nodes: list[int]) -> None:
        """Until every rank has ended: act on signals, a closed console, a partition between the run's
        hosts (:class:`PartitionWatch`) and the run's deadlines."""
        control = state.control
        watched = [self.hs.hosts[n] for n in nodes] if self.hs.peers_reachable else []
        watch = PartitionWatch(self.mb, watched, [h.agent for h in watched])
        stalled_at: float | None = None  # when the stall timeout passed (the hosts are then probed)
        while not state.done.done():
            try:
                state.done.get(timeout=0.2)
            except Exception:  # noqa: BLE001 - timeouts: time to check deadlines
                pass
            partition = watch.tick(time.monotonic())
            if partition is not None:
                with state.lock:
                    control.partitioned(partition, time.monotonic())
                state.telemetry.event("partition", None, partition)
            stalled_at = self._check_stall(state, watch, stalled_at, len(watched) > 1)
            with state.lock:
                if self._console_closed.is_set():
                    control.console_closed(time.monotonic())
                for sig in [*early, *relay.take()]:
                    control.signal(sig, time.monotonic(), sorted(state.running()))
                    if sig == signal.SIGINT:
                        watch.urgent(time.monotonic())  # a hang on a partition: end it within seconds
                early = []
                abandon, why = control.tick(time.monotonic(), state.running())
            for rank in abandon:  # Ctrl-C always ends the wait, even for ranks whose exits never come
                state.finish(rank, state.gone(rank, lost=f"lost: {why}"))

    def _check_stall(
        self, state: _RunState, watch: PartitionWatch, stalled_at: float | None, probed: bool
    ) -> float | None:
        """No output and no step from any rank for ``stall_timeout`` while every host answers: probe the
        hosts (a failed pair is named as a partition), then end the run with one line."""
        control, now = state.control, time.monotonic()
        if (
            self.stall_timeout is None
            or control.partition is not None
            or control.interrupts
            or control.received is not None
            or control.console_gone
            or state.first_failure is not None
        ):
            return None
        if now - state.last_progress < self.stall_timeout:
            return None  # progress (again): nothing is stalled
        if stalled_at is None:
            watch.urgent(now)  # one quick round between the run's hosts (none for one host)
            return now
        if watch.probing and now < stalled_at + 10.0:
            return stalled_at
        hosts = "every host answered and the hosts reach each other" if probed else "its host answered"
        why = (
            f"stalled: no output and no step from any rank for {self.stall_timeout:g} s while {hosts} "
            f"(a hung collective or a stopped rank?); --stall-timeout sets the limit"
        )
        with state.lock:
            control.stalled(why, now)
        state.telemetry.event("stall", None, why)
        return stalled_at

    @property
    def ended_from_outside(self) -> bool:
        """Ctrl-C, a death signal or ``monarch stop`` ended the last run: never restart it."""
        c = self.control
        return c is not None and bool(c.interrupts or c.received is not None or c.stopped_by or c.console_gone)

    def _signal(self, nodes: list[int], run_id: str, sig: int) -> None:
        for n in nodes:
            self.mb.send(self.hs.hosts[n].agent, protocol.SignalRanks(0, self.mb.address, run_id, int(sig)))

    def reserve_port(self, node: int, run_id: str) -> int:
        return self.mb.request(
            self.hs.hosts[node].agent, lambda cid: protocol.ReservePort(cid, self.mb.address, run_id)
        ).get(timeout=10)

    def release_port(self, node: int, run_id: str) -> None:
        """Give back a port reserved for a run that will not start."""
        self.mb.request(self.hs.hosts[node].agent, lambda cid: protocol.ReleasePort(cid, self.mb.address, run_id)).get(
            timeout=10
        )


class _RunState:
    """One attempt's ranks as their events arrive (on the run's event thread) and the runner waits."""

    def __init__(
        self,
        hostset: HostSet,
        launches: list[Launch],
        run_id: str,
        sink: OutputSink,
        telemetry: RunRecorder,
        control: RunControl,
    ) -> None:
        self.hs = hostset
        self.launches = launches
        self.by_rank = {l.rank: l for l in launches}
        #: Each agent's launches: a lost host's ranks without a pass over every launch (3,456 hosts
        #: named lost at once, each such pass over 32,768 launches, had taken a client 13 s).
        self.by_agent: dict[str, list[Launch]] = {}
        for l in launches:
            self.by_agent.setdefault(hostset.hosts[l.node].agent, []).append(l)
        self.run_id = run_id
        self.sink = sink
        self.telemetry = telemetry
        self.control = control
        self.exits: dict[int, RankExit] = {}
        self.done: Future[None] = Future()  # resolved once every rank has an exit
        self.first_failure: int | None = None
        self.first_failure_at = 0.0  # monotonic
        self.started = time.monotonic()
        self.last_progress = self.started  # a rank's output or step last arrived (monotonic)
        self.lock = threading.Lock()
        self.owed = {l.node: 0 for l in launches}  # node -> output bytes printed, not yet credited
        #: Ranks without an exit yet, and their hosts' names: kept as exits come, not rebuilt on each tick.
        self._running = {l.rank: hostset.hosts[l.node].name for l in launches}

    def handlers(
        self, on_pause: Callable[[int, str, dict[str, Any]], None] | None
    ) -> dict[type, Callable[[Any, list[Any]], None]]:
        def on_paused(event: protocol.RankPaused, body: list[Any]) -> None:
            if on_pause is not None:
                on_pause(event.rank, event.host, event.where)

        return {
            protocol.Output: self.on_output,
            protocol.RankExited: self.on_exit,
            protocol.RankPaused: on_paused,
            protocol.ReservationStopped: self.on_stopped,
            protocol.Telemetry: self.on_telemetry,
        }

    def on_telemetry(self, event: protocol.Telemetry, body: list[Any]) -> None:
        if event.steps:
            self.last_progress = time.monotonic()
        self.telemetry.on_agent_event(event, body)

    def running(self) -> dict[int, str]:
        return dict(self._running)

    def gone(self, rank: int, *, lost: str = "", stopped: str = "") -> RankExit:
        """The exit of a rank that will not report one itself."""
        l = self.by_rank[rank]
        name = self.hs.hosts[l.node].name
        return RankExit(rank, l.label, name, None, None, time.monotonic() - self.started, lost=lost, stopped=stopped)

    def finish(self, rank: int, exit_: RankExit) -> None:
        with self.lock:
            if rank in self.exits:
                return
            self.sink.end_of_rank(rank)
            exit_.tail = self.sink.tail(rank)
            self.exits[rank] = exit_
            self._running.pop(rank, None)
            self.telemetry.rank_exit(exit_)
            self.control.exited(rank, exit_.ok, time.monotonic())
            if not exit_.ok and self.first_failure is None:
                self.first_failure, self.first_failure_at = rank, time.monotonic()
            if len(self.exits) == len(self.launches) and not self.done.done():
                self.done.set_result(None)

    def ordered(self) -> list[RankExit]:
        """Every exit by rank, the first failure first (stopped: no rank failed first)."""
        ordered = [self.exits[r] for r in sorted(self.exits)]
        if self.first_failure is not None and not self.control.stopped_by:
            ordered.sort(key=lambda e: (e.rank != self.first_failure, e.rank))
        return ordered

    # ------------------------------------------------------------ agent events
    def on_output(self, event: protocol.Output, body: list[Any]) -> None:
        rank = event.rank
        if rank not in self.by_rank:
            return
        data = bytes(body[0])
        self.last_progress = time.monotonic()
        try:
            self.sink.write(rank, event.stream, data)
            self.telemetry.output(rank, event.stream, data)
        finally:  # credited even if the console failed (a closed pipe): never stall the ranks
            # Credit once printed: a host sends only a window ahead, so a slow console
            # holds the ranks back instead of letting output pile up in memory.
            node = self.by_rank[rank].node
            self.owed[node] += len(data)
            if self.owed[node] >= _CREDIT_EVERY:
                self.hs.mb.send(self.hs.hosts[node].agent, protocol.OutputCredit(self.run_id, self.owed[node]))
                self.owed[node] = 0

    def on_exit(self, event: protocol.RankExited, body: list[Any]) -> None:
        rank = event.rank
        if rank not in self.by_rank:
            return
        launch = self.by_rank[rank]
        # Never started: no status of its own.
        lost = event.cause if event.exitcode is None and event.signal is None else ""
        host = self.hs.hosts[launch.node].name
        exit_ = RankExit(
            rank,
            launch.label,
            host,
            event.exitcode,
            event.signal,
            event.duration,
            event.pid,
            lost=lost,
            cause=event.cause,
        )
        self.finish(rank, exit_)

    def on_lost(self, agent: str, silence: float) -> None:
        """A host's agent stopped answering: its ranks are lost. Ranks elsewhere that failed after it
        went quiet failed because of it (a peer's gloo "connection closed"): the run is the lost host's."""
        went_quiet = time.monotonic() - silence
        lost = self.by_agent.get(agent, [])
        for l in lost:
            why = f"lost: host {self.hs.hosts[l.node].name} stopped answering ({silence:.1f} s)"
            self.finish(l.rank, self.gone(l.rank, lost=why))
        with self.lock:
            mine = [l.rank for l in lost if self.exits[l.rank].lost]
            first = self.first_failure
            if mine and (first is None or (not self.exits[first].lost and self.first_failure_at >= went_quiet - 1.0)):
                self.first_failure = mine[0]

    def on_stopped(self, event: protocol.ReservationStopped, body: list[Any]) -> None:
        with self.lock:
            self.control.stopped(event.who)
        here = [l for l in self.launches if self.hs.hosts[l.node].agent == event.agent]
        for l in here or self.launches:  # an agent known by another address: the whole reservation goes
            self.finish(l.rank, self.gone(l.rank, stopped="reservation stopped"))


def _cold_notice(host: str, names: list[str]) -> str:
    return (
        f"ranks on {host} start cold (about 1 s each): {', '.join(names)} differ from when `monarch serve` "
        "started its agents, and a warm rank keeps the interpreter's start-up settings; serve again "
        "(--replace) with them set to start warm"
    )


def warm_capable(spec: SpmdSpec) -> bool:
    """A forked warm rank cannot take interpreter flags (``-O``, ``-X``, ``-W``...); ``-u`` it can."""
    return spec.mode != "no_python" and all(a == "-u" for a in spec.python_args)


def plan_exec(
    command: list[str],
    hostset: HostSet,
    environ: dict[str, str] | None = None,
    node_cwd: dict[int, str] | None = None,
    node_environ: dict[int, dict[str, str]] | None = None,
) -> list[Launch]:
    """One shell per host for ``monarch exec``; GROUP_RANK/NODE_RANK tell the hosts apart."""
    env = dict(environ if environ is not None else user_environment())
    shell = command if len(command) > 1 else ["/bin/sh", "-c", command[0]]
    return [
        Launch(
            node,
            host.name,
            node,
            0,
            FixedSpec(
                {
                    "rank": node,
                    "env": {**(node_environ or {}).get(node, env), "GROUP_RANK": str(node), "NODE_RANK": str(node)},
                    "cwd": (node_cwd or {}).get(node, os.getcwd()),
                    "mode": "no_python",
                    "program": shell,
                    "python_args": [],
                    "warm": False,
                    "host_store": False,
                }
            ),
        )
        for node, host in enumerate(hostset.hosts)
    ]


def plan_spmd(
    spec: SpmdSpec,
    hostset: HostSet,
    run_id: str,
    *,
    cold: bool,
    master_port: int | None,
    restart_count: int = 0,
    environ: dict[str, str] | None = None,
    post_mortem: bool = False,
    cwd: str | None = None,
    node_cwd: dict[int, str] | None = None,
    node_environ: dict[int, dict[str, str]] | None = None,
) -> list[Launch]:
    """Place ranks on hosts and build each one's environment and program (run in ``cwd``, default here).

    ``node_cwd``/``node_environ`` override both for some hosts (those that run in a synced mirror).
    """
    hosts = hostset.hosts
    nnodes = spec.nnodes or len(hosts)
    if spec.nnodes_min is not None:  # elastic MIN:MAX, as torchrun: as many of the reserved hosts as MAX allows
        if spec.nnodes_min > len(hosts):
            raise JobError(
                f"--nnodes {spec.nnodes_min}:{spec.nnodes} needs at least {spec.nnodes_min} hosts; "
                f"{len(hosts)} are reserved"
            )
        nnodes = min(nnodes, len(hosts))
    if nnodes > len(hosts):
        raise JobError(f"--nnodes {nnodes} asks for more hosts than the {len(hosts)} reserved; serve more hosts first")
    per_node = [resolve_nproc(spec.nproc_per_node, i["gpus"], i["cpus"]) for i in hostset.infos[:nnodes]]
    if len(set(per_node)) != 1:
        raise JobError(
            f"--nproc-per-node={spec.nproc_per_node} gives different counts per host ({per_node}); give a number"
        )
    nproc = per_node[0]
    base = dict(environ if environ is not None else user_environment())
    base.setdefault("PYTHONUNBUFFERED", "1")  # live output, as a user watching ranks expects
    master_addr = spec.master_addr or hostset.infos[0]["addr"]
    host_store = spec.master_port is None
    port = spec.master_port if spec.master_port is not None else master_port
    if port is None:
        raise JobError("no master port")
    launches = []
    cwd = cwd or os.getcwd()
    telemetry_on = telemetry_enabled()
    warm = not cold and warm_capable(spec)
    for node in range(nnodes):
        # One dict for the host's ranks (as the base environment is), not one per rank.
        node_telemetry = (
            {
                "run_id": run_id,
                "agent_pid": hostset.infos[node].get("pid"),
                "dir": hostset.infos[node].get("telemetry_dir"),
            }
            if telemetry_on
            else None
        )
        plan = _SpmdHostRanks(
            spec,
            node,
            nnodes,
            nproc,
            master_addr,
            port,
            spec.rdzv_id or run_id,
            restart_count,
            hostset.infos[node]["cpus"],
            (node_environ or {}).get(node, base),
            (node_cwd or {}).get(node, cwd),
            warm,
            host_store,
            post_mortem,
            node_telemetry,
        )
        for local in range(nproc):
            rank = node * nproc + local
            launches.append(Launch(rank, f"rank{rank}", node, local, plan))
    return launches


class _SpmdHostRanks:
    """What one host's ranks share; a rank's spec is built from it as it is sent (:class:`HostRanks`).
    A plain class: a dataclass would cost every ``run-spmd`` ~1.5 ms to define at import."""

    __slots__ = (
        "command",
        "node",
        "nnodes",
        "nproc",
        "master_addr",
        "port",
        "rdzv_id",
        "restart_count",
        "cpus",
        "env_base",
        "cwd",
        "warm",
        "host_store",
        "post_mortem",
        "telemetry",
    )

    def __init__(
        self,
        command: SpmdSpec,
        node: int,
        nnodes: int,
        nproc: int,
        master_addr: str,
        port: int,
        rdzv_id: str,
        restart_count: int,
        cpus: int,
        env_base: dict[str, str],
        cwd: str,
        warm: bool,
        host_store: bool,
        post_mortem: bool,
        telemetry: dict[str, Any] | None,
    ) -> None:
        self.command = command
        self.node = node
        self.nnodes = nnodes
        self.nproc = nproc
        self.master_addr = master_addr
        self.port = port
        self.rdzv_id = rdzv_id
        self.restart_count = restart_count
        self.cpus = cpus
        self.env_base = env_base
        self.cwd = cwd
        self.warm = warm
        self.host_store = host_store
        self.post_mortem = post_mortem
        self.telemetry = telemetry

    def spec(self, local: int) -> protocol.RankSpec:
        # Only what differs from the host's base: the base is one dict shared by its ranks
        # (pickled once per host), which the agent merges under this.
        env = rank_environment(
            self.command,
            node_rank=self.node,
            nnodes=self.nnodes,
            local_rank=local,
            nproc_per_node=self.nproc,
            master_addr=self.master_addr,
            master_port=self.port,
            run_id=self.rdzv_id,
            restart_count=self.restart_count,
            cpus_on_host=self.cpus,
            environ=self.env_base,
        )
        rank = self.node * self.nproc + local
        if self.host_store:
            env["TORCHELASTIC_USE_AGENT_STORE"] = "True"  # rank 0 serves the store we reserved
        out: protocol.RankSpec = {
            "rank": rank,
            "env": env,
            "env_base": self.env_base,
            "cwd": self.cwd,
            "mode": self.command.mode,
            "program": self.command.program,
            "python_args": self.command.python_args,
            "warm": self.warm,
            "host_store": self.host_store and rank == 0,
            "post_mortem": self.post_mortem,
        }
        if self.telemetry is not None:  # lets the rank's agent trace it, dump its stack, time its steps
            out["telemetry"] = self.telemetry
        return out
