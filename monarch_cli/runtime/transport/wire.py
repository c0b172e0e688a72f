"""Message encoding: a small header, a cloudpickled body, and out-of-band buffers.

A message is either one packed frame (``<header length><header pickle><body pickle>``), for
the usual small message, or a header frame followed by the body's frames, when the body has
out-of-band buffers or is large. One frame instead of two saves ~8 µs per round trip here:
pyzmq's multipart send and receive cost far more per frame than the bytes do.

Large buffers (numpy arrays, torch tensors, ``pickle.PickleBuffer``) leave the pickle
through protocol 5's ``buffer_callback`` and travel as their own ZeroMQ frames without
being copied; on the receiving side they are rebuilt directly on the frame's (writable)
memory. ``bytes`` and ``bytearray`` of 4 KiB and more leave the pickle too when a message
would otherwise carry over 1 MiB in-band: CPython's pickler never offers them to
``reducer_override``, so such a message is pickled a second time with ``persistent_id`` (which
sees every object), and its first frame is tagged. They are sent without a copy; the receiver
makes the one copy that building a ``bytes`` object needs. Small messages never take that path.
"""

from __future__ import annotations

import io
import pickle
import struct
import sys
from collections.abc import Sequence
from typing import Any

from .plain import LiftedBytesUnpickler, loads_plain

# Below this size an out-of-band frame costs more than it saves.
_OOB_MIN = 4096
# Up to this size a body is packed with its header into one frame (one small copy).
_PACK_MAX = 64 * 1024
_LEN = struct.Struct("<I")
# A message with this much in-band data is pickled again with big bytes/bytearray lifted out.
_LIFT_AT = 1 << 20
_LIFTED = b"L"  # first byte of a lifted message's pickle frame (a plain pickle starts with PROTO)


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
        except Exception:  # noqa: BLE001 - the receiver has no such device: keep it on the CPU
            pass
    if is_param:
        return torch.nn.Parameter(t, requires_grad=requires_grad)
    if requires_grad:
        t.requires_grad_(True)
    return t


_picklers: tuple[type, type] | None = None


def _pickler_classes() -> tuple[type, type]:
    """cloudpickle's pickler and the bytes-lifting one, made at first use: a process that only
    sends plain data (:func:`dumps_data`, a run's client) never imports cloudpickle (~3 ms)."""
    global _picklers
    if _picklers is None:
        import cloudpickle

        class _Pickler(cloudpickle.Pickler):
            def reducer_override(self, obj: Any) -> Any:
                torch = sys.modules.get("torch")
                if torch is not None and type(obj) is not type and isinstance(obj, torch.Tensor):
                    return _reduce_tensor(obj)
                return super().reducer_override(obj)

        class _BytesLifter(_Pickler):
            """The second pass: ``persistent_id`` sends big ``bytes``/``bytearray`` out of band.

            A separate class because defining ``persistent_id`` at all costs a Python call per
            pickled object, which the usual small message must not pay.
            """

            lifted = 0

            def persistent_id(self, obj: Any) -> Any:
                kind = type(obj)
                if (kind is bytes or kind is bytearray) and len(obj) >= _OOB_MIN:
                    self.lifted += 1
                    return (kind is bytearray, pickle.PickleBuffer(obj))
                return None

        _picklers = (_Pickler, _BytesLifter)
    return _picklers


def _dump(pickler: type, obj: Any) -> tuple[list[Any], Any]:
    buffers: list[pickle.PickleBuffer] = []
    f = io.BytesIO()
    p = pickler(f, protocol=5, buffer_callback=buffers.append)
    p.dump(obj)
    frames: list[Any] = [f.getvalue()]
    for b in buffers:
        raw = b.raw()
        frames.append(raw if raw.nbytes >= _OOB_MIN else bytearray(raw))  # bytearray: stays writable
    return frames, p


def dumps(obj: Any) -> list[Any]:
    """Encode ``obj`` into frames: ``[pickle, *buffers]``."""
    pickler, lifter_class = _pickler_classes()
    frames, _ = _dump(pickler, obj)
    if len(frames[0]) >= _LIFT_AT:
        lifted, lifter = _dump(lifter_class, obj)
        if lifter.lifted:
            lifted[0] = _LIFTED + lifted[0]
            return lifted
    return frames


def dumps_data(obj: Any) -> list[Any]:
    """Encode plain data (builtins; classes importable by name on both sides: the protocol's
    records, dataclasses of this package) as :func:`dumps` would, with the standard pickler:
    no functions or classes by value, no out-of-band buffers. For the small control bodies on
    a run's path (the ranks' specs, a workspace check)."""
    return [pickle.dumps(obj, 5)]


def loads(frames: Sequence[Any], plain: bool = False, lenient: bool = False) -> Any:
    """Decode frames made by :func:`dumps` (ZeroMQ frames are used in place, not copied).

    ``plain``: the sender is a host, relay or rank, and the reader a client: refuse anything
    but plain data (:mod:`.plain`); ``lenient`` withholds it instead (an error's exception)."""
    if len(frames) > 1 and memoryview(frames[0])[:1] == _LIFTED:
        data, buffers = memoryview(frames[0])[1:], frames[1:]
        if plain:
            return loads_plain(data, buffers, lenient)
        return LiftedBytesUnpickler(io.BytesIO(data), buffers=buffers).load()
    if plain:
        return loads_plain(frames[0], frames[1:], lenient)
    return pickle.loads(frames[0], buffers=frames[1:])


def send_message(sock: Any, header: tuple[Any, ...], body: Sequence[Any] = ()) -> None:
    """Send ``header`` and ``body`` (frames from :func:`dumps`) as one message on a ZeroMQ socket."""
    h = pickle.dumps(header, 5)
    if not body or (len(body) == 1 and len(body[0]) <= _PACK_MAX):
        sock.send(b"".join((_LEN.pack(len(h)), h, *body)))  # send_multipart's Python loop costs ~1 µs more
    else:
        sock.send_multipart([h, *body], copy=False)


def frames(header: tuple[Any, ...], body: Sequence[Any] = ()) -> list[Any]:
    """The frames :func:`send_message` would send, for a caller that adds its own (a route, a queue tag)."""
    h = pickle.dumps(header, 5)
    if not body or (len(body) == 1 and len(body[0]) <= _PACK_MAX):
        return [b"".join((_LEN.pack(len(h)), h, *body))]
    return [h, *body]


def recv_frames(sock: Any, flags: int = 0) -> list[Any]:
    """One message's frames, zero-copy: ``recv_multipart(copy=False)`` minus ~1.3 µs of overhead."""
    frames = [sock.recv(flags, copy=False)]
    while frames[-1].more:
        frames.append(sock.recv(copy=False))
    return frames


def parse(frames: Sequence[Any], plain: bool = False) -> tuple[tuple[Any, ...], list[Any]]:
    """``(header, body frames)`` of a message sent by :func:`send_message` (its frames, no identity);
    ``plain``: a client reading a host's message, which may hold nothing but plain data."""
    load = loads_plain if plain else pickle.loads
    if len(frames) == 1:
        buf = frames[0].buffer
        end = 4 + _LEN.unpack_from(buf)[0]
        return load(buf[4:end]), ([buf[end:]] if len(buf) > end else [])
    return load(frames[0].buffer), list(frames[1:])
