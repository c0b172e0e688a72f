"""Reserve once, run many: the Python API behind ``monarch serve/run-spmd/status/stop/exec``."""

from __future__ import annotations

import dataclasses
import json
import math
import os
import re
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, BinaryIO, cast

from ..runtime import protocol
from ..runtime.mailbox.mailbox import Mailbox
from ..runtime.transport.keys import Keys

if TYPE_CHECKING:
    from ..runtime.actor.mesh import HostMesh
    from .inspector import Diagnosis, Inspector, RankRow, StackReport
from ..config import configure
from ..schedulers import Scheduler, get_scheduler
from ..schedulers.agents import controller_host
from . import fanout
from .command import Command, command_and_hosts
from .console import CLOSED_PIPE_EXIT, ConsoleStream
from .errors import JobError
from .lifecycle import RunControl, shutdown_timeout_from, stall_timeout_from
from .model import HostSet, Launch, RankExit, RunOptions, RunResult, StaleReservation
from .output import OutputSink, list_runs, new_run_dir
from .plan import plan_exec, plan_spmd, remote_environment, user_environment
from .rendezvous import unreachable_rendezvous
from .spmd import SpmdRunner, new_run_id
from .state import HostRecord, JobState, StateError, clear_state, load_state, save_state, state_path
from .sync import SyncReport, sync_workspace
from .telemetry import NO_TELEMETRY, RunRecorder, RunTelemetry
from .telemetry import enabled as telemetry_enabled
from .torchrun import SpmdSpec, parse_command

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


class Job:
    """A reservation, reattachable from any process through its state file."""

    def __init__(self, state: JobState, path: Path) -> None:
        self.state = state
        self.path = path

    @property
    def keys(self) -> Keys:
        return Keys.decode(self.state.keys)

    @property
    def logs_root(self) -> Path:
        return self.path.parent / "logs"

    @property
    def scheduler(self) -> Scheduler:
        return get_scheduler(self.state.scheduler)

    def hostset(self, require_all: bool = True, questions_only: bool = False) -> HostSet:
        """Connect to the reservation's agents. Every one must answer unless not ``require_all`` (then a host
        that does not has None for its info); a reservation its scheduler says is gone is a StaleReservation.
        ``questions_only``: the caller only asks every host questions (``HostSet.ask_all``), which
        thousands of hosts answer through relays (:mod:`.fanout`)."""
        probe = self.scheduler.probe(self.state) if require_all else None
        if probe is not None and probe.gone:
            raise StaleReservation(
                f"reservation {self.state.reservation_id} is gone ({probe.reason}); "
                "run `monarch serve --replace` for a new one, or `monarch stop` to clear it"
            )
        hosts = self._reachable_hosts()
        dead = [] if require_all else self.scheduler.dead_hosts(self.state)
        # Agents reached at their own addresses reach each other there: they can probe each other
        # (a partition between hosts) and relay questions (not through a backend's forwards).
        reachable = all(h.agent == rec.agent for h, rec in zip(hosts, self.state.hosts))
        return HostSet(
            hosts,
            self.keys,
            require_all=require_all,
            known_dead=dead,
            peers_reachable=reachable,
            questions_only=questions_only,
        )

    def _reachable_hosts(self) -> list[HostRecord]:
        """The hosts with the agent addresses this process reaches them at (a backend's forward, or
        their own); this process's mailbox is set to listen where they can reach it back."""
        addresses = self.scheduler.agent_addresses(self.state)
        hosts = [h if a == h.agent else dataclasses.replace(h, agent=a) for h, a in zip(self.state.hosts, addresses)]
        host = controller_host([h.agent for h in hosts])
        if host is not None:  # agents on other hosts could not reach a loopback address
            configure(host=host)
        return hosts

    def host_mesh(self) -> HostMesh:
        """The reservation's hosts as an actor-API :class:`~monarch_cli.runtime.actor.mesh.HostMesh`
        (``job.host_mesh().spawn_procs({"gpus": 8})``). A host this process reaches through a
        backend's forward (ssh ``--tunnel``) cannot reach this process either: its procs are
        driven through its agent, on the one connection to it; the others talk directly."""
        from ..runtime.actor.mesh import HostMesh

        hosts = self._reachable_hosts()
        try:
            Mailbox.get(self.keys)  # the actor API's one mailbox: this reservation's keys
        except RuntimeError as e:
            raise JobError(f"cannot drive reservation {self.state.reservation_id}'s actors: {e}") from None
        relay = [h.agent != rec.agent for h, rec in zip(hosts, self.state.hosts)]
        return HostMesh.connect([h.agent for h in hosts], relay=relay)

    # ------------------------------------------------------------------ runs
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
        stall_timeout = stall_timeout_from(opts.stall_timeout)
        argv, cwd, spec = self._spmd_command(command)
        if opts.run_id is not None and not _RUN_ID.fullmatch(opts.run_id):
            raise JobError(f"not a run id: {opts.run_id!r} (make one with new_run_id())")
        hostset = self.hostset()
        run_id = opts.run_id or new_run_id()
        if opts.ranks is not None:  # refused before anything starts
            _check_ranks(opts.ranks, len(plan_spmd(spec, hostset, run_id, cold=opts.cold, master_port=0, cwd=cwd)))
        log_dir = new_run_dir(self.logs_root, run_id)
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
            stall_timeout=stall_timeout,
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

    def sync(self, workspace: str | Path | None = None, *, hostset: HostSet | None = None) -> SyncReport:
        """Mirror ``workspace`` (default: here) to every host that does not share this filesystem
        (through ``hostset`` when the caller is already connected)."""
        hostset = hostset or self.hostset()
        return sync_workspace(
            hostset.mb,
            hostset.hosts,
            self.state.reservation_id,
            str(workspace if workspace is not None else os.getcwd()),
            self.path.parent,
        )

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

    def exec(
        self,
        command: Command,
        *,
        color: bool | None = None,
        stdout: BinaryIO | None = None,
        stderr: BinaryIO | None = None,
        on_event: Callable[[str], None] | None = None,
    ) -> RunResult:
        """Run a shell command on every host; output is prefixed with the host's name.

        It runs in this directory, or in its mirror on hosts that do not share it (synced first).
        """
        argv = [command] if isinstance(command, str) else [str(c) for c in command]  # a string: for sh -c
        if not argv or not "".join(argv).strip():
            raise JobError("no command given to exec")
        hostset = self.hostset()
        run_id = "exec-" + new_run_id()
        log_dir = new_run_dir(self.logs_root, run_id)
        node_cwd, node_environ = self._prepare_hosts(hostset, os.getcwd(), None, True, {}, lambda _msg: None)
        launches = plan_exec(argv, hostset, node_cwd=node_cwd, node_environ=node_environ)
        runner = SpmdRunner(
            hostset,
            log_dir,
            grace=float("inf"),
            say=on_event,
            straggler_grace=float("inf"),
            shutdown_timeout=shutdown_timeout_from(None),
        )
        stdout, stderr = _consoles(stdout, stderr, runner)
        sink = OutputSink(
            log_dir, {l.rank: l.label for l in launches}, color=color, stdout=stdout, stderr=stderr, group_noun="host"
        )
        started = time.monotonic()
        try:
            exits = runner.run(launches, run_id, sink)
        finally:
            sink.close()
        exits.sort(key=lambda e: e.rank)
        self._explain_losses(exits)
        return _console_verdict(
            _result(run_id, exits, time.monotonic() - started, log_dir, 0, runner.control), stdout, stderr
        )

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
        (result.log_dir / "result.json").write_text(json.dumps({**result.to_json(), "command": argv}, indent=1))
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

    # --------------------------------------------------------------- control
    def status(self) -> dict[str, Any]:
        """Scheduler, hosts with agent liveness, age and the last run; never raises for a stale job."""
        hostset = self.hostset(require_all=False, questions_only=True)  # each host answers, or not, for itself
        dead = hostset.unanswered()
        stale = None
        probe = self.scheduler.probe(self.state)  # cheap; the scheduler may know better than a ping
        if probe.gone and not dead:  # e.g. Slurm ended the job while its agents still answer
            stale = (
                f"reservation {self.state.reservation_id} is gone ({probe.reason}); run `monarch serve "
                "--replace` for a new one, or `monarch stop` to clear it"
            )
        if dead:
            why = probe.reason if probe.gone else None
            how = "gone" if len(dead) == len(self.state.hosts) else "partly gone"
            stale = (
                f"reservation {self.state.reservation_id} is {how}: {', '.join(dead)} not answering"
                f"{f' ({why})' if why else ''}; run `monarch serve --replace` for a new one, "
                "or `monarch stop` to clear it"
            )
        hosts = []
        for h, info in zip(self.state.hosts, hostset.infos):
            hosts.append(
                {
                    "name": h.name,
                    "agent": h.agent,
                    "alive": info is not None,
                    "ranks_running": info["ranks"] if info else None,
                    "warm": info.get("warm") if info else None,
                }
            )
        return {
            "state_file": str(self.path),
            "scheduler": self.state.scheduler,
            "reservation_id": self.state.reservation_id,
            "hosts": hosts,
            "alive": stale is None,
            "stale": stale,
            "age_seconds": round(time.time() - self.state.created_at, 1),
            "default_command": self.state.default_command,
            "default_cwd": self.state.default_cwd,
            "last_run": self.state.last_run,
            # Hosts that passed the question on to the others (0: every host was asked directly).
            "relays": len(fanout.relay_groups(len(self.state.hosts))) if hostset.through_relays else 0,
            "scheduler_lines": self.scheduler.status_lines(self.state),
            **self.scheduler.describe(self.state),
        }

    def check_relays(self) -> list[str]:
        """Ask every host through the relays later questions (``status``, ``stack``) will use,
        so that those relays hold their connections from now on (``serve`` does this for a
        reservation of ``settings().relay_from_hosts`` hosts or more); the hosts that did not answer."""
        try:
            hs = self.hostset(require_all=False, questions_only=True)
        except JobError:  # the first command says what is wrong
            return [h.name for h in self.state.hosts]
        return hs.unanswered()

    def wait_warm(self, timeout: float = 60.0) -> bool:
        """Wait until every host's warm process holds what past runs taught it (learning runs in
        the background after each run); False if that takes longer than ``timeout``."""
        deadline = time.monotonic() + timeout
        while True:
            warm = [h["warm"] for h in self.status()["hosts"]]
            if all(
                w and w["ready"] and not w["warming"] and (w["learned_held"] or not w.get("learning")) for w in warm
            ):
                return True
            if time.monotonic() >= deadline:
                return False
            time.sleep(0.2)

    def forget_preload(self) -> dict[str, int]:
        """Forget the modules each host's warm process learned from past runs (per host: how
        many); runs fork from one holding only the explicit preload until they teach it again."""
        hs = self.hostset(questions_only=True)
        counts = hs.ask_all(lambda cid: protocol.ForgetPreload(cid, hs.mb.address), 10.0)
        return {h.name: n for h, n in zip(hs.hosts, counts)}

    def stop(self, by: str = "monarch stop", **options: Any) -> list[str]:
        """Release the reservation and forget it; returns the runs that were in progress.

        Those runs are told first who stopped them (``by``, this pid, user@host), so they end
        saying so, with exit status 254, instead of as lost hosts. ``options`` are the backend's
        stop options (``Scheduler.stop_options``, e.g. skypilot's ``keep_cluster=True``).
        """
        scheduler = self.scheduler
        opts = scheduler.check_stop_options(options)  # bad input fails before anything is told or ended
        ended = self._announce_stop(by)
        scheduler.release_with(self.state, opts)
        clear_state(self.path)
        Mailbox.discard(self.keys)  # its threads and sockets served this reservation only
        return ended

    def _announce_stop(self, by: str, timeout: float = 2.0) -> list[str]:
        """Best effort: an agent that does not answer in ``timeout`` has no run to tell."""
        if self.scheduler.probe(self.state).gone:
            return []
        hosts = self._reachable_hosts()
        mb = Mailbox.for_keys(self.keys)
        who = _stopper(by)
        for h in hosts:
            mb.link(h.agent)
        asks = [mb.request(h.agent, lambda cid: protocol.Stopping(cid, mb.address, who)) for h in hosts]
        deadline = time.monotonic() + timeout
        ended: set[str] = set()
        for ask in asks:
            try:
                ended.update(ask.get(timeout=max(0.01, deadline - time.monotonic())))
            except Exception:  # noqa: BLE001 - a dead or old agent: nothing to tell
                pass
        return sorted(ended)

    def runs(self) -> list[Path]:
        return list_runs(self.logs_root)

    # ------------------------------------------------------------- telemetry
    def _inspector(self) -> Inspector:
        from .inspector import Inspector  # (here: a run does not load the inspection side)

        return Inspector(self.path.parent, lambda: self.hostset(questions_only=True))

    def sql(self, statement: str, params: Sequence[Any] = ()) -> list[dict[str, Any]]:
        """A read-only query of the reservation's telemetry store (``monarch sql --schema``)."""
        return self._inspector().sql(statement, params)

    def stacks(self, ranks: set[int] | None = None, native: bool = False) -> StackReport:
        """The Python stacks of the current run's live ranks, grouped by identical stack (and stored)."""
        return self._inspector().stacks(ranks, native)

    def diagnose(self, silence: float = 60.0) -> Diagnosis:
        """Which rank differs from the rest and why; ``exit_code`` 0 healthy, 1 suspect, 2 cannot tell."""
        return self._inspector().diagnose(silence)

    def top(self) -> tuple[str | None, list[RankRow]]:
        """(run id, one row per rank, most suspicious first)."""
        return self._inspector().top()


def _stopper(by: str) -> str:
    """``monarch stop (pid 123, from alice@login1 on /dev/pts/4)``: enough to find who and where."""
    import getpass
    import socket

    try:
        user = getpass.getuser()
    except (KeyError, OSError):
        user = str(os.getuid())
    tty = ""
    for fd in (0, 1, 2):
        try:
            tty = f" on {os.ttyname(fd)}"
            break
        except OSError:
            continue
    return f"{by} (pid {os.getpid()}, from {user}@{socket.gethostname()}{tty})"


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


def job_load(path: str | Path | None = None) -> Job:
    """Reattach to the reservation recorded at ``path`` (default ``.monarch/job_state.pkl``)."""
    p = state_path(path)
    return Job(load_state(p), p)
