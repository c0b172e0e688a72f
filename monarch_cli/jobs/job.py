"""Reserve once, run many: the Python API behind ``monarch serve/run-spmd/status/stop/exec``."""

from __future__ import annotations

import dataclasses
import os
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, BinaryIO

from ..runtime import protocol
from ..runtime.mailbox.mailbox import Mailbox
from ..runtime.transport.keys import Keys

if TYPE_CHECKING:
    from ..runtime.actor.mesh import HostMesh
    from .inspector import Diagnosis, Inspector, RankRow, StackReport
from ..config import configure
from ..schedulers import Scheduler, get_scheduler
from ..schedulers.agents import controller_host
from . import fanout, warm_hints
from .command import Command
from .errors import JobError
from .lifecycle import shutdown_timeout_from
from .model import HostSet, RunResult, StaleReservation
from .output import OutputSink, list_runs, new_run_dir
from .plan import plan_exec
from .spmd import SpmdRunner, new_run_id
from .spmd_runs import SpmdRuns, _console_verdict, _consoles, _result
from .state import HostRecord, JobState, clear_state, load_state, state_path
from .sync import SyncReport, sync_workspace


class Job(SpmdRuns):
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
        thousands of hosts answer through relays (:mod:`.fanout`).

        The agents are asked first, and the scheduler only when one does not answer: a healthy
        re-run makes no SSH connection and no API call (the scheduler's probe is the slow part of
        asking, and it only tells a gone reservation from an unreachable one)."""
        hosts = self._reachable_hosts()
        dead = [] if require_all else self.scheduler.dead_hosts(self.state)
        try:
            return HostSet(
                hosts,
                self.keys,
                require_all=require_all,
                known_dead=dead,
                peers_reachable=self._peers_reachable(hosts),
                questions_only=questions_only,
            )
        except StaleReservation:
            probe = self.scheduler.probe(self.state)
            if probe.gone:
                raise StaleReservation(
                    f"reservation {self.state.reservation_id} is gone ({probe.reason}); "
                    "run `monarch serve --replace` for a new one, or `monarch stop` to clear it"
                ) from None
            raise

    def _peers_reachable(self, hosts: Sequence[HostRecord]) -> bool:
        """Agents reached at their own addresses reach each other there: they can probe each other
        (a partition between hosts) and relay (not through a backend's forwards)."""
        return all(h.agent == rec.agent for h, rec in zip(hosts, self.state.hosts))

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
        """Ask every host through the relays later commands will use, both ways a relay passes
        things on: a question (``status``, ``stack``: the relay asks its hosts) and a forward (a
        run's requests), so that the relays hold both kinds of connection from now on and the
        first run does not make them (``serve`` does this for a reservation of
        ``settings().relay_from_hosts`` hosts or more); the hosts that did not answer."""
        try:
            asked = self.hostset(require_all=False, questions_only=True)
            forwarded = self.hostset(require_all=False)
        except JobError:  # the first command says what is wrong
            return [h.name for h in self.state.hosts]
        missing = set(asked.unanswered()) | set(forwarded.unanswered())
        return [h.name for h in self.state.hosts if h.name in missing]

    def wait_warm(self, timeout: float = 60.0) -> bool:
        """Wait until every host's warm process holds what it was hinted and past runs taught it
        (learning runs in the background after each run); False if that takes longer than ``timeout``."""
        deadline = time.monotonic() + timeout
        while True:
            warm = [h["warm"] for h in self.status()["hosts"]]
            if all(w and w.get("settled") for w in warm):
                return True
            if time.monotonic() >= deadline:
                return False
            time.sleep(0.2)

    def warm_for_served(self, timeout: float = 120.0, say: Callable[[str], None] = lambda _m: None) -> int:
        """Hint every host's warm process what the served command will import (its source, and what
        earlier reservations of this workspace held) and wait until it holds them, so the first
        run after ``serve`` is already warm; how many modules were hinted."""
        argv, cwd = self.state.default_command, self.state.default_cwd or os.getcwd()
        names = warm_hints.hints(self.path.parent, argv, cwd) if argv else []
        if not names:
            return 0  # (nothing to hint: the first run waits for torch's import as it would anyway)
        hs = self.hostset(questions_only=True)
        hs.ask_all(lambda cid: protocol.WarmHints(cid, hs.mb.address, names), 30.0)
        say(f"warming {len(names)} module(s) the served command imports")
        if not self.wait_warm(timeout):
            say(f"the warm processes are still warming after {timeout:g} s; runs start from what is ready")
        return len(names)

    def _remember_learned(self, mb: Mailbox, host: HostRecord, deadline: float) -> None:
        """Keep what this reservation's warm process held for the served program (one host asks:
        SPMD hosts learn the same), for the next reservation of this workspace to start from."""
        key = warm_hints.program_key(self.state.default_command) if self.state.default_command else None
        if key is None:
            return
        try:
            ask = mb.request(host.agent, lambda cid: protocol.LearnedModules(cid, mb.address))
            names = ask.get(timeout=max(0.01, deadline - time.monotonic()))
        except Exception:  # noqa: BLE001 - a dead or old agent: nothing learned to keep
            return
        if isinstance(names, list):
            warm_hints.remember(self.path.parent, key, [str(n) for n in names])

    def forget_preload(self) -> dict[str, int]:
        """Forget the modules each host's warm process learned from past runs (per host: how
        many); runs fork from one holding only the explicit preload until they teach it again."""
        warm_hints.forget_history(self.path.parent)
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
        addresses = [h.agent for h in hosts]
        # Through relays, as a run is: a connection per host (4,096 handshakes) took this past
        # its timeout, and runs were not told who stopped them.
        fanout.link_for_requests(mb, addresses, self._peers_reachable(hosts) and fanout.relayed(len(hosts)))
        deadline = time.monotonic() + timeout
        if hosts:
            self._remember_learned(mb, hosts[0], deadline)
        asks = [mb.request(h.agent, lambda cid: protocol.Stopping(cid, mb.address, who)) for h in hosts]
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


def job_load(path: str | Path | None = None) -> Job:
    """Reattach to the reservation recorded at ``path`` (default ``.monarch/job_state.pkl``)."""
    p = state_path(path)
    return Job(load_state(p), p)
