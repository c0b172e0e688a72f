"""Between an agent and its fork server, over a socketpair (the header tuple, pickled)."""

from __future__ import annotations

from typing import Any, NamedTuple

from .base import AGENT_ZYGOTE, ZYGOTE_AGENT, _message

__all__ = ["Fork", "Spares", "Forked", "ChildExited", "WarmReady"]


# ---------------------------------------------------------------- agent ↔ zygote
@_message("fork", AGENT_ZYGOTE)
class Fork(NamedTuple):
    """Fork a child (``kind``: proc, rank or cold); fds ride along (``SCM_RIGHTS``)."""

    req_id: int
    kind: str
    boot: dict[str, Any]


@_message("spares", AGENT_ZYGOTE)
class Spares(NamedTuple):
    """Keep ``wanted`` rank children forked ahead, idle until a ``fork`` of kind rank takes one
    (a warm zygote, after a run: the next run's ranks start without a fork each)."""

    wanted: int


@_message("forked", ZYGOTE_AGENT)
class Forked(NamedTuple):
    req_id: int
    pid: int


@_message("exit", ZYGOTE_AGENT)
class ChildExited(NamedTuple):
    pid: int
    status: int  # a wait status


@_message("ready", ZYGOTE_AGENT)
class WarmReady(NamedTuple):
    """A warm-rank zygote imported what ranks were seen to import (its report file says what)."""
