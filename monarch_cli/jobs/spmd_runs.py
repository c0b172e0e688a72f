"""One ``run-spmd`` on a reservation, from its options to its recorded result (``Job.run_spmd``).

The attempts torchrun's ``--max-restarts`` allows, each attempt's console and logs, the first
run's rendezvous check, the workspace sync hosts get first, and the result written beside the
logs and into the state file. A mixin of :class:`.job.Job`, so that the reservation's lifecycle
(``job.py``: serve, status, stop, questions) and a run's orchestration are each a module a
reader can hold; ``exec`` (in ``job.py``) shares the host preparation and the result here.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import re
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any, BinaryIO, cast

from ..sysutil import atomic_write
from . import run_owner
from .command import Command, command_and_hosts
from .console import CLOSED_PIPE_EXIT, ConsoleStream
from .errors import JobError
from .lifecycle import RunControl, shutdown_timeout_from, stall_timeout_from
from .model import HostSet, Launch, RankExit, RunOptions, RunResult
from .output import OutputSink, new_run_dir
from .plan import plan_spmd, remote_environment, user_environment
from .rendezvous import unreachable_rendezvous
from .spmd import SpmdRunner, new_run_id
from .state import JobState, StateError, load_state, save_state
from .telemetry import NO_TELEMETRY, RunRecorder, RunTelemetry
from .telemetry import enabled as telemetry_enabled
from .torchrun import SpmdSpec, parse_command

if TYPE_CHECKING:
    from ..schedulers import Scheduler
    from .sync import SyncReport

_RUN_ID = re.compile(r"[0-9]{8}-[0-9]{9}-[0-9a-f]{4}")  # new_run_id()'s shape: also a directory name


@dataclasses.dataclass
class _SpmdRun:
    """What every attempt of one ``run_spmd`` shares."""

    spec: SpmdSpec
    argv: list[str]
    cwd: str | None  # None: here
    run_id: str
    log_dir: Path
    hostset: HostSet
    runner: SpmdRunner
    opts: RunOptions  # its consoles resolved
    node_cwd: dict[int, str]
    node_environ: dict[int, dict[str, str]]
    telemetry: RunRecorder


class SpmdRuns:
    """The run half of :class:`~.job.Job`: ``run_spmd`` and what each of its attempts needs, and
    the host preparation ``exec`` shares. ``Job`` provides the reservation (declared below)."""

    if TYPE_CHECKING:
        state: JobState
        path: Path

        @property
        def logs_root(self) -> Path: ...

        @property
        def scheduler(self) -> Scheduler: ...

        def hostset(self, require_all: bool = True, questions_only: bool = False) -> HostSet: ...

        def sync(self, workspace: str | Path | None = None, *, hostset: HostSet | None = None) -> SyncReport: ...

    def run_spmd(
        self, command: Command | None = None, options: RunOptions | None = None, **overrides: Any
    ) -> RunResult:
        """Run the served command (or ``command``) on the reservation; returns how it went.

        How it runs is a :class:`RunOptions` (``options``), or its fields as keywords (``overrides``,
        applied on top of ``options``): ``job.run_spmd(["torchrun", "train.py"], cold=True)``.

        The served command runs in the directory it was served from, so its relative paths
        mean what they meant to ``serve``; ``command`` runs in the current directory, as any
        command line typed here would.

        Every rank's output streams to ``stdout``/``stderr`` with a ``[rankN]`` prefix and is
        kept in ``logs_root/<run-id>/rank<N>.log``. A rank that calls ``breakpoint()`` pauses
        and is announced through ``on_event``; ``monarch debug`` attaches to it. SIGTERM, SIGHUP
        and SIGQUIT to the caller are forwarded and end the run as torchrun does. Hosts that do
        not share this filesystem first get the workspace mirrored, and their ranks run in the
        mirror at the same relative directory. A failed run is restarted up to torchrun's
        ``--max-restarts`` times, unless it was ended from outside.
        ``run_id`` (from :func:`new_run_id`) lets a caller that starts the run elsewhere (the MCP
        server's detached runs) know its logs and telemetry before it starts. ``group`` prints a line
        that many ranks print alike once, ``[rank 0-4095] ...`` (see :class:`RunOptions`).
        """
        opts = dataclasses.replace(options, **overrides) if options is not None else RunOptions(**overrides)
        if math.isnan(opts.straggler_grace) or opts.straggler_grace < 0:
            raise JobError(f"--straggler-grace takes seconds (0 or more), not {opts.straggler_grace}")
        stall_timeout_from(opts.stall_timeout)  # refused before anything starts
        argv, cwd, spec = self._spmd_command(command)
        if opts.run_id is not None and not _RUN_ID.fullmatch(opts.run_id):
            raise JobError(f"not a run id: {opts.run_id!r} (make one with new_run_id())")
        hostset = self.hostset()
        run_id = opts.run_id or new_run_id()
        if opts.ranks is not None:  # refused before anything starts
            _check_ranks(opts.ranks, len(plan_spmd(spec, hostset, run_id, cold=opts.cold, master_port=0, cwd=cwd)))
        log_dir = new_run_dir(self.logs_root, run_id)
        run_owner.claim(log_dir)  # a reader can tell this run from one whose client died
        try:
            return self._run_in(opts, argv, cwd, spec, hostset, run_id, log_dir)
        except BaseException as e:
            run_owner.failed(log_dir, " ".join(str(e).split()) or type(e).__name__)
            raise

    def _run_in(
        self,
        opts: RunOptions,
        argv: list[str],
        cwd: str | None,
        spec: SpmdSpec,
        hostset: HostSet,
        run_id: str,
        log_dir: Path,
    ) -> RunResult:
        """The run, once its log directory is claimed: prepare the hosts, run the attempts, record."""
        node_cwd, node_environ = self._prepare_hosts(
            hostset, cwd or os.getcwd(), opts.workspace, opts.sync, opts.env or {}, opts.say
        )
        if spec.moot_flags():
            opts.say(
                f"{', '.join(spec.moot_flags())} not used: the reservation's hosts and agents do torchrun's "
                "rendezvous, on rank 0's host"
            )
        timeout = opts.shutdown_timeout if opts.shutdown_timeout is not None else spec.shutdown_timeout
        runner = SpmdRunner(
            hostset,
            log_dir,
            grace=opts.grace,
            say=opts.say,
            straggler_grace=opts.straggler_grace,
            shutdown_timeout=shutdown_timeout_from(timeout),
            stall_timeout=stall_timeout_from(opts.stall_timeout),
        )
        stdout, stderr = _consoles(opts.stdout, opts.stderr, runner)
        run = _SpmdRun(
            spec=spec,
            argv=argv,
            cwd=cwd,
            run_id=run_id,
            log_dir=log_dir,
            hostset=hostset,
            runner=runner,
            opts=dataclasses.replace(opts, stdout=stdout, stderr=stderr),
            node_cwd=node_cwd,
            node_environ=node_environ,
            telemetry=(
                RunTelemetry(self.path.parent, run_id, argv, log_dir, self.state.reservation_id)
                if telemetry_enabled()
                else NO_TELEMETRY
            ),
        )
        started = time.monotonic()
        try:
            exits, attempt = self._run_attempts(run)
        except BaseException:
            run.telemetry.finish(None)
            raise
        result = _result(run_id, exits, time.monotonic() - started, log_dir, attempt, runner.control)
        result = _console_verdict(result, stdout, stderr)
        run.telemetry.finish(result)
        self._record(result, argv)
        return result

    def _spmd_command(self, command: Command | None) -> tuple[list[str], str | None, SpmdSpec]:
        """The command line, the directory it runs in (None: here) and what it asks torchrun for."""
        argv = command_and_hosts(command, None)[0] if command is not None else list(self.state.default_command)
        cwd = self.state.default_cwd if command is None else None
        if not argv:
            raise JobError("no command to run: give one after `--`, or serve with a default command")
        return argv, cwd, parse_command(argv)

    def _run_attempts(self, run: _SpmdRun) -> tuple[list[RankExit], int]:
        """Run, and run again after a failure while torchrun's ``--max-restarts`` allow; the last
        attempt's exits and its number."""
        attempt = 0
        while True:
            exits = self._run_attempt(run, attempt)
            self._explain_losses(exits)
            failed = [e for e in exits if not e.ok]
            if not failed or run.runner.ended_from_outside or attempt >= run.spec.max_restarts:
                return exits, attempt
            attempt += 1
            run.opts.say(
                f"rank {failed[0].rank} failed ({failed[0].how}); restart {attempt} of {run.spec.max_restarts}"
            )

    def _check_rendezvous(self, run: _SpmdRun, launches: list[Launch], port: int) -> None:
        """The reservation's first run spans hosts: each must reach rank 0's port, or one line says
        which cannot (not a gloo timeout blamed on a rank)."""
        nodes = sorted({launch.node for launch in launches} - {0})
        if not nodes:
            return
        address = run.spec.master_addr or run.hostset.infos[0]["addr"]
        why = unreachable_rendezvous(run.runner.mb, run.hostset.hosts, nodes, address, port)
        if why is not None:
            raise JobError(why)

    def _run_attempt(self, run: _SpmdRun, attempt: int) -> list[RankExit]:
        opts, runner = run.opts, run.runner
        port = None if run.spec.master_port is not None else runner.reserve_port(0, run.run_id)
        try:
            launches = plan_spmd(
                run.spec,
                run.hostset,
                run.run_id,
                cold=opts.cold,
                master_port=port,
                restart_count=attempt,
                post_mortem=opts.post_mortem,
                keep=opts.keep_ranks,
                cwd=run.cwd,
                environ={**user_environment(), **(opts.env or {})},
                node_cwd=run.node_cwd,
                node_environ=run.node_environ,
            )
            if port is not None and attempt == 0 and self.state.last_run is None:
                self._check_rendezvous(run, launches, port)
        except BaseException:
            if port is not None:  # refused (e.g. --nnodes too large): the agent must not keep it
                runner.release_port(0, run.run_id)
            raise
        sink = self._sink(run, launches, attempt)
        try:
            return runner.run(
                launches,
                run.run_id,
                sink,
                on_pause=lambda r, h, w: opts.say(_pause_notice(r, h, w)),
                on_notice=opts.say if attempt == 0 else None,
                forward_signals=opts.forward_signals,
                telemetry=run.telemetry,
                attempt=attempt,
            )
        finally:
            sink.close()

    def _prepare_hosts(
        self,
        hostset: HostSet,
        cwd: str,
        workspace: str | Path | None,
        sync: bool,
        env: dict[str, str],
        say: Callable[[str], None],
    ) -> tuple[dict[int, str], dict[int, dict[str, str]]]:
        """Sync the workspace; where ranks run, and with what environment, on synced hosts."""
        if not sync:
            return {}, {}
        ws = os.path.abspath(workspace if workspace is not None else cwd)
        rel = os.path.relpath(os.path.abspath(cwd), ws)
        if rel == ".." or rel.startswith(".." + os.sep):
            raise JobError(f"the run's directory {cwd} is outside the workspace {ws}; give --workspace a parent of it")
        report = self.sync(ws, hostset=hostset)
        if report.changed or report.outside_links:
            say(str(report))
        for warning in report.warnings:
            say(warning)
        remote_env = {"PYTHONUNBUFFERED": "1", **remote_environment(), **env}
        node_cwd = {n: os.path.normpath(os.path.join(d, rel)) for n, d in report.directories.items()}
        return node_cwd, {n: remote_env for n in report.directories}

    def _explain_losses(self, exits: list[RankExit]) -> None:
        """A host stops answering, or its ranks are signalled by nobody we know of, most often
        because its allocation ended (a time limit: the scheduler signals the ranks, then kills
        the agents; which the client sees first is a race): ask the scheduler which. A rank whose
        agent named a cause (its warm process died) is asked about too: the same end of the
        allocation may have signalled that process first."""
        unexplained = [e for e in exits if e.lost or (e.signal is not None and not e.stopped)]
        if not unexplained:
            return
        probe = self.scheduler.probe(self.state)
        why = probe.reason if probe.gone else ""
        for e in unexplained if why else ():
            if e.lost:
                e.lost = f"{e.lost}: {why}"
            else:
                e.cause = f"{e.cause}; {why}" if e.cause else why

    def _sink(self, run: _SpmdRun, launches: list[Launch], attempt: int) -> OutputSink:
        """Where an attempt's output goes: the console (the ranks and streams asked for), our logs, and
        torchrun's ``--log-dir`` layout when it was given."""
        spec, opts = run.spec, run.opts
        labels = {l.rank: l.label for l in launches}
        nproc = 1 + max(l.local for l in launches)
        shown = set(labels) if opts.ranks is None else set(opts.ranks)
        if spec.local_ranks_filter is not None:
            shown = {r for r in shown if r % nproc in spec.local_ranks_filter}
        # Only ranks with streams kept off the console, one set per local rank (not per rank: 32,768 of them).
        per_local = {local: _streams(spec.redirects, local) for local in range(nproc)}
        hidden = {r: per_local[r % nproc] for r in labels if per_local[r % nproc]}
        extra = {}
        if spec.log_dir:  # torchrun's layout, as well as ours
            base = Path(run.cwd or ".") / spec.log_dir / run.run_id / f"attempt_{attempt}"  # relative to the ranks' cwd
            for r in labels:
                extra[(r, 1)] = base / str(r) / "stdout.log"
                extra[(r, 2)] = base / str(r) / "stderr.log"
        return OutputSink(
            run.log_dir,
            labels,
            console=shown,
            hidden_streams=hidden,
            color=opts.color,
            stdout=opts.stdout,
            stderr=opts.stderr,
            extra_logs=extra,
            group=opts.group,
        )

    def _record(self, result: RunResult, argv: list[str]) -> None:
        # Whole or not at all: a client killed mid-write left a torn file that read as "internal error".
        atomic_write(result.log_dir / "result.json", json.dumps({**result.to_json(), "command": argv}, indent=1))
        try:
            state = load_state(self.path)
        except StateError:
            return  # stopped or replaced meanwhile: nothing to record into
        if state.reservation_id != self.state.reservation_id:
            return
        state.last_run = {
            "run_id": result.run_id,
            "exit_code": result.exit_code,
            "duration": round(result.duration, 3),
            "finished_at": time.time(),
            "command": argv,
        }
        save_state(state, self.path)
        self.state = state


def _pause_notice(rank: int, host: str, where: dict[str, Any]) -> str:
    what = "stopped after an uncaught exception" if where.get("reason") == "post-mortem" else "paused"
    return (
        f"rank {rank} {what} at {where.get('file')}:{where.get('line')} in {where.get('function')}() "
        f"on {host}; attach with: monarch debug attach {rank}"
    )


def _consoles(stdout: BinaryIO | None, stderr: BinaryIO | None, runner: SpmdRunner) -> tuple[BinaryIO, BinaryIO]:
    """The run's output streams; when their reader goes away (``| head``), the run ends quietly."""
    return (
        cast(BinaryIO, ConsoleStream(stdout or sys.stdout.buffer, runner.console_closed)),
        cast(BinaryIO, ConsoleStream(stderr or sys.stderr.buffer, runner.console_closed)),
    )


def _reader_gone(*streams: BinaryIO) -> bool:
    return any(getattr(s, "reader_gone", False) for s in streams)


def _console_verdict(result: RunResult, *streams: BinaryIO) -> RunResult:
    """A run whose output lost its reader exits as a tool under SIGPIPE does (141)."""
    if _reader_gone(*streams):
        result.console_closed, result.exit_code = True, CLOSED_PIPE_EXIT
    return result


def _check_ranks(ranks: set[int], world_size: int) -> None:
    """Ranks to show that the run does not have are a mistake, not a silent console."""
    unknown = sorted(r for r in ranks if not 0 <= r < world_size)
    have = "rank 0" if world_size == 1 else f"ranks 0-{world_size - 1}"
    if not ranks:
        raise JobError(f"--ranks names no rank; this run has {have}")
    if unknown:
        raise JobError(f"--ranks {','.join(map(str, unknown))}: no such rank; this run has {have}")


def _streams(redirects: str | None, local_rank: int) -> set[int]:
    """torchrun's --redirects value for one local rank, as the streams kept off the console."""
    if not redirects:
        return set()
    value = redirects
    if ":" in redirects:
        table = dict(item.split(":") for item in redirects.split(","))
        value = table.get(str(local_rank), "0")
    return {0: set(), 1: {1}, 2: {2}, 3: {1, 2}}[int(value)]


def _result(
    run_id: str, exits: list[RankExit], duration: float, log_dir: Path, restarts: int, control: RunControl | None
) -> RunResult:
    first = next((e for e in exits if not e.ok), None)
    status = first.status if first else 0
    if control is None:
        return RunResult(run_id, status, exits, duration, log_dir, first, restarts)
    return RunResult(
        run_id,
        control.exit_code(status),
        exits,
        duration,
        log_dir,
        first,
        restarts,
        interrupted=control.interrupts > 0,
        ending=control.ending(),
        received_signal=control.received,
        stopped_by=control.stopped_by,
        stragglers=control.stragglers,
    )
