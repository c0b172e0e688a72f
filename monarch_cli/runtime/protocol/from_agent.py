"""What agents (and procs, for ``result``) send back: the answer to a request, and events."""

from __future__ import annotations

from typing import Any, NamedTuple

from ..errors import Failure
from .base import AGENT_CLIENT, ANY, _message

__all__ = [
    "Result",
    "Output",
    "RankExited",
    "RankPaused",
    "ReservationStopped",
    "Telemetry",
    "DebugOutput",
    "DebugState",
    "DebugDapToIde",
    "DebugDapClosed",
    "ProcExited",
]


# ---------------------------------------------------------------------------- answers
@_message("result", ANY)
class Result(NamedTuple):
    """The answer to a request; the body is the value, or ``(message, traceback, exception)`` if not ``ok``."""

    cid: int
    ok: bool


# ------------------------------------------------------------ agent → client events
@_message("output", AGENT_CLIENT)
class Output(NamedTuple):
    """Raw bytes (the body) of one rank's stream (1 stdout, 2 stderr), in order."""

    run_id: str
    rank: int
    stream: int


@_message("rank_exit", AGENT_CLIENT)
class RankExited(NamedTuple):
    """A rank ended, after both its pipes did; ``exitcode`` and ``signal`` are None when it never
    started (``cause`` says why), ``cause`` is set when it ended by no doing of its own."""

    run_id: str
    rank: int
    exitcode: int | None
    signal: int | None
    duration: float
    pid: int | None
    cause: str


@_message("rank_paused", AGENT_CLIENT)
class RankPaused(NamedTuple):
    """A rank stopped in a breakpoint (``where``: file, line, function, reason), told to its run's owner."""

    run_id: str
    rank: int
    host: str
    where: dict[str, Any]


@_message("reservation_stopped", AGENT_CLIENT)
class ReservationStopped(NamedTuple):
    run_id: str
    agent: str
    who: str


@_message("telemetry", AGENT_CLIENT)
class Telemetry(NamedTuple):
    """A host's resource samples and the ranks' step records, pushed to the run's owner."""

    run_id: str
    host: str
    samples: list[Any]
    steps: list[Any]


@_message("debug_output", AGENT_CLIENT)
class DebugOutput(NamedTuple):
    run_id: str
    rank: int
    data: str


@_message("debug_state", AGENT_CLIENT)
class DebugState(NamedTuple):
    """``state`` is running, paused (``detail``: where) or exited (``detail``: how)."""

    run_id: str
    rank: int
    state: str
    detail: Any


@_message("debug_dap_to_ide", AGENT_CLIENT)
class DebugDapToIde(NamedTuple):
    """One whole DAP message from the rank's debugpy."""

    run_id: str
    rank: int
    message: bytes


@_message("debug_dap_closed", AGENT_CLIENT)
class DebugDapClosed(NamedTuple):
    run_id: str
    rank: int
    why: str


@_message("proc_exit", AGENT_CLIENT)
class ProcExited(NamedTuple):
    proc_id: str
    failure: Failure
    expected: bool
