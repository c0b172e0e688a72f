"""monarch-cli: reserve hosts once, run torchrun-style SPMD jobs on them many times.

The actor runtime is importable from here, so a single controller script can drive a
whole reservation::

    from monarch_cli import Actor, endpoint, this_host
"""

from .config import configure
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
