"""The actor API's messages: a client (or an owner proc) to a proc, and back."""

from __future__ import annotations

from typing import Any, NamedTuple

from ..errors import Failure
from .base import CLIENT_PROC, PROC_CLIENT, _message

__all__ = ["Call", "Spawn", "StopActor", "Stop", "Unhandled", "EndpointError"]


# ------------------------------------------------------------------- client → proc
@_message("call", CLIENT_PROC)
class Call(NamedTuple):
    """Call an endpoint; the body is ``(args, kwargs)``; ``cid`` None: a broadcast, no answer."""

    cid: int | None
    reply_to: str
    key: str
    method: str


@_message("spawn", CLIENT_PROC)
class Spawn(NamedTuple):
    """Construct an actor; the body is ``(class, args, kwargs)``."""

    cid: int
    reply_to: str
    key: str
    name: str
    point: Any


@_message("stop_actor", CLIENT_PROC)
class StopActor(NamedTuple):
    cid: int
    reply_to: str
    key: str


@_message("stop", CLIENT_PROC)
class Stop(NamedTuple):
    cid: int
    reply_to: str


@_message("unhandled", PROC_CLIENT)
class Unhandled(NamedTuple):
    """A failure in a mesh this proc owns that no ``__supervise__`` handled."""

    proc_id: str
    failure: Failure


@_message("endpoint_error", PROC_CLIENT)
class EndpointError(NamedTuple):
    """A broadcast (no answer awaited) failed: said on the caller's stderr."""

    message: str
