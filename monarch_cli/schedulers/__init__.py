"""Scheduler backends: one subpackage each (ssh, skypilot, slurm, kubernetes, local), all behind
:class:`~.base.Scheduler`.

The registry below is lazy: a backend's module is imported only when it is used. A new
backend in this package is one line in ``_BUILTIN``; a third-party package registers
its own through the ``monarch_cli.schedulers`` entry-point group::

    [project.entry-points."monarch_cli.schedulers"]
    mycluster = "mypackage.monarch_backend:MyClusterScheduler"
"""

from __future__ import annotations

import importlib

from ..errors import JobError
from .base import (
    HostRecord,
    Liveness,
    Option,
    Plan,
    Probe,
    Reservation,
    ReservationRecord,
    ReserveRequest,
    Scheduler,
    parse_option_pairs,
)

#: name -> "module:Class", imported on first use.
_BUILTIN: dict[str, str] = {
    "kubernetes": "monarch_cli.schedulers.kubernetes:KubernetesScheduler",
    "local": "monarch_cli.schedulers.local:LocalScheduler",
    "slurm": "monarch_cli.schedulers.slurm:SlurmScheduler",
    "ssh": "monarch_cli.schedulers.ssh:SshScheduler",
    "skypilot": "monarch_cli.schedulers.skypilot:SkyPilotScheduler",
}
#: Families: ``<family>:<name>`` -> "module:function" returning the backend class for that name.
_FAMILIES: dict[str, str] = {
    "torchx": "monarch_cli.schedulers.torchx:scheduler_class_for",
}
#: torchx scheduler names users already type, mapped to ours.
ALIASES = {"local_cwd": "local"}
ENTRY_POINT_GROUP = "monarch_cli.schedulers"


def _entry_points() -> dict[str, str]:
    from importlib.metadata import entry_points

    return {ep.name: ep.value for ep in entry_points(group=ENTRY_POINT_GROUP)}


def available() -> list[str]:
    """Every backend name (built-in, third-party and aliases), sorted."""
    return sorted({*_BUILTIN, *_entry_points(), *ALIASES})


def scheduler_class(name: str) -> type[Scheduler]:
    key = ALIASES.get(name, name)
    family, colon, member = key.partition(":")
    if colon and family in _FAMILIES:
        module, _, attr = _FAMILIES[family].partition(":")
        cls = getattr(importlib.import_module(module), attr)(member)
        return cls
    target = _BUILTIN.get(key) or _entry_points().get(key)
    if target is None:
        families = ", ".join(f"{f}:<name>" for f in _FAMILIES)
        raise JobError(f"unknown scheduler {name!r}; available: {', '.join(available())}, {families}")
    module, _, attr = target.partition(":")
    cls = getattr(importlib.import_module(module), attr)
    if not (isinstance(cls, type) and issubclass(cls, Scheduler)):
        raise JobError(f"scheduler {name!r} ({target}) is not a monarch_cli.schedulers.Scheduler")
    return cls


def get_scheduler(name: str) -> Scheduler:
    return scheduler_class(name)()


__all__ = [
    "HostRecord",
    "Liveness",
    "Option",
    "Plan",
    "Probe",
    "Reservation",
    "ReservationRecord",
    "ReserveRequest",
    "Scheduler",
    "get_scheduler",
    "scheduler_class",
    "available",
    "parse_option_pairs",
    "ALIASES",
    "ENTRY_POINT_GROUP",
]
