"""What the four framework scripts share: a deterministic set-up and the checksum they print.

Each script prints ``param-checksum <sha256>`` on rank 0: the SHA-256 of its final parameters
(name order, float32 bytes), which must be bit for bit the same however the ranks were started.
"""

from __future__ import annotations

import atexit
import hashlib
import os
import time
from collections.abc import Iterable

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # tiny models are built from configs: never the hub
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
_STARTED = time.perf_counter()
STEPS = int(os.environ.get("FW_STEPS", "8"))


def deterministic() -> None:
    """One thread and deterministic kernels: 1 host x 2 ranks and 2 hosts x 1 rank must agree
    (torchrun sets OMP_NUM_THREADS=1 only when ranks share a host).

    ``OMP_NUM_THREADS`` too: where it is unset, Accelerate (under HF's Trainer as well) sets
    torch's threads to the physical cores / local ranks when it starts its process group,
    undoing ``set_num_threads(1)``. On 2 hosts x 1 rank emulated on one 2-core machine that was
    2 threads per rank, 4 on 2 cores, cold and warm alike: the Trainer's own work there varied
    from 0.45 to 1.9 s."""
    import torch

    os.environ.setdefault("OMP_NUM_THREADS", "1")
    torch.set_num_threads(1)
    torch.use_deterministic_algorithms(True)


def checksum(named: Iterable[tuple[str, object]]) -> str:
    digest = hashlib.sha256()
    for name, tensor in sorted(named, key=lambda item: item[0]):
        digest.update(name.encode())
        digest.update(tensor.detach().float().contiguous().cpu().numpy().tobytes())  # type: ignore[attr-defined]
    return digest.hexdigest()


def report(named: Iterable[tuple[str, object]], rank: int) -> None:
    """Rank 0 prints the checksum; every rank prints its own time when it ends (below)."""
    value = checksum(named)
    if rank == 0:
        print(f"param-checksum {value}", flush=True)


def _own_time() -> None:
    """The script's time, from its first line to its end: its teardown (``destroy_process_group``,
    the frameworks' own ``atexit`` handlers) is its own work too. Registered first, so run last
    (``atexit`` is last in, first out). Imports included; the rank that started last waited for no
    other, so its time is the script's work."""
    print(f"script-seconds {time.perf_counter() - _STARTED:.3f}", flush=True)


atexit.register(_own_time)
