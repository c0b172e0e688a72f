"""The actor runtime: host agents, procs, actors and meshes over authenticated ZeroMQ.

One subpackage per place code runs, each importing only those below it (tests/test_layers.py):

* :mod:`.transport`: encoding, keys, authenticated sockets (every process);
* :mod:`.protocol`: every message between processes, typed and defined once;
* :mod:`.mailbox`: the per-process endpoint and its futures (client, procs);
* :mod:`.launch`: the agent's command line and starting agents (client);
* :mod:`.actor`: the actor API and the proc process (client, procs);
* :mod:`.rank`: inside a rank of an SPMD run (rank, warm process);
* :mod:`.agent`: the host agent, its handlers and warm processes (each host).

Modules directly here (errors, exit statuses, process titles, workspace manifests, the DAP link's
pieces) are leaves that several of those processes share.
"""

import importlib
from typing import Any

_HOME = {
    "Actor": "actor.actor",
    "Context": "actor.actor",
    "context": "actor.actor",
    "current_rank": "actor.actor",
    "current_size": "actor.actor",
    "endpoint": "actor.actor",
    "ActorError": "errors",
    "CallTimeout": "errors",
    "Failure": "errors",
    "MonarchError": "errors",
    "SupervisionError": "errors",
    "Future": "mailbox.future",
    "Keys": "transport.keys",
    "ActorMesh": "actor.mesh",
    "HostMesh": "actor.mesh",
    "ProcMesh": "actor.mesh",
    "this_host": "actor.mesh",
    "this_proc": "actor.mesh",
    "Point": "actor.shape",
    "Shape": "actor.shape",
    "ValueMesh": "actor.shape",
}


def __getattr__(name: str) -> Any:
    """Load submodules on first use: the CLI needs a few of them, not all."""
    if name in _HOME:
        return getattr(importlib.import_module(f".{_HOME[name]}", __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = sorted(_HOME)
