"""Running a torchrun-style command on a reservation's hosts, from the controller's side.

The runner places ranks on hosts, hands each host agent its ranks with torchrun's whole
environment contract, streams output to an :class:`OutputSink`, and decides the outcome:
the first rank to fail sets the exit status, the rest are stopped after a grace period.
How a run is ended from outside (Ctrl-C, SIGTERM, ``monarch stop``) is decided in
:mod:`.lifecycle`.
"""

from __future__ import annotations

import dataclasses
import os
import signal
import threading
import time
import uuid
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from .. import __version__
from ..config import settings
from ..runtime import protocol, wire
from ..runtime.errors import CallTimeout
from ..runtime.exit_status import describe_status, signal_name
from ..runtime.future import Future, gather
from ..runtime.keys import Keys
from ..runtime.mailbox import Mailbox
from .errors import JobError
from .lifecycle import (
    DEATH_SIGNALS,
    DEFAULT_SHUTDOWN_TIMEOUT,
    DEFAULT_STRAGGLER_GRACE,
    EXIT_LOST,
    EXIT_STOPPED,
    RunControl,
    SignalRelay,
)
from .output import OutputSink
from .state import HostRecord
from .telemetry import enabled as telemetry_enabled
from .torchrun import SpmdSpec, rank_environment, resolve_nproc

if TYPE_CHECKING:
    from .telemetry import RunTelemetry

#: Output bytes from one host after which the runner credits them back (see ``ranks.OUTPUT_WINDOW``).
_CREDIT_EVERY = 1 << 20
#: Seconds per host added to the wait for the agents' first answers (their connections' handshakes).
_HANDSHAKE_ALLOWANCE = 0.02
_HOST_SPECIFIC = {"HOSTNAME", "PWD", "OLDPWD", "SHLVL", "_", "MONARCH_KEYS", "MONARCH_KEY_FILE", "TERM_SESSION_ID"}


class StaleReservation(JobError):
    """The reservation's agents are gone (allocation ended, processes killed)."""


class VersionMismatch(JobError):
    """The reservation's agents run another monarch-cli version than this client."""


@dataclasses.dataclass
class RankExit:
    """How one rank ended."""

    rank: int
    label: str
    host: str
    exitcode: int | None
    signal: int | None
    duration: float
    pid: int | None = None
    tail: list[str] = dataclasses.field(default_factory=list)
    lost: str = ""  # set when the rank's host went away instead of reporting
    cause: str = ""  # what ended it from outside, as its agent saw it (e.g. its warm process died)
    stopped: str = ""  # set when the reservation was released (monarch stop) while the rank ran

    @property
    def status(self) -> int:
        if self.stopped:
            return EXIT_STOPPED
        if self.lost:
            return EXIT_LOST
        return describe_status(self.exitcode, self.signal)[1]

    @property
    def how(self) -> str:
        how = self.stopped or self.lost or describe_status(self.exitcode, self.signal)[0]
        return f"{how}: {self.cause}" if self.cause and not (self.stopped or self.lost) else how

    @property
    def ok(self) -> bool:
        return self.status == 0


@dataclasses.dataclass
class RunResult:
    run_id: str
    exit_code: int
    ranks: list[RankExit]
    duration: float
    log_dir: Path
    first_failure: RankExit | None = None
    restarts: int = 0
    interrupted: bool = False
    #: How the run was ended from outside ("received SIGTERM; forwarded to ranks; ..."), or "".
    ending: str = ""
    received_signal: int | None = None  # SIGTERM/SIGHUP/SIGQUIT sent to the caller
    stopped_by: str | None = None  # who released the reservation during the run
    stragglers: list[int] = dataclasses.field(default_factory=list)  # named as still running after the grace
    console_closed: bool = False  # its output's reader went away (`| head`): the run was ended

    def to_json(self) -> dict[str, Any]:
        return {
            "run_id": self.run_id,
            "exit_code": self.exit_code,
            "duration": round(self.duration, 3),
            "log_dir": str(self.log_dir),
            "restarts": self.restarts,
            "interrupted": self.interrupted,
            "ending": self.ending,
            "received_signal": signal_name(self.received_signal) if self.received_signal else None,
            "stopped_by": self.stopped_by,
            "stragglers": self.stragglers,
            "console_closed": self.console_closed,
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
    spec: protocol.RankSpec


def new_run_id() -> str:
    """Sortable to the millisecond, unique by its suffix."""
    now = time.time()
    return time.strftime("%Y%m%d-%H%M%S", time.localtime(now)) + f"{int(now * 1000) % 1000:03d}-" + uuid.uuid4().hex[:4]


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


class HostSet:
    """The reservation's agents as this controller talks to them."""

    def __init__(
        self,
        hosts: list[HostRecord],
        keys: Keys,
        timeout: float = 5.0,
        *,
        require_all: bool = True,
        known_dead: Sequence[str] = (),
    ) -> None:
        self.hosts = hosts
        self.mb = Mailbox.for_keys(keys)
        for h in hosts:  # one connection per host: everything comes back on it
            self.mb.link(h.agent)
        pings = [
            None if h.name in known_dead else self.mb.request(h.agent, lambda cid: protocol.Ping(cid, self.mb.address))
            for h in hosts
        ]
        self.infos: list[dict[str, Any]] = []
        # The hosts are asked at once and answer independently; thousands of CURVE handshakes
        # (a few ms each on a busy client) take longer than a few, so the wait grows with them.
        deadline = time.monotonic() + timeout + _HANDSHAKE_ALLOWANCE * len(hosts)
        for host, fut in zip(hosts, pings):
            try:
                if fut is None:
                    raise LookupError(host.name)  # no need to wait for an answer that cannot come
                info = fut.get(timeout=max(0.0, deadline - time.monotonic()))
            except Exception:  # noqa: BLE001 - any failure to answer means the same thing here
                if not require_all:  # `status`: this host is dead, the others may be fine
                    self.infos.append(None)  # type: ignore[arg-type]
                    continue
                raise StaleReservation(
                    f"host {host.name} (agent {host.agent}) is not answering: the reservation is gone or unreachable; "
                    "run `monarch serve --replace` for a new one, or `monarch stop` to clear it"
                ) from None
            _check_version(host, info)
            self.infos.append(info)


def _check_version(host: HostRecord, info: dict[str, Any]) -> None:
    """Client and agents must run the same monarch-cli: their messages and pickles are not
    versioned. Checked on every connection, whatever started the agent (an image, a remote
    install, a SkyPilot setup); an agent too old to say its version is not refused."""
    theirs = info.get("version")
    if theirs is not None and theirs != __version__:
        raise VersionMismatch(
            f"host {host.name} runs monarch-cli {theirs}, this client {__version__}: "
            f"install monarch-cli=={__version__} there (or this client's version here), then serve again"
        )


class SpmdRunner:
    """Runs launches on a :class:`HostSet` and reports how each ended.

    ``grace``: after a rank fails, the others get SIGTERM, and SIGKILL one grace later.
    ``shutdown_timeout``: after SIGTERM/SIGHUP/SIGQUIT to the caller, how long ranks have
    before SIGKILL. ``straggler_grace``: how long after the first rank ends the ranks still
    running are named (once) through ``say``.
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
    ) -> None:
        self.hs = hostset
        self.mb = hostset.mb
        self.log_dir = log_dir
        self.grace = grace
        self.shutdown_timeout = shutdown_timeout
        self.straggler_grace = straggler_grace
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
        master_node_port: int | None = None,
        on_interrupt: Callable[[int], None] | None = None,
        on_pause: Callable[[int, str, dict[str, Any]], None] | None = None,
        on_notice: Callable[[str], None] | None = None,
        forward_signals: Sequence[int] = (),
        telemetry: RunTelemetry | None = None,
        attempt: int = 0,
    ) -> list[RankExit]:
        mb = self.mb
        by_rank = {l.rank: l for l in launches}
        exits: dict[int, RankExit] = {}
        done: Future[None] = Future()  # resolved by agent events, on the mailbox's I/O thread
        first_failure: list[int] = []
        started = time.monotonic()
        lock = threading.Lock()
        nodes = sorted({l.node for l in launches})
        owed: dict[int, int] = {n: 0 for n in nodes}  # node -> output bytes printed, not yet credited
        host_of = {l.rank: self.hs.hosts[l.node].name for l in launches}
        control = self.control = RunControl(
            host_of,
            lambda sig: self._signal(nodes, run_id, sig),
            self.say,
            failure_grace=self.grace,
            shutdown_timeout=self.shutdown_timeout,
            straggler_grace=self.straggler_grace,
        )

        def running() -> dict[int, str]:
            return {r: h for r, h in host_of.items() if r not in exits}

        def on_output(event: protocol.Output, body: list[Any]) -> None:
            rank = event.rank
            if rank in by_rank:
                data = bytes(body[0])
                try:
                    sink.write(rank, event.stream, data)
                    if telemetry is not None:
                        telemetry.output(rank, event.stream, data)
                finally:  # credited even if the console failed (a closed pipe): never stall the ranks
                    # Credit once printed: a host sends only a window ahead, so a slow console
                    # holds the ranks back instead of letting output pile up in memory.
                    node = by_rank[rank].node
                    owed[node] += len(data)
                    if owed[node] >= _CREDIT_EVERY:
                        mb.send(self.hs.hosts[node].agent, protocol.OutputCredit(run_id, owed[node]))
                        owed[node] = 0

        def finish(rank: int, exit_: RankExit) -> None:
            with lock:
                if rank in exits:
                    return
                sink.end_of_rank(rank)
                exit_.tail = sink.tail(rank)
                exits[rank] = exit_
                if telemetry is not None:
                    telemetry.rank_exit(exit_)
                control.exited(rank, exit_.ok, time.monotonic())
                if not exit_.ok and not first_failure:
                    first_failure.append(rank)
                if len(exits) == len(launches) and not done.done():
                    done.set_result(None)

        def on_exit(event: protocol.RankExited, body: list[Any]) -> None:
            rank = event.rank
            if rank not in by_rank:
                return
            launch = by_rank[rank]
            # Never started: no status of its own.
            lost = event.cause if event.exitcode is None and event.signal is None else ""
            finish(
                rank,
                RankExit(
                    rank,
                    launch.label,
                    self.hs.hosts[launch.node].name,
                    event.exitcode,
                    event.signal,
                    event.duration,
                    event.pid,
                    lost=lost,
                    cause=event.cause,
                ),
            )

        def on_lost(agent: str, silence: float) -> None:
            for l in launches:
                if self.hs.hosts[l.node].agent == agent:
                    why = f"lost: host {self.hs.hosts[l.node].name} stopped answering ({silence:.1f} s)"
                    finish(
                        l.rank,
                        RankExit(
                            l.rank,
                            l.label,
                            self.hs.hosts[l.node].name,
                            None,
                            None,
                            time.monotonic() - started,
                            lost=why,
                        ),
                    )

        def on_stopped(event: protocol.ReservationStopped, body: list[Any]) -> None:
            with lock:
                control.stopped(event.who)
            here = [l for l in launches if self.hs.hosts[l.node].agent == event.agent]
            for l in here or launches:  # an agent known by another address: the whole reservation goes
                finish(
                    l.rank,
                    RankExit(
                        l.rank,
                        l.label,
                        self.hs.hosts[l.node].name,
                        None,
                        None,
                        time.monotonic() - started,
                        stopped="reservation stopped",
                    ),
                )

        def on_paused(event: protocol.RankPaused, body: list[Any]) -> None:
            if on_pause is not None:
                on_pause(event.rank, event.host, event.where)

        handlers: dict[type, Callable[[Any, list[Any]], None]] = {
            protocol.Output: on_output,
            protocol.RankExited: on_exit,
            protocol.RankPaused: on_paused,
            protocol.ReservationStopped: on_stopped,
        }
        if telemetry is not None:
            handlers[protocol.Telemetry] = telemetry.on_agent_event
            telemetry.started(launches, self.hs, attempt)
        subscription = mb.subscribe(run_id, handlers)  # this run's events only, until it ends
        for n in nodes:
            mb.watch_agent(self.hs.hosts[n].agent, on_lost)
        # Ctrl-C, torchrun's death signals, plus what the caller forwards (e.g. Slurm's SIGUSR1).
        relay = SignalRelay([signal.SIGINT, *DEATH_SIGNALS, *forward_signals])
        try:
            acks = []
            specs_of: dict[int, list[protocol.RankSpec]] = {n: [] for n in nodes}
            for l in launches:  # one pass: a loop over hosts per host is quadratic at thousands
                specs_of[l.node].append(l.spec)
            for n in nodes:
                specs = specs_of[n]
                acks.append(
                    mb.request(
                        self.hs.hosts[n].agent,
                        lambda cid: protocol.RunRanks(cid, mb.address, run_id, settings().heartbeat_timeout),
                        wire.dumps_data(specs),
                    )
                )
            if telemetry is not None:  # its thread opens the store now, not while the launch is on its way
                telemetry.writer.start()
            started_all, early = gather(acks), []
            ack_deadline = time.monotonic() + 30
            while not early:  # a Ctrl-C while a host is slow to start its ranks is not left waiting
                try:
                    made = started_all.get(timeout=0.2)
                except CallTimeout:
                    if time.monotonic() > ack_deadline:
                        raise
                    early = relay.take()
                    continue
                for n, reply in zip(nodes, made):
                    if on_notice is not None:
                        if reply["made_cold"]:
                            on_notice(_cold_notice(self.hs.hosts[n].name, reply["made_cold"]))
                        for notice in reply["notices"]:
                            on_notice(f"{self.hs.hosts[n].name}: {notice}")
                break
            while not done.done():
                try:
                    done.get(timeout=0.2)
                except Exception:  # noqa: BLE001 - timeouts: time to check deadlines
                    pass
                with lock:
                    if self._console_closed.is_set():
                        control.console_closed(time.monotonic())
                    for sig in [*early, *relay.take()]:
                        control.signal(sig, time.monotonic(), sorted(running()))
                        if sig == signal.SIGINT and on_interrupt is not None:
                            on_interrupt(control.interrupts)
                    early = []
                    abandon, why = control.tick(time.monotonic(), running())
                for rank in abandon:  # Ctrl-C always ends the wait, even for ranks whose exits never come
                    l = by_rank[rank]
                    finish(
                        rank,
                        RankExit(
                            rank, l.label, host_of[rank], None, None, time.monotonic() - started, lost=f"lost: {why}"
                        ),
                    )
        finally:
            relay.restore()
            for n in nodes:
                mb.unwatch_agent(self.hs.hosts[n].agent)
            subscription.close()
        ordered = [exits[r] for r in sorted(exits)]
        if first_failure and not control.stopped_by:  # stopped: no rank failed first
            ordered.sort(key=lambda e: (e.rank != first_failure[0], e.rank))
        self.interrupted = control.interrupts > 0
        return ordered

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
            {
                "rank": node,
                "env": {**(node_environ or {}).get(node, env), "GROUP_RANK": str(node), "NODE_RANK": str(node)},
                "cwd": (node_cwd or {}).get(node, os.getcwd()),
                "mode": "no_python",
                "program": shell,
                "python_args": [],
                "warm": False,
                "host_store": False,
            },
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
    if nnodes > len(hosts):
        raise JobError(f"--nnodes {nnodes} asks for more hosts than the {len(hosts)} reserved; serve more hosts first")
    if spec.nnodes_min is not None and spec.nnodes_min > len(hosts):
        raise JobError(
            f"--nnodes {spec.nnodes_min}:{spec.nnodes} needs at least {spec.nnodes_min} hosts; {len(hosts)} are reserved"
        )
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
    for node in range(nnodes):
        node_base = (node_environ or {}).get(node, base)
        for local in range(nproc):
            env = {
                **node_base,
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
                    environ=node_base,
                ),
            }
            rank = node * nproc + local
            if host_store:
                env["TORCHELASTIC_USE_AGENT_STORE"] = "True"  # rank 0 serves the store we reserved
            launch_spec: protocol.RankSpec = {
                "rank": rank,
                "env": env,
                "cwd": (node_cwd or {}).get(node, cwd),
                "mode": spec.mode,
                "program": spec.program,
                "python_args": spec.python_args,
                "warm": not cold and warm_capable(spec),
                "host_store": host_store and rank == 0,
                "post_mortem": post_mortem,
            }
            if telemetry_enabled():  # lets the rank's agent trace it, dump its stack, time its steps
                launch_spec["telemetry"] = {
                    "run_id": run_id,
                    "agent_pid": hostset.infos[node].get("pid"),
                    "dir": hostset.infos[node].get("telemetry_dir"),
                }
            launches.append(Launch(rank, f"rank{rank}", node, launch_spec))
    return launches
