"""The actor runtime: host agents, procs, actors and meshes over authenticated ZeroMQ."""

import importlib
from typing import Any

_HOME = {
    "Actor": "actor",
    "Context": "actor",
    "context": "actor",
    "current_rank": "actor",
    "current_size": "actor",
    "endpoint": "actor",
    "ActorError": "errors",
    "CallTimeout": "errors",
    "Failure": "errors",
    "MonarchError": "errors",
    "SupervisionError": "errors",
    "Future": "future",
    "Keys": "keys",
    "ActorMesh": "mesh",
    "HostMesh": "mesh",
    "ProcMesh": "mesh",
    "this_host": "mesh",
    "this_proc": "mesh",
    "Point": "shape",
    "Shape": "shape",
    "ValueMesh": "shape",
}


def __getattr__(name: str) -> Any:
    """Load submodules on first use: the CLI needs a few of them, not all."""
    if name in _HOME:
        return getattr(importlib.import_module(f".{_HOME[name]}", __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = sorted(_HOME)
