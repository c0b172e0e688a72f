"""The jobs layer's shared types: the reservation's agents as a controller talks to them (:class:`HostSet`),
what a run starts (:class:`Launch`) and how it ended (:class:`RankExit`, :class:`RunResult`), how a run is asked
for (:class:`RunOptions`), and the errors that say the reservation cannot be used (:class:`StaleReservation`,
:class:`VersionMismatch`). :mod:`.job`, :mod:`.spmd`, :mod:`.telemetry` and :mod:`.debug` all import these, so
none of them needs another.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, BinaryIO, Protocol

from ..runtime import protocol
from ..runtime.errors import CallTimeout
from ..runtime.exit_status import describe_status, signal_name
from ..runtime.mailbox.mailbox import Mailbox
from ..runtime.transport.keys import Keys
from ..version import __version__
from . import fanout
from .errors import JobError
from .lifecycle import DEFAULT_STRAGGLER_GRACE, EXIT_LOST, EXIT_STOPPED
from .state import HostRecord


class StaleReservation(JobError):
    """The reservation's agents are gone (allocation ended, processes killed)."""


class VersionMismatch(JobError):
    """The reservation's agents run another monarch-cli version than this client."""


@dataclasses.dataclass(slots=True)  # (no __dict__: a client of 32,768 ranks holds one per rank)
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


class HostRanks(Protocol):
    """What a host's ranks are given: each rank's spec, built when it is sent, from what the
    host's ranks share (32,768 ranks' dicts held for a whole run were ~30 MB of a client)."""

    def spec(self, local: int) -> protocol.RankSpec: ...


class FixedSpec:
    """A spec made whole beforehand (``exec``'s one shell per host)."""

    __slots__ = ("whole",)

    def __init__(self, whole: protocol.RankSpec) -> None:
        self.whole = whole

    def spec(self, local: int) -> protocol.RankSpec:
        return self.whole


@dataclasses.dataclass(slots=True)
class Launch:
    """One process to start: a rank of the SPMD run, or a host's shell for ``exec``."""

    rank: int
    label: str
    node: int
    local: int  # its index among its host's ranks (torchrun's LOCAL_RANK)
    plan: HostRanks

    @property
    def spec(self) -> protocol.RankSpec:
        """Built anew at each use: send it once, keep none."""
        return self.plan.spec(self.local)


#: Seconds per host added to the wait for the agents' first answers (their connections' handshakes).
_HANDSHAKE_ALLOWANCE = 0.02


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
        peers_reachable: bool = False,
        questions_only: bool = False,
    ) -> None:
        """``peers_reachable``: the agents reach each other at the addresses in ``hosts``.
        ``questions_only``: this command only asks every host questions (:meth:`ask_all`), so
        from ``settings().relay_from_hosts`` hosts it asks them through relays
        (:mod:`.fanout`) and links only those."""
        self.hosts = hosts
        self.peers_reachable = peers_reachable
        self.mb = Mailbox.for_keys(keys)
        self.relayed = relayed = peers_reachable and fanout.relayed(len(hosts))
        self.through_relays = questions_only and relayed
        addresses = [h.agent for h in hosts]
        if self.through_relays:  # only the relays: everything comes back on their links
            for address in fanout.relay_addresses(addresses):
                self.mb.link_directly(address)
        else:  # every host reached; from relay_from_hosts hosts, ~√N of them directly
            fanout.link_for_requests(self.mb, addresses, relayed, {h.agent for h in hosts if h.name in known_dead})
        # The hosts are asked at once and answer independently; thousands of CURVE handshakes
        # (a few ms each on a busy client) take longer than a few, so the wait grows with them.
        linked = len(hosts) if not relayed else len(fanout.relay_groups(len(hosts)))
        #: Hosts (indices) reached straight, not through their relay: it did not reach them.
        self._direct: set[int] = set()
        answers = fanout.ask_each(
            self.mb,
            [None if h.name in known_dead else h.agent for h in hosts],
            lambda cid: protocol.Ping(cid, self.mb.address),
            timeout + _HANDSHAKE_ALLOWANCE * linked,
            self.through_relays,
            # A host that did not answer through its relay is asked straight: in a partition
            # between the two it is alive, and a command that says otherwise misleads (a dead
            # host costs a second wait).
            retry_directly=relayed,
            directly=self._direct,
        )
        self.infos: list[dict[str, Any]] = []
        for host, (ok, info) in zip(hosts, answers):
            if not ok:  # any failure to answer means the same thing here
                if not require_all:  # `status`: this host is dead, the others may be fine
                    self.infos.append(None)  # type: ignore[arg-type]
                    continue
                raise StaleReservation(
                    f"host {host.name} (agent {host.agent}) is not answering: the reservation is gone or unreachable; "
                    "run `monarch serve --replace` for a new one, or `monarch stop` to clear it"
                ) from None
            _check_version(host, info)
            self.infos.append(info)

    def unanswered(self) -> list[str]:
        """The hosts that did not answer this set's ping (made with ``require_all=False``)."""
        return [h.name for h, info in zip(self.hosts, self.infos) if info is None]

    def link_for_requests(self) -> None:
        """Link every host, for requests that differ from host to host (a set made with
        ``questions_only`` linked only the relays): from ``relay_from_hosts`` hosts through
        the relays' forwarders, as a run does, not with a handshake per host."""
        fanout.link_for_requests(self.mb, [h.agent for h in self.hosts], self.relayed)
        for i in self._direct:  # their relay does not reach them
            self.mb.link_directly(self.hosts[i].agent)

    def ask_all(self, make: Callable[[int], Any], timeout: float) -> list[Any]:
        """``make(cid)``'s answer from every host, in order (through relays where this set was
        made with ``questions_only``); raises the first host's failure, as ``gather`` does."""
        answers = fanout.ask_each(
            self.mb,
            [h.agent for h in self.hosts],
            make,
            timeout,
            self.through_relays,
            retry_directly=self.through_relays,
            directly=self._direct,
        )
        for host, (ok, value) in zip(self.hosts, answers):
            if not ok:
                if isinstance(value, fanout.NoAnswer):
                    raise CallTimeout(f"host {host.name} did not answer within {timeout:g} s")
                raise value
        return [value for _, value in answers]


def _check_version(host: HostRecord, info: dict[str, Any]) -> None:
    """Client and agents must run the same monarch-cli: their messages and pickles are not
    versioned. Checked on every connection, whatever started the agent (an image, a remote
    install, a SkyPilot setup); an agent too old to say its version is not refused."""
    theirs = info.get("version")
    if theirs is not None and theirs != __version__:
        raise VersionMismatch(
            f"host {host.name} runs monarch-cli {theirs}, this client {__version__}: "
            "serve again with --replace: it ships this client's code to the hosts"
        )


@dataclasses.dataclass(frozen=True)
class RunOptions:
    """How :meth:`Job.run_spmd <monarch_cli.jobs.job.Job.run_spmd>` runs a command; the defaults are a plain
    ``monarch run-spmd``'s. ``job.run_spmd(cmd, cold=True)`` and ``job.run_spmd(cmd, RunOptions(cold=True))``
    are the same call."""

    #: Start every rank as a fresh interpreter instead of forking its host's warm process.
    cold: bool = False
    #: Keep the ranks' processes for the next run that keeps them too (imports, CUDA context,
    #: compiled graphs survive; the script's world is reset: docs/spmd.md, "Kept ranks").
    keep_ranks: bool = False
    #: The ranks whose output reaches the console (every rank is logged); None: all of them.
    ranks: set[int] | None = None
    #: Colour the ``[rankN]`` prefixes; None: when the console is a terminal.
    color: bool | None = None
    #: Where the ranks' stdout and stderr go (prefixed); None: this process's.
    stdout: BinaryIO | None = None
    stderr: BinaryIO | None = None
    #: After a rank fails, the others get SIGTERM, and SIGKILL this many seconds later.
    grace: float = 3.0
    #: Told what a user watching should know: paused ranks, restarts, stragglers, sync reports.
    on_event: Callable[[str], None] | None = None
    #: A rank that raises stays paused at the failing frame, for ``monarch debug``.
    post_mortem: bool = False
    #: Signals relayed to every rank while it runs (main thread only), e.g. a batch job's time-limit warning.
    forward_signals: Sequence[int] = ()
    #: What is mirrored to hosts that do not share this filesystem; None: the run's directory.
    workspace: str | Path | None = None
    #: Mirror the workspace first (False: the hosts already have it).
    sync: bool = True
    #: Added to every rank's environment (``-e``).
    env: dict[str, str] | None = None
    #: Seconds ranks get after SIGTERM/SIGHUP/SIGQUIT to the caller, before SIGKILL; None: torchrun's
    #: ``--shutdown-timeout``, then ``$TORCH_ELASTIC_SHUTDOWN_TIMEOUT``, then 30.
    shutdown_timeout: float | None = None
    #: Ranks still running this many seconds after the first one ended are named through ``on_event``.
    straggler_grace: float = DEFAULT_STRAGGLER_GRACE
    #: End the run when no rank printed a line or finished a step for this many seconds while every host
    #: answered (the hosts probe each other first, to name a partition); None: ``$MONARCH_STALL_TIMEOUT``,
    #: else never (a script may load data silently for a long time).
    stall_timeout: float | None = None
    #: The run's id (from ``new_run_id()``), for a caller that must know its logs and telemetry before it
    #: starts (the MCP server's detached runs); None: a new one.
    run_id: str | None = None
    #: Print a line that many ranks print alike once, ``[rank 0-4095] ...`` (None: when more than 16 ranks
    #: are shown; see :mod:`.output_groups`); the logs keep every rank's lines.
    group: bool | None = None

    def say(self, message: str) -> None:
        if self.on_event is not None:
            self.on_event(message)
