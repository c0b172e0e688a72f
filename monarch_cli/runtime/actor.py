"""Actors, endpoints and the per-message context an endpoint runs in."""

from __future__ import annotations

import contextvars
import dataclasses
import inspect
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, TypeVar

from .shape import Point

if TYPE_CHECKING:
    from .mesh import ProcMesh

F = TypeVar("F", bound=Callable[..., Any])


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
    def proc(self) -> ProcMesh:
        from .mesh import this_proc

        return this_proc()


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
