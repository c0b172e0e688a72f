"""What the framework scripts share: a deterministic set-up, the device, and the checksum they print.

Each script prints ``param-checksum <sha256>`` on rank 0: the SHA-256 of its final parameters
(name order, float32 bytes), which must be bit for bit the same however the ranks were started.

``FW_DEVICE=cuda`` (``benchmarks/frameworks.py --device cuda`` sets it) puts every script on the
GPU that ``LOCAL_RANK`` selects, with nccl: one rank per GPU. Unset or ``cpu``: CPU and gloo.
"""

from __future__ import annotations

import atexit
import hashlib
import os
import time
from collections.abc import Iterable
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # imported by the scripts, after this module set the environment up
    import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # tiny models are built from configs: never the hub
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
_STARTED = time.perf_counter()
STEPS = int(os.environ.get("FW_STEPS", "8"))
DEVICE_TYPE = os.environ.get("FW_DEVICE", "cpu")
if DEVICE_TYPE not in ("cpu", "cuda"):
    raise SystemExit(f"FW_DEVICE={DEVICE_TYPE!r}: cpu or cuda")
BACKEND = "nccl" if DEVICE_TYPE == "cuda" else "gloo"
if DEVICE_TYPE == "cuda":  # cuBLAS is deterministic only with a fixed workspace, set before its first handle
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")


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
    # On a GPU a kernel without a deterministic implementation warns instead of failing the run:
    # the checksum against cold torchrun still says whether the result differs.
    torch.use_deterministic_algorithms(True, warn_only=DEVICE_TYPE == "cuda")


def device() -> torch.device:
    """The rank's device: ``cuda:LOCAL_RANK`` (made current) under ``FW_DEVICE=cuda``, else the CPU."""
    import torch

    if DEVICE_TYPE != "cuda":
        return torch.device("cpu")
    index = int(os.environ.get("LOCAL_RANK", "0"))
    torch.cuda.set_device(index)
    return torch.device("cuda", index)


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
