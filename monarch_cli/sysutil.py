"""Small OS helpers every layer shares: atomic file writes, signalling, route probes."""

from __future__ import annotations

import io
import os
import pickle
import select
import shutil
import stat
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from .config import EnvSettings, env

__all__ = [
    "CACHE_ENV",
    "UnsafePath",
    "atomic_write",
    "cache_dir",
    "check_private",
    "loads_plain",
    "private_dirs",
    "private_tmpdir",
    "signal_if_alive",
    "source_address_towards",
]


def atomic_write(path: str | Path, data: str | bytes, mode: int = 0o600, *, durable: bool = False) -> Path:
    """Write ``data`` to ``path`` through a temporary file and a rename.

    Readers see the old file or the whole new one, never half of it, and the file has
    ``mode`` from its first byte (mkstemp creates it 0600), so a secret is never readable
    by others, not even for a moment. ``durable`` also fsyncs the file and its directory.
    """
    target = Path(path)
    raw = data.encode() if isinstance(data, str) else data
    fd, tmp = tempfile.mkstemp(prefix=f".{target.name}.", suffix=".tmp", dir=target.parent)
    try:
        try:
            os.fchmod(fd, mode)
            with os.fdopen(fd, "wb", closefd=False) as handle:
                handle.write(raw)
                handle.flush()
                if durable:
                    os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, target)
        tmp = ""
    finally:
        if tmp:
            try:
                os.unlink(tmp)
            except OSError:
                pass
    if durable:
        try:
            dfd = os.open(target.parent, os.O_RDONLY)
        except OSError:
            return target
        try:
            os.fsync(dfd)
        except OSError:
            pass  # some filesystems refuse it: best effort
        finally:
            os.close(dfd)
    return target


def signal_if_alive(pid: int, sig: int) -> bool:
    """Send ``sig`` to ``pid`` if it still exists (and is ours to signal); True if sent."""
    try:
        os.kill(pid, sig)
        return True
    except (ProcessLookupError, PermissionError):
        return False


def ready_fds(
    read: Sequence[Any], write: Sequence[Any] = (), timeout: float | None = None
) -> tuple[list[Any], list[Any]]:
    """``select.select`` for reading and writing, through ``poll``: the objects (fds, or anything
    with ``fileno()``) ready now or within ``timeout`` seconds (None: wait).

    ``select`` refuses any fd numbered 1024 or more, which an agent with a few hundred ranks'
    pipes open, or a client linked to thousands of hosts, reaches; ``poll`` has no such limit.
    """
    poller = select.poll()
    fileno: dict[Any, int] = {}
    for obj in read:
        fileno[obj] = obj if isinstance(obj, int) else obj.fileno()
        poller.register(fileno[obj], select.POLLIN)
    for obj in write:
        fd = obj if isinstance(obj, int) else obj.fileno()
        fileno[obj] = fd
        poller.register(fd, select.POLLOUT | (select.POLLIN if obj in read else 0))
    events = dict(poller.poll(None if timeout is None else max(0, int(timeout * 1000))))
    readable = [o for o in read if events.get(fileno[o], 0) & (select.POLLIN | select.POLLHUP | select.POLLERR)]
    writable = [o for o in write if events.get(fileno[o], 0) & (select.POLLOUT | select.POLLHUP | select.POLLERR)]
    return readable, writable


def source_address_towards(host: str) -> str | None:
    """This machine's address on the route towards ``host`` (a UDP connect sends nothing).

    None when ``host`` cannot be resolved or no route leads there.
    """
    import socket  # here: a run-spmd whose controller address is fine never loads it (~2 ms)

    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
            probe.connect((socket.gethostbyname(host), 9))
            return str(probe.getsockname()[0])
    except OSError:
        return None


def private_tmpdir(kind: str) -> str:
    """A new 0700 directory ``monarch-<kind>-<pid>-*`` in the temp dir, for this process's life.

    A process killed with SIGKILL cannot remove its own; so each new one first removes this
    user's directories of the same kind whose process is gone (the pid in the name).
    """
    import glob  # rarely needed: not at import

    base = tempfile.gettempdir()
    for old in glob.glob(os.path.join(base, f"monarch-{kind}-*-*")):
        try:
            pid = int(os.path.basename(old).split("-")[2])
            if os.stat(old).st_uid != os.getuid() or _alive(pid):
                continue
        except (ValueError, IndexError, OSError):
            continue
        shutil.rmtree(old, ignore_errors=True)
    return tempfile.mkdtemp(prefix=f"monarch-{kind}-{os.getpid()}-", dir=base)


def _alive(pid: int) -> bool:
    """Running or sleeping: a zombie (dead, not yet reaped by its parent) counts as gone."""
    if not os.path.isdir("/proc"):
        return True  # cannot tell: never remove another process's files
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return f.read().rsplit(b")", 1)[1].split()[0] != b"Z"
    except (OSError, IndexError):
        return False


#: Where monarch-cli keeps what it learns or builds on a machine (warm-process learning, bundles).
CACHE_ENV = EnvSettings.cache_dir.var


def cache_dir() -> str:
    """``$MONARCH_CACHE_DIR``, else ``$XDG_CACHE_HOME/monarch-cli``, else ``~/.cache/monarch-cli``."""
    explicit = env.cache_dir
    if explicit:
        return explicit
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "monarch-cli")


class UnsafePath(PermissionError):
    """A file or directory another user created or can write: using it would hand them our data or code."""

    def __str__(self) -> str:
        return str(self.args[0]) if self.args else "unsafe path"


def _who(uid: int) -> str:
    try:
        import pwd

        return f"{pwd.getpwuid(uid).pw_name} (uid {uid})"
    except (KeyError, ImportError):
        return f"uid {uid}"


def check_private(path: str | Path, *, directory: bool = False) -> bool:
    """Refuse ``path`` unless it is ours and nobody else can write it; False if it does not exist.

    A symlink is refused too (it could lead anywhere). The message is one line naming the path,
    its owner or who can write it, and what to do.
    """
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return False
    kind = "directory" if directory else "file"
    wanted = stat.S_ISDIR if directory else stat.S_ISREG
    if not wanted(st.st_mode):
        raise UnsafePath(f"refusing {path}: not a regular {kind} (a link or something else); remove it")
    if st.st_uid != os.geteuid():
        raise UnsafePath(
            f"refusing {path}: it was created by {_who(st.st_uid)}, not by you ({_who(os.geteuid())}); "
            f"remove it or use another directory"
        )
    if st.st_mode & 0o022:
        raise UnsafePath(f"refusing {path}: other users can write it (mode {stat.S_IMODE(st.st_mode):o}); remove it")
    return True


def private_dirs(path: str | Path, root: str | Path) -> None:
    """Make ``path`` and its missing parents below ``root`` (mode 0700), refusing any that is not ours.

    ``root`` itself may be shared only the way ``/tmp`` is: owned by us or by root, and sticky
    if others can write it (nobody else can then rename what we put there).
    """
    root_s, path_s = os.path.abspath(root), os.path.abspath(path)
    if path_s != root_s and not path_s.startswith(root_s.rstrip(os.sep) + os.sep):
        raise ValueError(f"{path} is not below {root}")
    os.makedirs(root_s, mode=0o700, exist_ok=True)
    st = os.stat(root_s)
    if st.st_uid not in (os.geteuid(), 0) or (st.st_mode & 0o022 and not st.st_mode & stat.S_ISVTX):
        raise UnsafePath(
            f"refusing {root_s}: {_who(st.st_uid)} owns it and others can change what is in it; use a private directory"
        )
    current = root_s
    for part in os.path.relpath(path_s, root_s).split(os.sep):
        if part in ("", "."):
            continue
        current = os.path.join(current, part)
        try:
            os.mkdir(current, 0o700)
        except FileExistsError:
            pass
        check_private(current, directory=True)


class _NoGlobals(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        raise pickle.UnpicklingError(f"refusing to load {module}.{name}: only plain data is read back from disk")

    def persistent_load(self, pid: Any) -> Any:
        raise pickle.UnpicklingError("refusing a persistent id: only plain data is read back from disk")


def loads_plain(data: bytes) -> Any:
    """Unpickle builtin data only (no globals, so no code can run), for caches we read back from disk."""
    return _NoGlobals(io.BytesIO(data)).load()
