"""The torchx backends: ``--scheduler torchx:<name>`` reserves hosts through any scheduler torchx knows.

Runs in the client. One subpackage like every backend: :mod:`.scheduler` (the contract),
:mod:`.appdef` (the AppDef and torchx's run options as data), :mod:`.local_replicas` (keeping
a reservation alive beyond the process that submitted it on torchx's local schedulers). torchx
is an optional extra, imported only here and only when a ``torchx:`` backend is used.
"""

from __future__ import annotations

from .scheduler import PREFIX, TorchxScheduler, scheduler_class_for

__all__ = ["PREFIX", "TorchxScheduler", "scheduler_class_for"]
