"""How a run is ended from the controller's side: signals, grace periods and what to tell the user.

torchrun's contract, kept here: SIGTERM, SIGHUP and SIGQUIT sent to the launcher are forwarded
to every rank, which then has ``--shutdown-timeout`` seconds (default 30, or
``$TORCH_ELASTIC_SHUTDOWN_TIMEOUT``) before SIGKILL; the launcher then exits. Ctrl-C is
interactive: the first is passed to the ranks as SIGINT, the second kills them, a third stops
waiting for ranks whose exits never come. :class:`RunControl` decides; the runner only
carries its decisions out, so the rules live in one place.
"""

from __future__ import annotations

import math
import os
import signal
import threading
from collections.abc import Callable, Sequence
from typing import Any

from ..config import EnvSettings, env
from ..runtime.exit_status import signal_name
from .errors import JobError

#: Signals that end a run when the launcher gets them (torchrun's ``--signals-to-handle`` default).
DEATH_SIGNALS = (signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT)
#: Exit status of a run whose reservation was released (``monarch stop``) while it ran.
EXIT_STOPPED = 254
#: Exit status of a run that lost a host (its agent stopped answering).
EXIT_LOST = 255
#: torchrun's default grace between forwarding a death signal and SIGKILL.
DEFAULT_SHUTDOWN_TIMEOUT = 30.0
#: How long after the first rank ends before ranks still running are named.
DEFAULT_STRAGGLER_GRACE = 30.0
#: How long to wait for exits after SIGKILL before giving up on them (an agent's pipes grace is 2 s).
_UNREPORTED_WAIT = 5.0


def shutdown_timeout_from(flag: float | None) -> float:
    """torchrun's order: ``--shutdown-timeout``, then ``$TORCH_ELASTIC_SHUTDOWN_TIMEOUT``, then 30 s."""
    if flag is not None:
        return float(flag)
    text = os.environ.get("TORCH_ELASTIC_SHUTDOWN_TIMEOUT", "").strip()
    try:
        return max(0.0, float(text)) if text else DEFAULT_SHUTDOWN_TIMEOUT
    except ValueError:
        return DEFAULT_SHUTDOWN_TIMEOUT


def stall_timeout_from(value: float | None) -> float | None:
    """``--stall-timeout``, then ``$MONARCH_STALL_TIMEOUT``; None (off) when neither is set or either is 0."""
    source = "--stall-timeout"
    if value is None:
        value = env.stall_timeout  # a value that is no number of seconds is a one-line error naming it
        if value is None:
            return None
        source = f"${EnvSettings.stall_timeout.var}"
    if math.isnan(value) or value < 0:
        raise JobError(f"{source} takes seconds (0 or more; 0: off), not {value}")
    return value or None


def rank_list(ranks: Sequence[int]) -> str:
    """``[0, 1, 2, 5]`` -> ``0-2,5`` (short even for thousands of ranks)."""
    parts: list[str] = []
    ordered = sorted(ranks)
    i = 0
    while i < len(ordered):
        j = i
        while j + 1 < len(ordered) and ordered[j + 1] == ordered[j] + 1:
            j += 1
        if i == j:
            parts.append(str(ordered[i]))
        else:  # two in a row read better as "2,3" than "2-3"
            parts.append(f"{ordered[i]}{'-' if j > i + 1 else ','}{ordered[j]}")
        i = j + 1
    return ",".join(parts)


def ranks_by_host(running: dict[int, str]) -> str:
    """``{2: 'h1', 3: 'h1', 0: 'h0'}`` -> ``rank 0 on h0 and ranks 2,3 on h1``."""
    hosts: dict[str, list[int]] = {}
    for rank in sorted(running):
        hosts.setdefault(running[rank], []).append(rank)
    groups = [f"{'rank' if len(r) == 1 else 'ranks'} {rank_list(r)} on {h}" for h, r in hosts.items()]
    return groups[0] if len(groups) == 1 else ", ".join(groups[:-1]) + " and " + groups[-1]


class RunControl:
    """The state of one run's ending, advanced by signals, rank exits and the clock.

    ``send(sig)`` signals every rank still running; ``say(text)`` tells the user. Callers
    serialise calls (the runner holds its lock).
    """

    def __init__(
        self,
        hosts: dict[int, str],
        send: Callable[[int], None],
        say: Callable[[str], None],
        *,
        failure_grace: float,
        shutdown_timeout: float,
        straggler_grace: float,
    ) -> None:
        self.hosts = hosts  # rank -> host name
        self.send = send
        self.say = say
        self.failure_grace = failure_grace
        self.shutdown_timeout = shutdown_timeout
        self.straggler_grace = straggler_grace
        self.interrupts = 0
        self.received: int | None = None  # the death signal that ended the run
        self.stopped_by: str | None = None  # who released the reservation meanwhile
        self.stragglers: list[int] = []
        self.console_gone = False  # the output's reader went away (`| head`)
        self.partition: str | None = None  # hosts of the run that cannot reach each other, in words
        self.killed: list[int] = []  # ranks still running when SIGKILL was sent
        self.gave_up: list[int] = []
        self._received_at: float | None = None
        self._last_exit_at: float | None = None
        self._first_exit: tuple[int, float] | None = None
        self._term_at: float | None = None  # SIGTERM to the rest after a failure
        self._kill_at = math.inf
        self._give_up_at = math.inf
        self._give_up_why = ""

    # ------------------------------------------------------------------ inputs
    def signal(self, sig: int, now: float, running: Sequence[int]) -> None:
        if sig == signal.SIGINT:
            self.interrupts += 1
            if self.interrupts == 1:
                self.send(signal.SIGINT)
                self.say("stopping ranks (SIGINT sent), press Ctrl-C again to kill")
            elif self.interrupts == 2:
                self._kill(now, running, f"no exit reported {_UNREPORTED_WAIT:g} s after SIGKILL")
                self.say("killing ranks (SIGKILL sent), press Ctrl-C again to stop waiting for them")
            else:
                self._give_up_at, self._give_up_why = now, "stopped waiting for its exit (Ctrl-C three times)"
        elif sig in DEATH_SIGNALS:
            self.send(sig)
            if self.received is None:
                self.received, self._received_at = sig, now
                self._kill_at = min(self._kill_at, now + self.shutdown_timeout)
                self.say(
                    f"received {signal_name(sig)}; forwarded it to the ranks; ranks still running in "
                    f"{self.shutdown_timeout:g} s get SIGKILL"
                )
        else:
            self.send(sig)  # e.g. Slurm's SIGUSR1 warning: the script decides what it means

    def exited(self, rank: int, ok: bool, now: float) -> None:
        self._last_exit_at = now
        if self._first_exit is None:
            self._first_exit = (rank, now)
        if not ok and self._term_at is None and self.received is None:  # a death signal has its own grace
            self._term_at = now + self.failure_grace

    def stopped(self, who: str) -> None:
        self.stopped_by = self.stopped_by or who

    def stalled(self, why: str, now: float) -> None:
        """No rank made progress for the stall timeout while every host answered (a hung collective,
        a stopped peer): ended as a partition is, naming what was found."""
        self.partitioned(why, now)

    def partitioned(self, why: str, now: float) -> None:
        """Hosts of the run cannot reach each other: its collectives can never finish. End it now:
        SIGTERM to every rank, SIGKILL to what still runs 5 s later (a rank stuck in a collective
        does not run Python signal handlers), 2 s after a Ctrl-C (the user is waiting)."""
        if self.partition is not None:
            return
        self.partition = why
        self.say(f"{why}; ending the run")
        self.send(signal.SIGTERM)
        self._term_at = math.inf
        self._kill_at = min(self._kill_at, now + (2.0 if self.interrupts else 5.0))

    def console_closed(self, now: float) -> None:
        """The output's reader went away (`| head`): as a Unix tool under SIGPIPE, end now, quietly:
        SIGTERM to the ranks at once, SIGKILL after the failure grace (at most 5 s)."""
        if self.console_gone:
            return
        self.console_gone = True
        self.send(signal.SIGTERM)
        self._term_at = math.inf
        self._kill_at = min(self._kill_at, now + min(self.failure_grace, 5.0))

    def tick(self, now: float, running: dict[int, str]) -> tuple[list[int], str]:
        """Send what is due; returns the ranks to stop waiting for, and why."""
        if self._term_at is not None and now >= self._term_at:
            self._term_at = math.inf
            self.send(signal.SIGTERM)
            self._kill_at = min(self._kill_at, now + self.failure_grace)
        if now >= self._kill_at:
            self._kill(now, list(running), f"no exit reported {_UNREPORTED_WAIT:g} s after SIGKILL")
        if (
            self._first_exit is not None
            and not self.stragglers
            and running
            and now >= self._first_exit[1] + self.straggler_grace
        ):
            self.stragglers = sorted(running)
            self.say(
                f"{ranks_by_host(running)} still running {self.straggler_grace:g} s after "
                f"rank {self._first_exit[0]} exited"
            )
        if now >= self._give_up_at and running:
            self.gave_up = sorted(running)
            return sorted(running), self._give_up_why
        return [], ""

    def _kill(self, now: float, running: Sequence[int], why: str) -> None:
        self.send(signal.SIGKILL)
        self._kill_at = math.inf
        self.killed = self.killed or sorted(running)
        if self._give_up_at == math.inf:
            self._give_up_at, self._give_up_why = now + _UNREPORTED_WAIT, why

    # ----------------------------------------------------------------- outcome
    def exit_code(self, first_failure_status: int | None) -> int:
        """``monarch stop``: 254; a death signal N: 128+N (as a shell reports it); else the first failure's."""
        if self.stopped_by:
            return EXIT_STOPPED
        if self.received is not None:
            return 128 + self.received
        return first_failure_status or 0

    def ending(self) -> str:
        """One line on how the run was ended from outside, or "" when it ended by itself."""
        if self.stopped_by:
            return f"reservation stopped by {self.stopped_by}"
        if self.received is not None:
            name = signal_name(self.received)
            if self.killed:
                left = f"{_plural(self.killed)} still running after the {self.shutdown_timeout:g} s grace got SIGKILL"
            elif self._last_exit_at is not None and self._received_at is not None:
                left = f"ranks exited within {max(0.0, self._last_exit_at - self._received_at):.1f} s"
            else:
                left = "ranks exited"
            return f"received {name}; forwarded to ranks; {left}"
        if self.partition is not None:
            return f"{self.partition}; ranks stopped"
        if self.console_gone:
            return "its output's reader went away (e.g. `| head`); ranks stopped"
        if self.interrupts:
            if self.interrupts == 1:
                return "interrupted by Ctrl-C (SIGINT sent to ranks)"
            return f"interrupted by Ctrl-C x{self.interrupts} (ranks killed)"
        return ""


def _plural(ranks: Sequence[int]) -> str:
    return f"{'rank' if len(ranks) == 1 else 'ranks'} {rank_list(ranks)}"


class SignalRelay:
    """Catches ``signals`` while a run is in progress so the run loop can act on them.

    Handlers only record the signal; the loop acts (no socket work inside a handler).
    Only the main thread can install handlers; elsewhere this relays nothing.
    """

    def __init__(self, signals: Sequence[int]) -> None:
        self._pending: list[int] = []
        self._old: dict[int, Any] = {}
        if threading.current_thread() is threading.main_thread():
            for sig in dict.fromkeys(signals):
                self._old[sig] = signal.signal(sig, lambda s, _f: self._pending.append(s))

    def take(self) -> list[int]:
        taken = []
        while self._pending:  # pop, not copy-and-clear: a signal may land in between
            taken.append(self._pending.pop(0))
        return taken

    def restore(self) -> None:
        for sig, old in self._old.items():
            signal.signal(sig, old)
