"""The actor runtime: host agents, procs, actors and meshes over authenticated ZeroMQ."""

from .actor import Actor, Context, context, current_rank, current_size, endpoint
from .errors import ActorError, CallTimeout, Failure, MonarchError, SupervisionError
from .future import Future
from .keys import Keys
from .mesh import ActorMesh, HostMesh, ProcMesh, this_host, this_proc
from .shape import Point, Shape, ValueMesh

__all__ = [
    "Actor",
    "ActorError",
    "ActorMesh",
    "CallTimeout",
    "Context",
    "Failure",
    "Future",
    "HostMesh",
    "Keys",
    "MonarchError",
    "Point",
    "ProcMesh",
    "Shape",
    "SupervisionError",
    "ValueMesh",
    "context",
    "current_rank",
    "current_size",
    "endpoint",
    "this_host",
    "this_proc",
]
