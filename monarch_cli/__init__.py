"""monarch-cli: reserve hosts once, run torchrun-style SPMD jobs on them many times.

The actor runtime is importable from here, so a single controller script can drive a
whole reservation::

    from monarch_cli import Actor, endpoint, this_host
"""

from typing import TYPE_CHECKING, Any

from .config import configure

if TYPE_CHECKING:
    from .runtime import (
        Actor,
        ActorError,
        ActorMesh,
        CallTimeout,
        Context,
        Failure,
        Future,
        HostMesh,
        MonarchError,
        Point,
        ProcMesh,
        SupervisionError,
        ValueMesh,
        context,
        current_rank,
        current_size,
        endpoint,
        this_host,
        this_proc,
    )


def __getattr__(name: str) -> Any:
    """Import the runtime on first use, so `monarch --help` does not pay for it."""
    if name in __all__ and name != "configure":
        from . import runtime

        return getattr(runtime, name)
    raise AttributeError(f"module 'monarch_cli' has no attribute {name!r}")


__version__ = "0.1.0"

__all__ = [
    "Actor",
    "ActorError",
    "ActorMesh",
    "CallTimeout",
    "Context",
    "Failure",
    "Future",
    "HostMesh",
    "MonarchError",
    "Point",
    "ProcMesh",
    "SupervisionError",
    "ValueMesh",
    "configure",
    "context",
    "current_rank",
    "current_size",
    "endpoint",
    "this_host",
    "this_proc",
]
