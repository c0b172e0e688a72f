"""Actors, endpoints and the per-message context an endpoint runs in."""

from __future__ import annotations

import contextvars
import dataclasses
import inspect
import traceback
from collections.abc import Callable
from typing import Any, Protocol, TypeVar

from ..errors import ActorError, MonarchError
from .shape import Point

F = TypeVar("F", bound=Callable[..., Any])


class ProcHost(Protocol):
    """What code in a proc may ask of the proc hosting it (:class:`.proc.ProcServer` registers itself).

    Defined here, below the meshes and the proc, so that neither imports the other to find it.
    """

    inbox_addr: str

    def as_mesh(self) -> Any: ...

    def spawn_local(self, key: str, name: str, point: Point, cls: type, args: Any, kwargs: Any) -> None: ...


#: This process's proc bootstrap and server, set by :func:`.proc.main`; None in a controller.
_boot: dict[str, Any] | None = None
_server: ProcHost | None = None


class Actor:
    """Base class of everything spawned on a proc mesh.

    Define ``__supervise__(self, failure) -> bool`` to handle the death of procs in meshes
    this actor spawned; return a truthy value to mark the failure handled.
    """


def endpoint(fn: F) -> F:
    """Mark a method (plain or ``async def``) as callable through a mesh's adverbs."""
    if not callable(fn):
        raise TypeError("@endpoint decorates methods")
    fn._monarch_endpoint = True  # type: ignore[attr-defined]
    return fn


def endpoints_of(cls: type) -> frozenset[str]:
    return frozenset(name for name, value in inspect.getmembers(cls) if getattr(value, "_monarch_endpoint", False))


@dataclasses.dataclass
class Context:
    """Where the current code runs: its actor, its point in the actor mesh, its proc."""

    actor: Actor | None
    actor_name: str | None
    point: Point
    proc_id: str | None
    _key: str | None = None

    @property
    def proc(self) -> Any:
        """This proc as a one-proc :class:`~.mesh.ProcMesh` (what ``this_proc()`` returns)."""
        if _server is None:
            raise MonarchError(NOT_IN_A_PROC)
        return _server.as_mesh()


_CONTROLLER = Context(actor=None, actor_name=None, point=Point({}, 0, {}), proc_id=None)
_current: contextvars.ContextVar[Context] = contextvars.ContextVar("monarch_context", default=_CONTROLLER)


def context() -> Context:
    return _current.get()


def current_rank() -> Point:
    """This actor's point in its mesh (an empty point in the controller)."""
    return _current.get().point


def current_size() -> dict[str, int]:
    """The extent of this actor's mesh, e.g. ``{"hosts": 2, "gpus": 4}``."""
    return dict(_current.get().point.extent)


def _enter(ctx: Context) -> contextvars.Token:
    return _current.set(ctx)


def _leave(token: contextvars.Token) -> None:
    _current.reset(token)


NOT_IN_A_PROC = (
    "this_proc() is only available inside an actor; the controller spawns procs with this_host().spawn_procs()"
)


def current_bootstrap() -> dict[str, Any] | None:
    return _boot


def current_inbox() -> str:
    assert _server is not None
    return _server.inbox_addr


def spawn_here(key: str, name: str, point: Point, cls: type, args: Any, kwargs: Any) -> None:
    assert _server is not None
    try:
        _server.spawn_local(key, name, point, cls, args, kwargs)
    except BaseException as e:  # noqa: BLE001
        raise ActorError(
            f"constructing actor {name!r} at {point} failed {type(e).__name__}: {e}", traceback.format_exc(), e
        ) from None
