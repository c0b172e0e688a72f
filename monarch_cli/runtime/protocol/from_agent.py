"""What agents (and procs, for ``result``) send back: the answer to a request, and events."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
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
    "Batch",
    "BATCHED",
    "unbatch",
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


# ------------------------------------------------------------------------ batches
@_message("batch", AGENT_CLIENT)
class Batch(NamedTuple):
    """Several events for one client from one round of an agent's loop, in the order they were
    sent: one message (one receive, one CURVE decryption, one parse) instead of one per rank event.

    ``events`` holds each event's header tuple; ``sizes`` the byte length of each event's body
    (one frame, -1 for none); the bodies travel concatenated in one body frame, in order.
    """

    events: list[tuple[Any, ...]]
    sizes: list[int]


#: The kinds an agent may put in a :class:`Batch` (each with at most one body frame): a run's
#: routed events. Anything else to the same client first sends what is batched, so the order
#: a client sees is the order the agent sent.
BATCHED = frozenset({"output", "rank_exit", "telemetry"})


def unbatch(batch: Batch, body: Sequence[Any]) -> Iterator[tuple[tuple[Any, ...], list[Any]]]:
    """``(header, body frames)`` of each event in ``batch``, in order; bodies are views of the frame, not copies."""
    view = memoryview(body[0]) if body else memoryview(b"")
    at = 0
    for head, size in zip(batch.events, batch.sizes):
        if size < 0:
            yield head, []
        else:
            yield head, [view[at : at + size]]
            at += size
