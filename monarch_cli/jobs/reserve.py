"""Making and replacing reservations: ``serve``, ``serve --dry-run`` and its plan, ``stop --force``
on an unreadable state file (client side). A reservation, once made, is a :class:`~.job.Job`."""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from ..errors import OptionError, PlanError
from ..runtime.errors import CallTimeout
from ..runtime.transport.keys import Keys
from ..schedulers import ALIASES, Plan, ReserveRequest, Scheduler, available, get_scheduler
from . import fanout
from .command import Command, command_and_hosts
from .errors import JobError
from .job import Job, job_load
from .model import StaleReservation, VersionMismatch
from .state import JobState, NoReservation, StateError, clear_state, save_state, state_path
from .torchrun import parse_command

Hosts = int | str | Sequence[str] | None  # a count, or host names ("h1,h2" or a list) for a backend that takes them


def _host_names(backend: Scheduler, hosts: Hosts) -> tuple[int | None, list[str]]:
    """``hosts`` as (count, names): a number (or its text) is a count; anything else names hosts."""
    if hosts is None or isinstance(hosts, int):
        return hosts, []
    if isinstance(hosts, str):
        text = hosts.strip()
        if text.lstrip("-").isdigit():
            return int(text), []
        names = [h.strip() for h in text.split(",") if h.strip()]
    else:
        names = [str(h).strip() for h in hosts if str(h).strip()]
    if not names:
        raise OptionError(f"--hosts takes a number or host names (h1,h2), not {hosts!r}")
    if not backend.takes_host_names:
        raise OptionError(f"the {backend.name} scheduler takes a number of hosts, not names ({', '.join(names)})")
    return len(names), names


def _request(
    backend: Scheduler,
    command: Command,
    hosts: Hosts,
    preload: str | None,
    agent_port: int | None,
    port_range: tuple[int, int] | None,
    options: dict[str, Any],
) -> ReserveRequest:
    count, names = _host_names(backend, hosts)
    if count is not None and count < 1:
        raise JobError(f"--hosts must be at least 1, not {count}")
    argv, nhosts = command_and_hosts(command, count)
    nhosts = nhosts or backend.default_hosts() or 1
    if nhosts < 1:
        raise JobError(f"--hosts must be at least 1, not {nhosts}")
    if nhosts > backend.max_hosts():
        raise JobError(
            f"--hosts {nhosts} is more than the {backend.name} scheduler takes (at most {backend.max_hosts()})"
        )
    if argv:
        parse_command(argv)  # a bad default command is an error now, not at the first run
    return ReserveRequest(
        hosts=nhosts,
        command=argv,
        options=backend.check_options(options),
        preload=preload,
        agent_port=agent_port,
        port_range=port_range,
        host_names=names,
    )


def serve(
    command: Command = None,
    scheduler: str = "local",
    *,
    hosts: Hosts = None,
    state: str | Path | None = None,
    replace: bool = False,
    preload: str | None = None,
    agent_port: int | None = None,
    port_range: tuple[int, int] | None = None,
    progress: Callable[[str], None] | None = None,
    cwd: str | Path | None = None,
    wait_warm: bool = True,
    **options: Any,
) -> Job:
    """Reserve hosts (or reuse a reservation that can serve this request) and return the job.

    The served command will run in ``cwd`` (default: the current directory), wherever
    ``run_spmd()`` is later called from, so its relative paths keep their meaning. A new
    reservation's warm processes are told what that command imports and, with ``wait_warm``,
    waited for, so that its first run is already warm (:mod:`.warm_hints`).
    """
    backend = get_scheduler(scheduler)
    request = _request(backend, command, hosts, preload, agent_port, port_range, options)
    path = state_path(state)
    request.state_file = str(path.resolve())
    say = progress or (lambda _msg: None)
    served_in = os.path.abspath(cwd if cwd is not None else os.getcwd()) if request.command else None
    existing = _existing(path, replace, say)
    if existing is not None:
        why_not = (
            backend.can_serve(existing.state, request)
            if existing.state.scheduler == backend.name
            else f"it is a {existing.state.scheduler} reservation, not {backend.name}"
        )
        gone = False
        try:
            existing.hostset()
        except StaleReservation:
            why_not, gone = "its agents are gone", True  # nothing to lose: replace it without --replace
        except VersionMismatch as e:
            why_not = str(e).split(":")[0]  # "host h runs monarch-cli X, this client Y"
        if why_not is None:
            say(f"reusing reservation {existing.state.reservation_id}")
            argv = request.command
            if argv and (argv, served_in) != (existing.state.default_command, existing.state.default_cwd):
                existing.state.default_command, existing.state.default_cwd = argv, served_in
                save_state(existing.state, path)
            return existing
        _release_for(existing, why_not, replace or gone, path, say)
    return _reserve(backend, backend.plan(request, path.parent), path, say, served_in, wait_warm)


def reserve_plan(
    plan: Plan | dict[str, Any] | str,
    *,
    state: str | Path | None = None,
    replace: bool = False,
    cwd: str | Path | None = None,
    progress: Callable[[str], None] | None = None,
) -> Job:
    """Carry out a plan that :func:`dryrun` returned (or its JSON, as ``serve --dry-run --json`` prints it).

    The plan's command will run in ``cwd`` (default: the current directory), as with :func:`serve`.
    """
    if not isinstance(plan, Plan):
        plan = Plan.from_json(plan)
    backend = get_scheduler(plan.scheduler)
    if plan.command:
        parse_command(plan.command)
    if backend.check_options(plan.options) != plan.options:
        raise PlanError(f"the plan's options {plan.options} are not valid {plan.scheduler} options")
    path = state_path(state)
    say = progress or (lambda _msg: None)
    existing = _existing(path, replace, say)
    if existing is not None:
        try:
            existing.hostset()
            gone = False
        except StaleReservation:
            gone = True
        _release_for(existing, "a plan always makes a new reservation", replace or gone, path, say)
    served_in = os.path.abspath(cwd if cwd is not None else os.getcwd()) if plan.command else None
    return _reserve(backend, plan, path, say, served_in)


def _existing(path: Path, replace: bool, say: Callable[[str], None]) -> Job | None:
    try:
        return job_load(path)
    except NoReservation:
        return None
    except StateError:
        if not replace:
            raise
        say(f"replacing unreadable state file {path}")
        clear_unreadable(path)
        return None


def _release_for(existing: Job, why_not: str, replace: bool, path: Path, say: Callable[[str], None]) -> None:
    if not replace:
        raise JobError(
            f"a reservation already exists at {path} and cannot serve this request ({why_not}); "
            "use --replace to release it and make a new one, or --state for a second one"
        )
    say(f"releasing reservation {existing.state.reservation_id} ({why_not})")
    existing.stop(by="monarch serve --replace")


def _reserve(
    backend: Scheduler, plan: Plan, path: Path, say: Callable[[str], None], served_in: str | None, warm: bool = True
) -> Job:
    keys = Keys.generate()
    reservation = backend.reserve(plan, keys, say)
    job_state = JobState(
        scheduler=backend.name,
        reservation_id=reservation.reservation_id,
        hosts=reservation.hosts,
        keys=keys.encode(),
        default_command=list(plan.command),
        created_at=time.time(),
        scheduler_data=reservation.scheduler_data,
        default_cwd=served_in,
    )
    save_state(job_state, path)
    job = Job(job_state, path)
    if fanout.relayed(len(job_state.hosts)):
        say(f"checking {len(job_state.hosts)} hosts through their relays")
        job.check_relays()  # (every agent is asked: that confirms a lease too)
    elif backend.leases_agents:
        _confirm_leases(job, say)
    if warm:
        try:
            job.warm_for_served(say=say)
        except (JobError, CallTimeout) as e:  # warming is an optimisation: the first run says what is wrong
            say(f"the warm processes were not told what to import: {e}")
    return job


def _confirm_leases(job: Job, say: Callable[[str], None]) -> None:
    """Ask every agent once, now that the reservation is saved: an agent on a lease lives on from
    its first request from a key holder (``runtime/agent/lease.py``); one not asked exits."""
    try:
        unanswered = job.hostset(require_all=False, questions_only=True).unanswered()
    except JobError as e:
        unanswered, why = [h.name for h in job.state.hosts], f" ({e})"
    else:
        why = ""
    if unanswered:
        say(
            f"host(s) {', '.join(unanswered)} did not answer after serve{why}; an agent no command reaches "
            "soon exits when its lease runs out"
        )


def dryrun(
    command: Command = None,
    scheduler: str = "local",
    *,
    hosts: Hosts = None,
    state: str | Path | None = None,
    preload: str | None = None,
    agent_port: int | None = None,
    port_range: tuple[int, int] | None = None,
    **options: Any,
) -> Plan:
    """The plan :func:`serve` would carry out, without starting anything; :func:`reserve_plan` carries it out."""
    backend = get_scheduler(scheduler)
    request = _request(backend, command, hosts, preload, agent_port, port_range, options)
    request.state_file = str(state_path(state).resolve())  # as serve() sets it: the plan is what serve runs
    return backend.plan(request, state_path(state).parent)


def clear_unreadable(state: str | Path | None = None) -> dict[str, Any]:
    """What ``stop --force`` does to an unreadable state file: stop the agents registered for
    it on this machine (local backend), then delete it."""
    path = state_path(state)
    stopped: list[int] = []
    for name in sorted(set(available()) - set(ALIASES)):
        stopped += get_scheduler(name).release_unreadable(path)
    clear_state(path)
    return {"cleared": str(path), "agents_stopped": stopped}
