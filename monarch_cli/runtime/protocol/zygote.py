"""Between an agent and its fork server, over a socketpair (the header tuple, pickled)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, NamedTuple

from .base import AGENT_ZYGOTE, ZYGOTE_AGENT, _message

__all__ = ["Fork", "Spares", "LearnMore", "Forked", "ChildExited", "WarmReady"]


# ---------------------------------------------------------------- agent ↔ zygote
@_message("fork", AGENT_ZYGOTE)
class Fork(NamedTuple):
    """Fork a child (``kind``: proc, rank or cold); fds ride along (``SCM_RIGHTS``)."""

    req_id: int
    kind: str
    #: A RankSpec (kinds rank and cold) or a ProcBoot (proc), as the agent sends it; the zygote
    #: completes it and sends it on to a spare as the plain dict it received.
    boot: Mapping[str, Any]


@_message("spares", AGENT_ZYGOTE)
class Spares(NamedTuple):
    """Keep ``wanted`` rank children forked ahead, idle until a ``fork`` of kind rank takes one
    (a warm zygote, after a run: the next run's ranks start without a fork each)."""

    wanted: int


@_message("learn_more", AGENT_ZYGOTE)
class LearnMore(NamedTuple):
    """A warm zygote with no rank running: import the modules listed in ``learned`` too, in this
    process (no new one to start: torch is not imported again), then write ``ready`` and say
    ``ready``. Its idle spares go (forked before these imports). If one of the modules makes it
    unsafe to fork, it says so and runs every later rank cold (a fresh interpreter), so the
    forks queued behind this request still start."""

    learned: str
    ready: str


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
