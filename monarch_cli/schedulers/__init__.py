"""Scheduler backends: one module each, all behind :class:`~.base.Scheduler`."""

from __future__ import annotations

import importlib
from typing import Dict, Tuple

from ..jobs.errors import JobError
from .base import DryRun, HostStatus, Reservation, ReserveRequest, Scheduler, controller_host

#: Backends by name: (module, class), imported when first used, so that a command that only
#: talks to running agents does not pay for every backend's imports.
_BACKENDS: Dict[str, Tuple[str, str]] = {"local": ("local", "LocalScheduler"), "slurm": ("slurm", "SlurmScheduler")}
#: torchx scheduler names users already type, mapped to ours.
ALIASES = {"local_cwd": "local"}


def get_scheduler(name: str) -> Scheduler:
    key = ALIASES.get(name, name)
    if key not in _BACKENDS:
        known = ", ".join(sorted([*_BACKENDS, *ALIASES]))
        raise JobError(f"unknown scheduler {name!r}; available: {known}")
    module, cls = _BACKENDS[key]
    return getattr(importlib.import_module(f".{module}", __name__), cls)()


__all__ = ["DryRun", "HostStatus", "Reservation", "ReserveRequest", "Scheduler", "controller_host", "get_scheduler",
           "ALIASES"]
