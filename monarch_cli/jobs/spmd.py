"""Running a torchrun-style command on a reservation's hosts, from the controller's side.

The runner hands each host agent its ranks (placed by :mod:`.plan`, with torchrun's whole
environment contract), streams output to an :class:`OutputSink`, and decides the outcome:
the first rank to fail sets the exit status, the rest are stopped after a grace period.
How a run is ended from outside (Ctrl-C, SIGTERM, ``monarch stop``) is decided in
:mod:`.lifecycle`.
"""

from __future__ import annotations

import contextlib
import gc
import os
import signal
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from ..config import settings
from ..runtime import protocol
from ..runtime.errors import ActorError, CallTimeout, RelayLost
from ..runtime.mailbox.future import Future, gather
from ..runtime.transport import wire
from .errors import JobError
from .lifecycle import DEATH_SIGNALS, DEFAULT_SHUTDOWN_TIMEOUT, DEFAULT_STRAGGLER_GRACE, RunControl, SignalRelay
from .model import HostSet, Launch, RankExit
from .output import OutputSink
from .partition import PartitionWatch
from .telemetry import NO_TELEMETRY, RunRecorder

#: Output bytes from one host after which the runner credits them back (see ``ranks.OUTPUT_WINDOW``).
_CREDIT_EVERY = 1 << 20
#: Allocations between young collections while a run is in progress (Python's default: 700).
_RUN_GC_THRESHOLD = 50_000
#: Seconds after the last run ends before the collector is given back (see _fewer_collections).
_GC_BACK_AFTER = 5.0
_gc_lock = threading.Lock()
_gc_runs = 0  # runs in progress in this process
_gc_saved: tuple[int, int, int] | None = None  # the thresholds to give back; None: not held
_gc_timer: threading.Timer | None = None


@contextlib.contextmanager
def _fewer_collections() -> Any:
    """While a run is in progress, what existed before it (the hosts, the launches, the modules) is
    not traversed again by the cyclic collector (``gc.freeze``), and young collections come every
    50,000 allocations, not 700. A 4,096 x 8 run's client spent 0.2-0.5 s of its 1.2-1.6 s of CPU
    in the collector, mostly in full collections over the reservation's 32,768 ranks' objects,
    which found nothing (measured in turns, 2026-11-26). Cycles made during the run are still
    collected. The collector is given back (unfrozen, thresholds restored) 5 s after the last run
    ends, not as it ends: giving it back triggers a full collection over everything (0.1-0.3 s at
    4,096 hosts), which would land inside the run's end, before its summary; runs back to back
    share one hold, and the CLI, which exits after its run, never pays it."""
    global _gc_runs, _gc_saved, _gc_timer
    with _gc_lock:
        _gc_runs += 1
        if _gc_timer is not None:
            _gc_timer.cancel()
            _gc_timer = None
        if _gc_saved is None:
            _gc_saved = gc.get_threshold()
            gc.set_threshold(max(_gc_saved[0], _RUN_GC_THRESHOLD), *_gc_saved[1:])
            # Frozen once per hold, not per run: what runs back to back leave behind (a finished
            # run's sink) stays collectable, and is not kept until the hold ends.
            gc.freeze()
    try:
        yield
    finally:
        with _gc_lock:
            _gc_runs -= 1
            if _gc_runs == 0:
                _gc_timer = threading.Timer(_GC_BACK_AFTER, _give_collector_back)
                _gc_timer.daemon = True
                _gc_timer.start()


def _give_collector_back() -> None:
    global _gc_saved, _gc_timer
    with _gc_lock:
        if _gc_runs == 0 and _gc_saved is not None:
            gc.set_threshold(*_gc_saved)
            gc.unfreeze()
            _gc_saved = _gc_timer = None


def new_run_id() -> str:
    """Sortable to the millisecond, unique by its suffix."""
    now = time.time()
    return time.strftime("%Y%m%d-%H%M%S", time.localtime(now)) + f"{int(now * 1000) % 1000:03d}-" + os.urandom(2).hex()


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
        with _fewer_collections():
            return self._run(launches, run_id, sink, on_pause, on_notice, forward_signals, telemetry, attempt)

    def _run(
        self,
        launches: list[Launch],
        run_id: str,
        sink: OutputSink,
        on_pause: Callable[[int, str, dict[str, Any]], None] | None,
        on_notice: Callable[[str], None] | None,
        forward_signals: Sequence[int],
        telemetry: RunRecorder,
        attempt: int,
    ) -> list[RankExit]:
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
            del acks  # 4,096 answered futures (~5 MB) are not held while the run's events flood in
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
            except RelayLost as e:  # a request lost with the relay that carried it (fanout.py)
                gone = next((h.name for h in self.hs.hosts if h.agent == e.relay), e.relay)
                raise JobError(
                    f"the run's ranks could not be started on every host: host {gone}, which relayed "
                    "the others' requests, stopped answering; `monarch status` says which hosts still answer"
                ) from None
            except ActorError as e:  # an agent refused the request
                raise JobError(f"the run's ranks could not be started on every host: {e}") from None
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
