"""Jobs: reservations recorded in a state file, and SPMD runs on them.

Names load on first use, so a command that only reads files (``monarch logs``) does not
import the runtime (zmq, cloudpickle).
"""

import importlib
from typing import Any

from .errors import JobError

_HOME = {
    "Job": "job",
    "clear_unreadable": "reserve",
    "dryrun": "reserve",
    "job_load": "job",
    "reserve_plan": "reserve",
    "serve": "reserve",
    "HostSet": "model",
    "RankExit": "model",
    "RunOptions": "model",
    "RunResult": "model",
    "StaleReservation": "model",
    "VersionMismatch": "model",
    "new_run_id": "spmd",
}


def __getattr__(name: str) -> Any:
    if name in _HOME:
        return getattr(importlib.import_module(f".{_HOME[name]}", __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    "HostSet",
    "Job",
    "JobError",
    "RankExit",
    "RunOptions",
    "RunResult",
    "StaleReservation",
    "VersionMismatch",
    "clear_unreadable",
    "dryrun",
    "job_load",
    "new_run_id",
    "reserve_plan",
    "serve",
]
