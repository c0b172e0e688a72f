"""Small OS helpers every layer shares: atomic file writes, signalling, route probes."""

from __future__ import annotations

import glob
import os
import shutil
import socket
import tempfile
from pathlib import Path

__all__ = ["CACHE_ENV", "atomic_write", "cache_dir", "private_tmpdir", "signal_if_alive", "source_address_towards"]


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


def source_address_towards(host: str) -> str | None:
    """This machine's address on the route towards ``host`` (a UDP connect sends nothing).

    None when ``host`` cannot be resolved or no route leads there.
    """
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
CACHE_ENV = "MONARCH_CACHE_DIR"


def cache_dir() -> str:
    """``$MONARCH_CACHE_DIR``, else ``$XDG_CACHE_HOME/monarch-cli``, else ``~/.cache/monarch-cli``."""
    explicit = os.environ.get(CACHE_ENV)
    if explicit:
        return explicit
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "monarch-cli")
