"""The job state cache: what ``monarch serve`` reserved, so later commands can reuse it.

The file holds the reservation's key pair, so it is written atomically (a crash never
leaves a half-written file) and always with mode 0600.  It is a pickle of builtins only
and is read with an unpickler that resolves no globals at all: loading a state file must
never be a way to run code, even if someone else managed to write it.
"""

from __future__ import annotations

import dataclasses
import io
import os
import pickle
import pickletools
import stat
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, cast

from ..config import EnvSettings, env
from ..schedulers.base import HostRecord
from ..sysutil import atomic_write
from .errors import JobError

__all__ = [
    "SCHEMA_VERSION",
    "DEFAULT_STATE_PATH",
    "STATE_ENV",
    "HostRecord",
    "JobState",
    "StateError",
    "NoReservation",
    "state_path",
    "find_state_dir",
    "save_state",
    "load_state",
    "clear_state",
]

SCHEMA_VERSION = 2  # 2: default_cwd (version-1 files still load, with default_cwd None)
DEFAULT_STATE_PATH = Path(".monarch/job_state.pkl")
STATE_ENV = EnvSettings.state.var

_MAGIC = "monarch-cli-job-state"
_PROTOCOL = 4  # every builtin we store has a native opcode, so no globals are ever needed
_MAX_BYTES = 16 * 1024 * 1024  # far above any real state; refuses to slurp a wrong, huge file
_PLAIN = (dict, list, tuple, set, frozenset, str, bytes, int, float, bool, type(None))


class StateError(JobError):
    """The state file exists but cannot be used (corrupt, foreign, too new, unreadable)."""


class NoReservation(StateError):
    """There is no state file: nothing has been reserved yet (or it was cleared)."""


@dataclass
class JobState:
    """Everything later commands need to reach a reservation without asking the scheduler."""

    scheduler: str
    reservation_id: str
    hosts: list[HostRecord]
    keys: str
    default_command: list[str]
    created_at: float
    scheduler_data: dict = field(default_factory=dict)
    last_run: dict | None = None
    default_cwd: str | None = None  # where `serve` ran: the default command's relative paths resolve there
    schema_version: int = SCHEMA_VERSION


class _ForeignObject(pickle.UnpicklingError):
    """Raised inside unpickling when the file references something other than builtins."""


# Opcodes that can only build plain builtin data (any protocol).  Everything else --
# GLOBAL, REDUCE, BUILD, NEWOBJ, EXT*, PERSID, out-of-band buffers -- can reach code.
_SAFE_OPS = frozenset(
    "PROTO FRAME STOP MARK POP POP_MARK DUP NONE NEWTRUE NEWFALSE INT BININT BININT1 BININT2 "
    "LONG LONG1 LONG4 FLOAT BINFLOAT STRING BINSTRING SHORT_BINSTRING UNICODE BINUNICODE "
    "SHORT_BINUNICODE BINUNICODE8 BINBYTES SHORT_BINBYTES BINBYTES8 EMPTY_LIST APPEND APPENDS "
    "LIST EMPTY_TUPLE TUPLE TUPLE1 TUPLE2 TUPLE3 EMPTY_DICT DICT SETITEM SETITEMS EMPTY_SET "
    "ADDITEMS FROZENSET PUT BINPUT LONG_BINPUT MEMOIZE GET BINGET LONG_BINGET".split()
)
_MEMO_OPS = frozenset({"PUT", "BINPUT", "LONG_BINPUT", "GET", "BINGET", "LONG_BINGET"})


def _scan(data: bytes) -> None:
    """Vet every opcode before unpickling.

    pickletools checks each length field against the bytes actually present, and a memo
    index can be no larger than the number of opcodes so far; without this a few corrupt
    bytes can make the C unpickler allocate gigabytes before it notices the damage.
    """
    end = 0
    # typeshed's genops is for any stream: for bytes every position is known, and the memo and FRAME args are ints
    for count, (opcode, arg, pos) in enumerate(pickletools.genops(data)):
        if opcode.name not in _SAFE_OPS:
            raise _ForeignObject(f"opcode {opcode.name}")
        if opcode.name in _MEMO_OPS and not 0 <= cast(int, arg) <= count:
            raise ValueError(f"memo index {arg} out of range")
        if opcode.name == "FRAME" and cast(int, arg) > len(data):
            raise ValueError("frame longer than the file")
        end = cast(int, pos) + 1  # genops stops after STOP, a one-byte opcode
    if end != len(data):
        raise ValueError("trailing bytes after the pickle")


class _NoGlobals(pickle.Unpickler):
    """Refuses every global, so a state file can only ever produce plain builtin data."""

    def find_class(self, module: str, name: str) -> Any:
        raise _ForeignObject(f"{module}.{name}")

    def persistent_load(self, pid: Any) -> Any:
        raise _ForeignObject("a persistent id")


def state_path(path: str | Path | None = None) -> Path:
    """Where the state lives: explicit path, else ``$MONARCH_STATE``, else the nearest ``.monarch/``.

    The nearest ``.monarch/`` is found as git finds ``.git`` (see :func:`find_state_dir`),
    so every command works from any subdirectory of the directory that was served from;
    with none found it is ``.monarch/`` here, where ``serve`` makes a new one.
    """
    if path is not None and str(path) != "":
        return Path(path).expanduser()
    from_env = env.state
    if from_env:
        return Path(from_env).expanduser()
    found = find_state_dir()
    if found is None or found == Path(os.getcwd()) / DEFAULT_STATE_PATH.parent:
        return DEFAULT_STATE_PATH
    return found / DEFAULT_STATE_PATH.name


def find_state_dir(start: str | Path | None = None) -> Path | None:
    """The nearest ``.monarch`` directory at or above ``start`` (default: the current directory).

    The walk stops at a filesystem boundary and below ``$HOME`` (a ``~/.monarch`` is found
    only from ``$HOME`` itself, so one served there does not capture every project), and it
    skips a ``.monarch`` owned by another user: that user's agents would get our programs
    and environment.
    """
    try:
        here = Path(os.path.abspath(start if start is not None else os.getcwd()))
        device = here.stat().st_dev
    except OSError:
        return None
    try:
        home: Path | None = Path(os.path.abspath(Path.home()))
    except (KeyError, RuntimeError):  # no home directory for this uid
        home = None
    below_home = home is not None and home in here.parents
    for directory in (here, *here.parents):
        if below_home and directory == home:
            return None
        candidate = directory / DEFAULT_STATE_PATH.parent
        try:
            if directory.stat().st_dev != device:
                return None
        except OSError:
            return None
        try:
            info = candidate.stat()
        except OSError:
            continue
        if stat.S_ISDIR(info.st_mode) and info.st_uid == os.getuid():
            return candidate
    return None


def _check_plain(value: Any, where: str) -> None:
    """Refuse to save anything the restricted loader could not read back."""
    if type(value) not in _PLAIN:
        raise TypeError(
            f"job state field {where} holds a {type(value).__name__}; only builtin "
            "containers, str, bytes, numbers, bool and None can be saved"
        )
    if isinstance(value, dict):
        for key, item in value.items():
            _check_plain(key, f"{where} key")
            _check_plain(item, f"{where}[{key!r}]")
    elif isinstance(value, (list, tuple, set, frozenset)):
        for index, item in enumerate(value):
            _check_plain(item, f"{where}[{index}]")


def _encode(state: JobState) -> bytes:
    body = dataclasses.asdict(state)
    body["schema_version"] = SCHEMA_VERSION
    payload = {"magic": _MAGIC, "schema_version": SCHEMA_VERSION, "state": body}
    _check_plain(payload, "state")
    return pickle.dumps(payload, protocol=_PROTOCOL)


def save_state(state: JobState, path: Path | None = None) -> Path:
    """Write ``state`` atomically with mode 0600 and return the path written."""
    target = state_path(path)
    data = _encode(state)
    try:
        target.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        atomic_write(target, data, 0o600, durable=True)
    except OSError as err:
        raise StateError(
            f"cannot write job state to {target}: {err.strerror or err}; "
            f"check that the directory is writable, or set ${STATE_ENV} to another path"
        ) from err
    return target


def _corrupt(target: Path, why: str) -> StateError:
    return StateError(
        f"job state file {target} is corrupt ({why}); run `monarch stop --force` "
        "or delete the file, then start a new reservation with `monarch serve`"
    )


def _refuse_foreign(target: Path, st: os.stat_result) -> None:
    """A state file names the agents whose replies this client will read and holds the keys: one
    another user made, or can write, is refused (found through a Slurm job's work directory, a
    shared --state path...)."""
    if st.st_uid != os.geteuid():
        import pwd

        try:
            who = pwd.getpwuid(st.st_uid).pw_name
        except KeyError:
            who = f"uid {st.st_uid}"
        raise StateError(f"refusing job state file {target}: it belongs to {who}, not to you")
    if st.st_mode & 0o022:
        raise StateError(
            f"refusing job state file {target}: other users can write it (mode {stat.S_IMODE(st.st_mode):o}); "
            "delete it and serve again"
        )


def _read(target: Path) -> bytes:
    try:  # O_NONBLOCK: a FIFO (or device) put there must not hang the command; it is refused below
        fd = os.open(target, os.O_RDONLY | os.O_NONBLOCK)
        with open(fd, "rb") as handle:
            mode = os.fstat(fd).st_mode
            if stat.S_ISDIR(mode):
                raise IsADirectoryError
            if not stat.S_ISREG(mode):
                raise StateError(f"job state path {target} is not a regular file; point --state at a state file")
            _refuse_foreign(target, os.fstat(fd))
            os.set_blocking(fd, True)
            data = handle.read(_MAX_BYTES + 1)
    except FileNotFoundError:
        raise NoReservation(f"no reservation at {target}; start one with `monarch serve`") from None
    except IsADirectoryError:
        raise StateError(f"job state path {target} is a directory; point ${STATE_ENV} at a file") from None
    except OSError as err:
        raise StateError(f"cannot read job state file {target}: {err.strerror or err}; check its permissions") from err
    if len(data) > _MAX_BYTES:
        raise _corrupt(target, f"larger than {_MAX_BYTES} bytes")
    return data


def load_state(path: Path | None = None) -> JobState:
    """Read the state file; any bad content raises :class:`StateError`, never anything else."""
    target = state_path(path)
    data = _read(target)
    if not data:
        raise _corrupt(target, "empty file")
    try:
        _scan(data)
        payload = _NoGlobals(io.BytesIO(data)).load()
    except _ForeignObject as err:
        raise StateError(
            f"{target} is not a monarch job state file (it holds Python objects, not plain "
            f"data: {err}); pass the right path or delete it"
        ) from None
    except Exception as err:  # noqa: BLE001 - any decoding failure at all means the bytes are damaged
        raise _corrupt(target, f"{type(err).__name__}: {err}") from None
    if not isinstance(payload, dict) or payload.get("magic") != _MAGIC:
        raise StateError(f"{target} is not a monarch job state file; pass the right path or delete it")
    version = payload.get("schema_version")
    if type(version) is not int or version < 1:
        raise _corrupt(target, f"bad schema_version {version!r}")
    if version > SCHEMA_VERSION:
        raise StateError(
            f"job state file {target} was written by a newer monarch-cli "
            f"(schema {version} > {SCHEMA_VERSION}); upgrade monarch-cli"
        )
    try:
        return _decode(payload.get("state"))
    except _Malformed as err:
        raise _corrupt(target, str(err)) from None


class _Malformed(Exception):
    """The pickle decoded, but its content does not have the JobState shape."""


def _field(body: dict, name: str, kinds: tuple[type, ...], default: Any = ...) -> Any:
    if name not in body:
        if default is ...:
            raise _Malformed(f"missing field {name}")
        return default
    value = body[name]
    # bool is an int subclass; it is never a valid count, pid or timestamp here.
    if type(value) not in kinds:
        raise _Malformed(f"field {name} is a {type(value).__name__}")
    return value


def _decode(body: Any) -> JobState:
    """Rebuild a JobState from the plain dict, checking every field's type."""
    if not isinstance(body, dict):
        raise _Malformed("no state record")
    known = {f.name for f in dataclasses.fields(JobState)}
    extra = sorted(str(key) for key in body if key not in known)
    if extra:
        raise _Malformed(f"unknown fields {', '.join(extra)}")
    hosts = []
    for index, host in enumerate(_field(body, "hosts", (list,))):
        if not isinstance(host, dict) or set(host) != {"name", "agent", "pid", "node_rank"}:
            raise _Malformed(f"host record {index} is malformed")
        hosts.append(
            HostRecord(
                name=_field(host, "name", (str,)),
                agent=_field(host, "agent", (str,)),
                pid=_field(host, "pid", (int, type(None))),
                node_rank=_field(host, "node_rank", (int,)),
            )
        )
    command = _field(body, "default_command", (list,))
    if any(type(word) is not str for word in command):
        raise _Malformed("default_command holds a non-string")
    return JobState(
        scheduler=_field(body, "scheduler", (str,)),
        reservation_id=_field(body, "reservation_id", (str,)),
        hosts=hosts,
        keys=_field(body, "keys", (str,)),
        default_command=command,
        created_at=float(_field(body, "created_at", (float, int))),
        scheduler_data=_field(body, "scheduler_data", (dict,), {}),
        last_run=_field(body, "last_run", (dict, type(None)), None),
        default_cwd=_field(body, "default_cwd", (str, type(None)), None),
        schema_version=SCHEMA_VERSION,
    )


def clear_state(path: Path | None = None) -> None:
    """Delete the state file; a missing file is fine so `stop --force` always succeeds."""
    target = state_path(path)
    try:
        target.unlink()
    except FileNotFoundError:
        return
    except IsADirectoryError:
        raise StateError(f"job state path {target} is a directory; remove it by hand") from None
    except OSError as err:
        raise StateError(
            f"cannot delete job state file {target}: {err.strerror or err}; check its permissions"
        ) from err
