"""Reserve once, run many: the Python API behind ``monarch serve/run-spmd/status/stop/exec``."""

from __future__ import annotations

import json
import os
import re
import shlex
import time
from pathlib import Path
from typing import Any, BinaryIO, Callable, Dict, List, Optional, Sequence, Set, Union

from ..runtime.keys import Keys
from ..config import configure
from ..schedulers import DryRun, ReserveRequest, Scheduler, controller_host, get_scheduler
from .errors import JobError
from .output import OutputSink, list_runs
from .spmd import HostSet, Launch, RankExit, RunResult, SpmdRunner, StaleReservation, new_run_id, plan_exec, plan_spmd
from .state import JobState, NoReservation, StateError, clear_state, load_state, save_state, state_path
from .torchrun import SpmdSpec, parse_command

Command = Union[str, Sequence[str], Any]  # a command line, an argv list, or a torchx AppDef


def _command_and_hosts(cmd: Command, hosts: Optional[int]) -> "tuple[List[str], Optional[int]]":
    """Accept an argv list, a shell string, or a torchx AppDef (its first role).

    The host count is ``hosts`` if given, else the AppDef's replicas, else None (the
    scheduler decides).
    """
    if cmd is None:
        return [], hosts
    if isinstance(cmd, str):
        return shlex.split(cmd), hosts
    roles = getattr(cmd, "roles", None)
    if roles is not None:  # torchx.specs.AppDef
        if len(roles) != 1:
            raise JobError(f"AppDef {getattr(cmd, 'name', '')!r} has {len(roles)} roles; monarch runs exactly one SPMD role")
        role = roles[0]
        argv = _unwrap_torchx_shell([role.entrypoint, *role.args])
        return argv, hosts or int(role.num_replicas)
    return [str(c) for c in cmd], hosts


_TORCHX_MACRO = re.compile(r"\$\{(\w+)(?::=([^}]*))?\}")


def _unwrap_torchx_shell(argv: List[str]) -> List[str]:
    """torchx's dist.ddp wraps torchrun in ``bash -c "..."`` with ``${macros}``: unwrap it.

    ``${app_id}`` becomes ``monarch`` (a run id is made per run anyway); ``${VAR:=default}``
    takes its default, as the shell would when VAR is unset. Its rendezvous flags are then
    served by the reservation itself.
    """
    if len(argv) == 3 and os.path.basename(argv[0]) in ("bash", "sh") and argv[1] == "-c":
        text = _TORCHX_MACRO.sub(lambda m: "monarch" if m.group(1) == "app_id" else (m.group(2) or ""), argv[2])
        inner = shlex.split(text)
        if inner and os.path.basename(inner[0]) in ("torchrun", "python", "python3"):
            return inner
    return argv


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

    def _hostset(self) -> HostSet:
        why = self.scheduler.gone(self.state)
        if why:
            raise StaleReservation(
                f"reservation {self.state.reservation_id} is gone ({why}); "
                "run `monarch serve --replace` for a new one, or `monarch stop` to clear it"
            )
        host = controller_host([h.agent for h in self.state.hosts])
        if host is not None:  # agents on other hosts could not reach a loopback address
            configure(host=host)
        return HostSet(self.state.hosts, self.keys)

    # ------------------------------------------------------------------ runs
    def run_spmd(
        self,
        command: Optional[Command] = None,
        *,
        cold: bool = False,
        ranks: Optional[Set[int]] = None,
        color: Optional[bool] = None,
        stdout: Optional[BinaryIO] = None,
        stderr: Optional[BinaryIO] = None,
        grace: float = 3.0,
        on_event: Optional[Callable[[str], None]] = None,
        post_mortem: bool = False,
        forward_signals: Sequence[int] = (),
    ) -> RunResult:
        """Run the served command (or ``command``) on the reservation; returns how it went.

        Every rank's output streams to ``stdout``/``stderr`` with a ``[rankN]`` prefix and is
        kept in ``logs_root/<run-id>/rank<N>.log``. A rank that calls ``breakpoint()`` pauses
        and is announced through ``on_event``; ``monarch debug`` attaches to it. With
        ``post_mortem``, a rank that raises stays paused at the failing frame.
        ``forward_signals`` (main thread only) are relayed to every rank while it runs, so a
        batch job's time-limit warning reaches the training script.
        """
        argv = _command_and_hosts(command, None)[0] if command is not None else list(self.state.default_command)
        if not argv:
            raise JobError("no command to run: give one after `--`, or serve with a default command")
        spec = parse_command(argv)
        hostset = self._hostset()
        run_id = new_run_id()
        log_dir = self.logs_root / run_id
        say = on_event or (lambda _msg: None)
        if spec.moot_flags():
            say(f"{', '.join(spec.moot_flags())} not used: the reservation's hosts and agents do torchrun's "
                "rendezvous, on rank 0's host")
        started = time.monotonic()
        exits: List[RankExit] = []
        attempt = 0
        runner = SpmdRunner(hostset, log_dir, grace=grace)
        while True:
            port = None if spec.master_port is not None else runner.reserve_port(0, run_id)
            launches = plan_spmd(spec, hostset, run_id, cold=cold, master_port=port, restart_count=attempt,
                                 post_mortem=post_mortem)
            sink = self._sink(spec, launches, log_dir, ranks, color, stdout, stderr, run_id, attempt)
            try:
                exits = runner.run(launches, run_id, sink, on_pause=lambda r, h, w: say(_pause_notice(r, h, w)),
                                   on_notice=say if attempt == 0 else None, forward_signals=forward_signals)
            finally:
                sink.close()
            self._explain_losses(exits)
            failed = [e for e in exits if not e.ok]
            if not failed or runner.interrupted or attempt >= spec.max_restarts:
                break
            attempt += 1
            say(f"rank {failed[0].rank} failed ({failed[0].how}); restart {attempt} of {spec.max_restarts}")
        result = _result(run_id, exits, time.monotonic() - started, log_dir, attempt, runner.interrupted)
        self._record(result, argv)
        return result

    def exec(self, command: Command, *, color: Optional[bool] = None, stdout: Optional[BinaryIO] = None,
             stderr: Optional[BinaryIO] = None) -> RunResult:
        """Run a shell command on every host; output is prefixed with the host's name."""
        argv = [command] if isinstance(command, str) else [str(c) for c in command]  # a string: for sh -c
        if not argv or not "".join(argv).strip():
            raise JobError("no command given to exec")
        hostset = self._hostset()
        run_id = "exec-" + new_run_id()
        log_dir = self.logs_root / run_id
        launches = plan_exec(argv, hostset)
        sink = OutputSink(log_dir, {l.rank: l.label for l in launches}, color=color, stdout=stdout, stderr=stderr)
        started = time.monotonic()
        runner = SpmdRunner(hostset, log_dir, grace=float("inf"))
        try:
            exits = runner.run(launches, run_id, sink)
        finally:
            sink.close()
        exits.sort(key=lambda e: e.rank)
        self._explain_losses(exits)
        return _result(run_id, exits, time.monotonic() - started, log_dir, 0, runner.interrupted)

    def _explain_losses(self, exits: List[RankExit]) -> None:
        """A host stops answering most often because its allocation ended: ask the scheduler which."""
        if any(e.lost for e in exits):
            why = self.scheduler.gone(self.state)
            for e in exits:
                if why and e.lost:
                    e.lost = f"{e.lost}: {why}"

    def _sink(self, spec: SpmdSpec, launches: List[Launch], log_dir: Path, ranks: Optional[Set[int]],
              color: Optional[bool], stdout: Optional[BinaryIO], stderr: Optional[BinaryIO],
              run_id: str, attempt: int) -> OutputSink:
        labels = {l.rank: l.label for l in launches}
        nproc = 1 + max(int(l.spec["env"]["LOCAL_RANK"]) for l in launches)
        shown = set(labels) if ranks is None else set(ranks)
        if spec.local_ranks_filter is not None:
            shown = {r for r in shown if r % nproc in spec.local_ranks_filter}
        hidden = {r: _streams(spec.redirects, r % nproc) for r in labels}
        extra = {}
        if spec.log_dir:  # torchrun's layout, as well as ours
            base = Path(spec.log_dir) / run_id / f"attempt_{attempt}"
            for r in labels:
                extra[(r, 1)] = base / str(r) / "stdout.log"
                extra[(r, 2)] = base / str(r) / "stderr.log"
        return OutputSink(log_dir, labels, console=shown, hidden_streams=hidden, color=color,
                          stdout=stdout, stderr=stderr, extra_logs=extra)

    def _record(self, result: RunResult, argv: List[str]) -> None:
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
    def status(self) -> Dict[str, Any]:
        """Scheduler, hosts with agent liveness, age and the last run; never raises for a stale job."""
        try:
            hostset: Optional[HostSet] = self._hostset()
            stale = None
        except StaleReservation as e:
            hostset, stale = None, str(e)
        hosts = []
        for i, h in enumerate(self.state.hosts):
            info = hostset.infos[i] if hostset else None
            hosts.append({"name": h.name, "agent": h.agent, "alive": info is not None,
                          "ranks_running": info["ranks"] if info else None,
                          "warm": info.get("warm") if info else None})
        return {
            "state_file": str(self.path),
            "scheduler": self.state.scheduler,
            "reservation_id": self.state.reservation_id,
            "hosts": hosts,
            "alive": stale is None,
            "stale": stale,
            "age_seconds": round(time.time() - self.state.created_at, 1),
            "default_command": self.state.default_command,
            "last_run": self.state.last_run,
            **self.scheduler.describe(self.state),
        }

    def wait_warm(self, timeout: float = 60.0) -> bool:
        """Wait until every host's warm process holds what past runs taught it (learning runs in
        the background after each run); False if that takes longer than ``timeout``."""
        deadline = time.monotonic() + timeout
        while True:
            warm = [h["warm"] for h in self.status()["hosts"]]
            if all(w and w["ready"] and not w["warming"] and w["learned_held"] for w in warm):
                return True
            if time.monotonic() >= deadline:
                return False
            time.sleep(0.2)

    def forget_preload(self) -> Dict[str, int]:
        """Forget the modules each host's warm process learned from past runs (per host: how
        many); runs fork from one holding only the explicit preload until they teach it again."""
        hs = self._hostset()
        futures = [hs.mb.request(h.agent, lambda cid: ("forget_preload", cid, hs.mb.address)) for h in hs.hosts]
        return {h.name: f.get(timeout=10) for h, f in zip(hs.hosts, futures)}

    def stop(self) -> None:
        """Release the reservation and forget it."""
        self.scheduler.release(self.state)
        clear_state(self.path)

    def runs(self) -> List[Path]:
        return list_runs(self.logs_root)


def _pause_notice(rank: int, host: str, where: Dict[str, Any]) -> str:
    what = "stopped after an uncaught exception" if where.get("reason") == "post-mortem" else "paused"
    return (f"rank {rank} {what} at {where.get('file')}:{where.get('line')} in {where.get('function')}() "
            f"on {host}; attach with: monarch debug attach {rank}")


def _streams(redirects: Optional[str], local_rank: int) -> Set[int]:
    """torchrun's --redirects value for one local rank, as the streams kept off the console."""
    if not redirects:
        return set()
    value = redirects
    if ":" in redirects:
        table = dict(item.split(":") for item in redirects.split(","))
        value = table.get(str(local_rank), "0")
    return {0: set(), 1: {1}, 2: {2}, 3: {1, 2}}[int(value)]


def _result(run_id: str, exits: List[RankExit], duration: float, log_dir: Path, restarts: int,
            interrupted: bool) -> RunResult:
    first = next((e for e in exits if not e.ok), None)
    return RunResult(run_id, first.status if first else 0, exits, duration, log_dir, first, restarts, interrupted)


# ---------------------------------------------------------------------- entry points
def serve(
    command: Command = None,
    scheduler: str = "local",
    *,
    hosts: Optional[int] = None,
    state: Union[str, Path, None] = None,
    replace: bool = False,
    preload: Optional[str] = None,
    progress: Optional[Callable[[str], None]] = None,
    **options: Any,
) -> Job:
    """Reserve hosts (or reuse a reservation that can serve this request) and return the job."""
    backend = get_scheduler(scheduler)
    argv, nhosts = _command_and_hosts(command, hosts)
    nhosts = nhosts or backend.default_hosts() or 1
    if nhosts < 1:
        raise JobError(f"--hosts must be at least 1, not {nhosts}")
    if argv:
        parse_command(argv)  # a bad default command is an error now, not at the first run
    request = ReserveRequest(hosts=nhosts, command=argv, options=options, preload=preload)
    path = state_path(state)
    say = progress or (lambda _msg: None)
    try:
        existing: Optional[Job] = job_load(path)
    except NoReservation:
        existing = None
    except StateError:
        if not replace:
            raise
        say(f"replacing unreadable state file {path}")
        clear_state(path)
        existing = None
    if existing is not None:
        why_not = backend.can_serve(existing.state, request)
        gone = False
        try:
            existing._hostset()
        except StaleReservation:
            why_not, gone = "its agents are gone", True  # nothing to lose: replace it without --replace
        if why_not is None:
            say(f"reusing reservation {existing.state.reservation_id}")
            if argv and argv != existing.state.default_command:
                existing.state.default_command = argv
                save_state(existing.state, path)
            return existing
        if not replace and not gone:
            raise JobError(
                f"a reservation already exists at {path} and cannot serve this request ({why_not}); "
                "use --replace to release it and make a new one, or --state for a second one"
            )
        say(f"releasing reservation {existing.state.reservation_id} ({why_not})")
        existing.stop()
    keys = Keys.generate()
    reservation = backend.reserve(request, keys, path.parent, say)
    job_state = JobState(
        scheduler=backend.name,
        reservation_id=reservation.reservation_id,
        hosts=reservation.hosts,
        keys=keys.encode(),
        default_command=argv,
        created_at=time.time(),
        scheduler_data=reservation.scheduler_data,
    )
    save_state(job_state, path)
    return Job(job_state, path)


def dryrun(command: Command = None, scheduler: str = "local", *, hosts: Optional[int] = None,
           state: Union[str, Path, None] = None, preload: Optional[str] = None, **options: Any) -> DryRun:
    """What :func:`serve` would start, without starting anything."""
    backend = get_scheduler(scheduler)
    argv, nhosts = _command_and_hosts(command, hosts)
    nhosts = nhosts or backend.default_hosts() or 1
    if argv:
        parse_command(argv)
    request = ReserveRequest(hosts=nhosts, command=argv, options=options, preload=preload)
    return backend.dryrun(request, state_path(state).parent)


def job_load(path: Union[str, Path, None] = None) -> Job:
    """Reattach to the reservation recorded at ``path`` (default ``.monarch/job_state.pkl``)."""
    p = state_path(path)
    return Job(load_state(p), p)
