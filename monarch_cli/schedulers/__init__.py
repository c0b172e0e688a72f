"""Scheduler backends: one module each, all behind :class:`~.base.Scheduler`."""

from __future__ import annotations

from typing import Dict, Type

from ..jobs.errors import JobError
from .base import DryRun, HostStatus, Reservation, ReserveRequest, Scheduler, controller_host
from .local import LocalScheduler
from .slurm import SlurmScheduler
from .ssh import SshScheduler

_BACKENDS: Dict[str, Type[Scheduler]] = {"local": LocalScheduler, "slurm": SlurmScheduler, "ssh": SshScheduler}
#: torchx scheduler names users already type, mapped to ours.
ALIASES = {"local_cwd": "local"}


def get_scheduler(name: str) -> Scheduler:
    key = ALIASES.get(name, name)
    if key not in _BACKENDS:
        known = ", ".join(sorted([*_BACKENDS, *ALIASES]))
        raise JobError(f"unknown scheduler {name!r}; available: {known}")
    return _BACKENDS[key]()


__all__ = ["DryRun", "HostStatus", "Reservation", "ReserveRequest", "Scheduler", "controller_host", "get_scheduler",
           "ALIASES"]
