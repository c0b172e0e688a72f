"""Message encoding: a small header frame, a cloudpickled body, and out-of-band buffers.

Large buffers (numpy arrays, torch tensors, ``pickle.PickleBuffer``) leave the pickle
through protocol 5's ``buffer_callback`` and travel as their own ZeroMQ frames without
being copied; on the receiving side they are rebuilt directly on the frame's (writable)
memory. ``bytes`` and ``bytearray`` are pickled in-band, one copy (CPython's pickler
never offers them to a reducer): wrap big binary payloads in ``np.frombuffer``.
"""

from __future__ import annotations

import io
import pickle
import sys
from typing import Any, List, Sequence

import cloudpickle

# Below this size an out-of-band frame costs more than it saves.
_OOB_MIN = 4096


class _Pickler(cloudpickle.Pickler):
    def reducer_override(self, obj: Any) -> Any:
        torch = sys.modules.get("torch")
        if torch is not None and type(obj) is not type and isinstance(obj, torch.Tensor):
            return _reduce_tensor(obj)
        return super().reducer_override(obj)


def _reduce_tensor(t: Any) -> Any:
    import torch

    if t.layout != torch.strided:
        return NotImplemented
    device = str(t.device)
    requires_grad = t.requires_grad
    cpu = t.detach().to("cpu").contiguous()
    dtype = cpu.dtype
    try:
        array = cpu.numpy()
        as_dtype = None
    except TypeError:  # bfloat16 and friends: ship the bits, view back on arrival
        as_dtype = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[cpu.element_size()]
        array = cpu.view(as_dtype).numpy()
    is_param = isinstance(t, torch.nn.Parameter)
    return _rebuild_tensor, (array, str(dtype), device, requires_grad, is_param)


def _rebuild_tensor(array: Any, dtype: str, device: str, requires_grad: bool, is_param: bool) -> Any:
    import torch

    t = torch.from_numpy(array)
    target = getattr(torch, dtype.split(".")[-1])
    if t.dtype != target:
        t = t.view(target)
    if device != "cpu":
        try:
            t = t.to(device)
        except Exception:  # the receiver has no such device: keep it on the CPU
            pass
    if is_param:
        return torch.nn.Parameter(t, requires_grad=requires_grad)
    if requires_grad:
        t.requires_grad_(True)
    return t


def dumps(obj: Any) -> List[Any]:
    """Encode ``obj`` into frames: ``[pickle, *buffers]``."""
    buffers: List[pickle.PickleBuffer] = []
    f = io.BytesIO()
    _Pickler(f, protocol=5, buffer_callback=buffers.append).dump(obj)
    frames: List[Any] = [f.getvalue()]
    for b in buffers:
        raw = b.raw()
        frames.append(raw if raw.nbytes >= _OOB_MIN else bytearray(raw))  # bytearray: stays writable
    return frames


def loads(frames: Sequence[Any]) -> Any:
    """Decode frames made by :func:`dumps` (ZeroMQ frames are used in place, not copied)."""
    return pickle.loads(frames[0], buffers=frames[1:])
