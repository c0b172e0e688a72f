"""The scheduler contract: options as data, a printable plan, and reserving exactly that plan.

In the spirit of torchx's ``schedule(submit_dryrun(...))``: ``plan(request)`` decides
everything (the reservation id, the directories, the exact commands and scripts) and
returns a :class:`Plan` that prints the same way for every backend and round-trips
through JSON; ``reserve(plan)`` only carries it out, so a dry run and a real reservation
cannot drift apart. A backend is one module (or subpackage) that subclasses
:class:`Scheduler`, plus one line in the registry (:mod:`monarch_cli.schedulers`).
"""

from __future__ import annotations

import abc
import dataclasses
import enum
import json
import shlex
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar, Protocol

from ..errors import OptionError, PlanError
from ..runtime.launch.command import AgentCommand

if TYPE_CHECKING:  # Keys pulls in zmq: planning and the CLI's help do not need it
    from ..runtime.transport.keys import Keys

Progress = Callable[[str], None]
PLAN_VERSION = 1


@dataclasses.dataclass
class HostRecord:
    """One reserved host: where its agent listens and which node rank it plays."""

    name: str
    agent: str
    pid: int | None
    node_rank: int


@dataclasses.dataclass(frozen=True)
class Option:
    """One backend option, as data: the CLI turns it into ``--flag`` and ``-o name=value``."""

    name: str
    type: type = str  # str, int, bool, or list (a repeatable flag)
    default: Any = None
    help: str = ""
    #: The long flag (default ``--name-with-dashes``) and an optional short one (``-p``).
    flag: str | None = None
    short: str | None = None

    @property
    def cli_flag(self) -> str:
        return self.flag or "--" + self.name.replace("_", "-")

    def parse(self, text: str) -> Any:
        """A ``-o name=value`` string as this option's type."""
        if self.type is bool:
            low = text.strip().lower()
            if low in ("1", "true", "yes", "on", ""):
                return True
            if low in ("0", "false", "no", "off"):
                return False
            raise OptionError(f"-o {self.name}= takes true or false, not {text!r}")
        if self.type is int:
            try:
                return int(text)
            except ValueError:
                raise OptionError(f"-o {self.name}= takes a whole number, not {text!r}") from None
        if self.type is list:
            return [text]
        return text


def parse_option_pairs(pairs: Sequence[str], options: Sequence[Option], scheduler: str) -> dict[str, Any]:
    """``-o key=value`` words (repeatable; a list option collects every value) as a dict."""
    known = {o.name: o for o in options}
    values: dict[str, Any] = {}
    for pair in pairs:
        key, eq, text = pair.partition("=")
        key = key.strip().replace("-", "_")
        if not eq or not key:
            raise OptionError(f"-o takes key=value, not {pair!r}")
        if key not in known:
            names = ", ".join(known) or "none"
            raise OptionError(f"the {scheduler} scheduler has no option {key!r}; its options: {names}")
        value = known[key].parse(text)
        values[key] = [*values.get(key, []), *value] if known[key].type is list else value
    return values


@dataclasses.dataclass
class ReserveRequest:
    hosts: int = 1
    command: list[str] = dataclasses.field(default_factory=list)
    #: Backend options (:attr:`Scheduler.options`), validated by :meth:`Scheduler.plan`.
    options: dict[str, Any] = dataclasses.field(default_factory=dict)
    #: Modules warm ranks import up front; None lets the agent decide (torch if installed).
    preload: str | None = None
    #: The state file that will record the reservation (absolute), for agents on this machine.
    state_file: str | None = None
    #: A fixed port for every agent to listen on (None: any free port).
    agent_port: int | None = None
    #: Keep every port the agents (and their procs and ranks) open within this range.
    port_range: tuple[int, int] | None = None
    #: The hosts by name (``--hosts h1,h2``), for a backend that reaches hosts by name
    #: (:attr:`Scheduler.takes_host_names`); then ``hosts`` is their number.
    host_names: list[str] = dataclasses.field(default_factory=list)

    def agent_command(self, reservation_id: str, **fields: Any) -> AgentCommand:
        """The command line of this reservation's host agents, built from the request in one place for every
        backend: its preload, fixed port and port range, the warm process started at once, the reservation
        in ``ps``. ``fields`` are what only the backend knows (the interpreter, a host's name or address, how
        keys and the ready line travel, a port it must fix) and win over the request's."""
        common: dict[str, Any] = {
            "preload": self.preload,
            "port": self.agent_port,
            "port_range": self.port_range,
            "warm_up": True,
            "reservation": reservation_id,
        }
        return AgentCommand(**{**common, **fields})


@dataclasses.dataclass
class Plan:
    """Everything a reservation will do, decided before anything starts; prints and round-trips as JSON.

    ``steps`` are what will run, in order, in words and commands; ``artifacts`` are texts
    worth showing in full (an sbatch script); ``data`` is the backend's own part of the plan
    (plain JSON), which its :meth:`Scheduler.reserve` reads back. Never holds a secret.
    """

    scheduler: str
    reservation_id: str
    hosts: int
    command: list[str]
    workdir: str
    summary: str
    steps: list[str] = dataclasses.field(default_factory=list)
    artifacts: dict[str, str] = dataclasses.field(default_factory=dict)
    options: dict[str, Any] = dataclasses.field(default_factory=dict)
    data: dict[str, Any] = dataclasses.field(default_factory=dict)
    version: int = PLAN_VERSION

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_json(cls, data: Any) -> Plan:
        if isinstance(data, (str, bytes)):
            try:
                data = json.loads(data)
            except ValueError as e:
                raise PlanError(f"not a plan (invalid JSON: {e})") from None
        if not isinstance(data, dict):
            raise PlanError("not a plan: expected a JSON object as `monarch serve --dry-run --json` prints")
        if data.get("version") != PLAN_VERSION:
            raise PlanError(
                f"plan version {data.get('version')!r} is not {PLAN_VERSION}; make a new one with --dry-run"
            )
        names = {f.name for f in dataclasses.fields(cls)}
        missing = sorted(
            n for n in ("scheduler", "reservation_id", "hosts", "command", "workdir", "summary") if n not in data
        )
        if missing or set(data) - names:
            raise PlanError(f"malformed plan (missing {missing or '-'}, unknown {sorted(set(data) - names) or '-'})")
        return cls(**data)

    def render(self) -> str:
        """The plan for people: the same layout for every backend."""
        lines = [
            f"{self.scheduler}: {self.summary}",
            f"reservation: {self.reservation_id}, {self.hosts} host(s), state under {self.workdir}",
            f"default command: {shlex.join(self.command) if self.command else '(none)'}",
        ]
        if self.options:
            lines.append("options: " + ", ".join(f"{k}={v}" for k, v in sorted(self.options.items())))
        if self.steps:
            lines.append("steps:")
            lines += [f"  {i}. {step}" for i, step in enumerate(self.steps, 1)]
        for name, text in self.artifacts.items():
            lines += ["", f"# {name}", text.rstrip("\n")]
        return "\n".join(lines)


class ReservationRecord(Protocol):
    """What a backend needs to find its reservation again (a :class:`Reservation` or a job state)."""

    reservation_id: str
    hosts: list[HostRecord]
    scheduler_data: dict[str, Any]


@dataclasses.dataclass
class Reservation:
    reservation_id: str
    hosts: list[HostRecord]
    scheduler_data: dict[str, Any] = dataclasses.field(default_factory=dict)


class Liveness(enum.Enum):
    ALIVE = "alive"
    GONE = "gone"
    UNKNOWN = "unknown"  # the scheduler could not tell: let the agents' ping decide


@dataclasses.dataclass(frozen=True)
class Probe:
    """A cheap, honest liveness answer: alive, certainly gone (and why), or cannot tell."""

    liveness: Liveness
    reason: str = ""

    @property
    def gone(self) -> bool:
        return self.liveness is Liveness.GONE


class Scheduler(abc.ABC):
    """One backend. Subclasses set ``name``, ``options`` and implement plan/reserve/release/probe."""

    name: ClassVar[str] = ""
    #: The backend's options, as data: flags of ``monarch serve`` and ``-o name=value``.
    options: ClassVar[Sequence[Option]] = ()
    #: Options of ``monarch stop`` (and ``Job.stop(**options)``), as data the same way; :meth:`release_with`
    #: gets their values.
    stop_options: ClassVar[Sequence[Option]] = ()
    #: Whether ``--hosts`` may name hosts (``h1,h2``: :attr:`ReserveRequest.host_names`) rather than count them.
    takes_host_names: ClassVar[bool] = False
    #: Its agents exit unless a client asks them something soon after they start (``--lease``):
    #: ``serve`` does once it has saved the reservation.
    leases_agents: ClassVar[bool] = False

    # ---------------------------------------------------------------- planning
    @abc.abstractmethod
    def plan(self, request: ReserveRequest, workdir: Path) -> Plan:
        """Decide everything :meth:`reserve` will do; start nothing, write nothing."""

    @abc.abstractmethod
    def reserve(self, plan: Plan, keys: Keys, progress: Progress) -> Reservation:
        """Carry out exactly ``plan``: one host agent per host; return once every agent answers."""

    @abc.abstractmethod
    def release(self, reservation: ReservationRecord) -> None:
        """End the reservation; no process of it may be left."""

    @abc.abstractmethod
    def probe(self, reservation: ReservationRecord) -> Probe:
        """Is the reservation alive? Cheap (no agent round trip) and honest: UNKNOWN when unsure."""

    def check_options(self, options: dict[str, Any]) -> dict[str, Any]:
        """Options without Nones, each known; backends add their own checks."""
        return _checked(options, self.options, f"the {self.name} scheduler", self.name)

    def check_stop_options(self, options: dict[str, Any]) -> dict[str, Any]:
        """Stop options without Nones, each one of :attr:`stop_options`."""
        return _checked(options, self.stop_options, f"monarch stop of a {self.name} reservation", f"{self.name} stop")

    def release_with(self, reservation: ReservationRecord, options: dict[str, Any]) -> None:
        """End the reservation as ``monarch stop`` with :attr:`stop_options` (checked values) asks.
        Backends without stop options need not override it: it is :meth:`release`."""
        self.release(reservation)

    def check_plan(self, plan: Plan) -> None:
        """Refuse a plan made for another backend (reserve from a printed plan)."""
        if plan.scheduler != self.name:
            raise PlanError(f"this plan is for the {plan.scheduler} scheduler, not {self.name}")

    def can_serve(self, reservation: ReservationRecord, request: ReserveRequest) -> str | None:
        """None if ``reservation`` can serve ``request``; otherwise why not, in a few words."""
        if len(reservation.hosts) != request.hosts:
            return f"it has {len(reservation.hosts)} host(s), not {request.hosts}"
        return None

    def agent_addresses(self, reservation: ReservationRecord) -> list[str]:
        """Where this process reaches each host's agent: the address it listens on, or a forward the
        backend opens here (ssh ``--tunnel``). An agent answers on the connection made to it, so its
        one port, reached either way, is all a client needs."""
        return [h.agent for h in reservation.hosts]

    def dead_hosts(self, reservation: ReservationRecord) -> list[str]:
        """Hosts known dead without asking them (no network round trip); may miss some."""
        return []

    def release_unreadable(self, state_file: Path) -> list[int]:
        """Stop what a reservation whose state file cannot be read left on this machine
        (found without the file); the pids stopped. Most backends cannot find any."""
        return []

    def default_hosts(self) -> int | None:
        """How many hosts to reserve when the caller does not say (None: the usual 1)."""
        return None

    def max_hosts(self) -> int:
        """The most hosts one reservation may ask for: a number past it is a typo, refused in one line
        before anything is built for each host (the largest clusters have tens of thousands of nodes)."""
        return 65_536

    def describe(self, reservation: ReservationRecord) -> dict[str, Any]:
        """Backend facts for ``monarch status --json`` (under the backend's name)."""
        return {}

    def status_lines(self, reservation: ReservationRecord) -> list[str]:
        """Backend facts for ``monarch status``, a few plain lines."""
        return []


def _checked(options: dict[str, Any], declared: Sequence[Option], what: str, label: str) -> dict[str, Any]:
    known = {o.name: o for o in declared}
    unknown = sorted(set(options) - set(known))
    if unknown:
        if not known:
            flags = ", ".join("--" + k.replace("_", "-") for k in unknown)
            raise OptionError(f"{what} takes no options (got {flags})")
        raise OptionError(f"unknown {label} option(s): {', '.join(unknown)}; known: {', '.join(known)}")
    return {k: v for k, v in options.items() if v is not None and v is not False and v != []}


__all__ = [
    "HostRecord",
    "Option",
    "ReserveRequest",
    "Plan",
    "Reservation",
    "ReservationRecord",
    "Liveness",
    "Probe",
    "Scheduler",
    "Progress",
    "parse_option_pairs",
]
