"""Plain data: what a client accepts from hosts, relays and ranks (docs/runtime.md, "Security").

Code flows one way: the client sends pickles with code in them (a spawn, a rank's spec), and
everything that comes back is data. The reservation's keys are shared by every party, so the
client cannot tell a forged reply from a true one; what it can refuse is a reply that runs code
when it is read. :func:`loads_plain` is :func:`pickle.loads` that resolves no global outside an
allowlist: builtins' value types and exceptions, a few standard value classes, numpy arrays,
torch tensors (as :mod:`.wire` ships them), this runtime's records and meshes, and the user's own
dataclasses, named tuples, enums and exceptions from modules the client has already imported.
Nothing is imported while reading, and no function outside the list can be called.
"""

from __future__ import annotations

import dataclasses
import enum
import io
import pickle
import sys
import sysconfig
from collections.abc import Sequence
from typing import Any

#: Globals a plain message may name: value types, and the few functions that rebuild values.
_ALLOWED: dict[str, frozenset[str]] = {
    "builtins": frozenset(
        "int float complex str bytes bytearray bool list tuple dict set frozenset slice range"
        " Ellipsis NotImplemented".split()
    ),
    "collections": frozenset({"OrderedDict", "defaultdict", "deque", "Counter"}),
    "datetime": frozenset({"datetime", "date", "time", "timedelta", "timezone"}),
    "decimal": frozenset({"Decimal"}),
    "fractions": frozenset({"Fraction"}),
    "uuid": frozenset({"UUID", "SafeUUID"}),
    "pathlib": frozenset({"Path", "PosixPath", "PurePath", "PurePosixPath"}),
    "numpy": frozenset({"ndarray", "dtype"}),
    "numpy.core.multiarray": frozenset({"_reconstruct", "scalar"}),
    "numpy._core.multiarray": frozenset({"_reconstruct", "scalar"}),
    "numpy.core.numeric": frozenset({"_frombuffer"}),
    "numpy._core.numeric": frozenset({"_frombuffer"}),
    "torch": frozenset({"Size", "device"}),
    "monarch_cli.runtime.transport.wire": frozenset({"_rebuild_tensor"}),
}
#: This package's modules whose classes (not functions) travel back: records, meshes, errors.
_OWN_PREFIXES = ("monarch_cli.runtime.protocol.", "monarch_cli.runtime.actor.")
_OWN_MODULES = frozenset({"monarch_cli.runtime.errors", "monarch_cli.errors"})
_INSTALLED = tuple(
    {sysconfig.get_paths()[k] for k in ("stdlib", "platstdlib", "purelib", "platlib")} | {sys.prefix, sys.base_prefix}
)


class NotPlainData(pickle.UnpicklingError):
    """A message from a host, relay or rank named something that is not plain data."""


class Withheld:
    """Stands for an object a lenient read refused (an exception of a class the client cannot
    accept): the error's message and traceback still arrive."""

    def __new__(cls, *_args: Any, **_kwargs: Any) -> Withheld:
        return object.__new__(cls)

    def __init__(self, *_args: Any, **_kwargs: Any) -> None:
        pass

    def __setstate__(self, _state: Any) -> None:
        pass


def _is_torch_dtype(module: str, name: str) -> bool:
    torch = sys.modules.get("torch") if module == "torch" else None
    return torch is not None and isinstance(getattr(torch, name, None), torch.dtype)


def _user_value_class(module: str, name: str) -> Any:
    """A dataclass, named tuple, enum or exception of the user's own code already imported here."""
    mod = sys.modules.get(module)
    file = getattr(mod, "__file__", None)
    if mod is None or not file or str(file).startswith(_INSTALLED):
        return None
    obj = getattr(mod, name, None)
    if not isinstance(obj, type) or getattr(obj, "__module__", None) != module:
        return None
    if dataclasses.is_dataclass(obj) or issubclass(obj, (tuple, enum.Enum, BaseException)):
        return obj
    return None


def resolve(module: str, name: str) -> Any:
    """The global ``module.name`` if plain data may name it, else ``None``. Nothing is imported."""
    if "." in name:
        return None
    mod = sys.modules.get(module)
    if name in _ALLOWED.get(module, ()) or _is_torch_dtype(module, name):
        return getattr(mod, name, None) if mod is not None else None
    if module == "builtins":
        obj = getattr(mod, name, None)
        return obj if isinstance(obj, type) and issubclass(obj, BaseException) else None
    if module in _OWN_MODULES or module.startswith(_OWN_PREFIXES):
        obj = getattr(mod, name, None)
        return obj if isinstance(obj, type) else None
    return _user_value_class(module, name)


class LiftedBytesUnpickler(pickle.Unpickler):
    """Reads what :func:`.wire.dumps` lifted out of band: big ``bytes``/``bytearray`` as persistent ids."""

    def persistent_load(self, pid: Any) -> Any:
        is_bytearray, buf = pid
        return bytearray(buf) if is_bytearray else bytes(buf)


class _PlainUnpickler(LiftedBytesUnpickler):
    lenient = False

    def find_class(self, module: str, name: str) -> Any:
        obj = resolve(module, name)
        if obj is not None:
            return obj
        if self.lenient:
            return Withheld
        raise NotPlainData(f"{module}.{name} is not plain data")


class _LenientUnpickler(_PlainUnpickler):
    lenient = True


def loads_plain(data: Any, buffers: Sequence[Any] = (), lenient: bool = False) -> Any:
    """``pickle.loads(data)`` that refuses (or, ``lenient``, withholds) anything but plain data."""
    cls = _LenientUnpickler if lenient else _PlainUnpickler
    return cls(io.BytesIO(data), buffers=buffers).load()
