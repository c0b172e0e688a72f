"""A warm rank's CUDA context, made on its device while its script starts (GPU hosts only).

Creating a CUDA context costs a rank ~0.3-1 s on an H100, paid at the script's first CUDA call,
after its imports. A warm rank starts with its imports done, so that cost is most of what is
left: here it is paid on a thread of the rank's own, begun before the script runs, on the
device the rank's ``LOCAL_RANK`` selects (the primary context, which the script's own
``torch.cuda.set_device(local_rank)`` then finds made). Never in the warm process: a process
that forks after CUDA is initialised hands its children a context they cannot use.

Left alone (the script gets exactly what a fresh interpreter gives it):

* a rank without torch loaded, or on a host where torch sees no GPU;
* a ``LOCAL_RANK`` beyond the devices visible to the rank;
* a script whose source names ``CUDA_VISIBLE_DEVICES``: CUDA reads that variable once, when it
  is initialised, so a script that sets it itself must be the first to initialise CUDA;
* ``MONARCH_CUDA_READY=0`` in the rank's environment.

A script that selects another device still runs correctly: it makes that device's context
itself, as it would have anyway (the one made here stays, idle).
"""

from __future__ import annotations

import os
import sys
import threading
from typing import TYPE_CHECKING, Any

from ...config import EnvSettings, env

if TYPE_CHECKING:
    from ..protocol import RankSpec

ENV = EnvSettings.cuda_ready.var
_MARK = b"CUDA_VISIBLE_DEVICES"


def _script_sets_devices(spec: RankSpec) -> bool:
    """Whether the rank's script (its entry file) mentions ``CUDA_VISIBLE_DEVICES``; a module run
    with ``-m`` is not read, and counts as one that might."""
    if spec.get("mode") != "script":
        return True
    try:
        with open(os.path.join(spec["cwd"], spec["program"][0]), "rb") as f:
            return _MARK in f.read()
    except (OSError, IndexError, KeyError):
        return True


def device_for(spec: RankSpec) -> int | None:
    """The device index to make ready for this rank, or None to leave CUDA alone."""
    torch = sys.modules.get("torch")
    if torch is None or not env.cuda_ready:
        return None
    try:
        local = int(os.environ.get("LOCAL_RANK", "0"))
    except ValueError:
        return None
    if _script_sets_devices(spec):
        return None
    try:
        if not torch.cuda.is_available() or local >= torch.cuda.device_count():
            return None
    except Exception:  # noqa: BLE001 - a broken driver: the script meets it as it would anyway
        return None
    return local


def _make_context(torch: Any, device: int) -> None:
    try:
        torch.cuda.synchronize(device)  # (creates the primary context; allocates nothing)
    except Exception:  # noqa: BLE001 - the script meets the same error itself, where it can say so
        pass


def start(spec: RankSpec) -> threading.Thread | None:
    """Begin making the rank's CUDA context on a thread of its own; the thread, or None."""
    device = device_for(spec)
    if device is None:
        return None
    thread = threading.Thread(
        target=_make_context, args=(sys.modules["torch"], device), name="monarch-cuda-ready", daemon=True
    )
    thread.start()
    return thread
