"""Whether a file a warm process loaded has changed, without a ``stat`` of every one per run
(runs in the agent).

A run must not fork from a warm process whose loaded files changed since (its ranks would run
the old code), and a warm process holding torch, transformers and Lightning loaded ~4,000
files: a ``stat`` of each took ~12 ms of every run. Here the directories holding them are
watched with inotify (Linux), so a run reads the events since the last one and looks only at
the files they name, plus one ``stat`` per directory (still the directory watched? one renamed
or replaced above it sends no event here), ~10 times fewer calls.

inotify is trusted only where it sees every change: a file on a network, FUSE or cluster file
system (another host's write sends no event here), one reached through a symlink (the link may
be pointed elsewhere), or one past the watch limit (``fs.inotify.max_user_watches``) is
looked at with a ``stat`` at every run, as before. Without inotify every file is.
"""

from __future__ import annotations

import ctypes
import os
import re
import struct
from collections.abc import Iterable, Mapping
from typing import Any

# <sys/inotify.h>
_IN_MODIFY, _IN_ATTRIB, _IN_CLOSE_WRITE = 0x2, 0x4, 0x8
_IN_MOVED_FROM, _IN_MOVED_TO, _IN_CREATE, _IN_DELETE = 0x40, 0x80, 0x100, 0x200
_IN_DELETE_SELF, _IN_MOVE_SELF, _IN_UNMOUNT, _IN_Q_OVERFLOW, _IN_IGNORED = 0x400, 0x800, 0x2000, 0x4000, 0x8000
_IN_ONLYDIR = 0x01000000
_IN_NONBLOCK, _IN_CLOEXEC = os.O_NONBLOCK, 0o2000000
_WATCHED = (
    _IN_MODIFY
    | _IN_ATTRIB
    | _IN_CLOSE_WRITE
    | _IN_MOVED_FROM
    | _IN_MOVED_TO
    | _IN_CREATE
    | _IN_DELETE
    | _IN_DELETE_SELF
    | _IN_MOVE_SELF
    | _IN_ONLYDIR
)
_DIR_GONE = _IN_DELETE_SELF | _IN_MOVE_SELF | _IN_UNMOUNT | _IN_IGNORED
_EVENT = struct.Struct("iIII")  # wd, mask, cookie, len; then len bytes of name

#: File systems whose every change, made anywhere, reaches this host's inotify.
LOCAL_FILE_SYSTEMS = frozenset(
    {
        "ext2",
        "ext3",
        "ext4",
        "xfs",
        "btrfs",
        "f2fs",
        "jfs",
        "reiserfs",
        "bcachefs",
        "zfs",
        "tmpfs",
        "ramfs",
        "overlay",
        "squashfs",
        "iso9660",
        "vfat",
        "exfat",
    }
)


class FileWatch:
    """The files of one warm process and their recorded ``(st_mtime_ns, st_size)``."""

    def __init__(self, files: Mapping[str, Any]) -> None:
        self._files = {path: (int(rec[0]), int(rec[1])) for path, rec in files.items()}
        self._dirty: set[str] = set()  # named by an event since the last check
        self._always: set[str] = set()  # inotify cannot vouch for these: a stat at every check
        self._dirs: dict[int, tuple[str, tuple[int, int], dict[str, str]]] = {}  # wd -> (dir, (dev, ino), name -> path)
        self._fd = _inotify_init()
        self._changed = self._start()  # a change before the watches were set is found now

    def changed(self) -> str | None:
        """A file that changed since it was loaded (or cannot be found), or None."""
        if self._changed is None:
            self._read_events()
            self._check_dirs()
            self._changed = _first_changed(self._dirty | self._always, self._files)
            self._dirty.clear()
        return self._changed

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None

    # ----------------------------------------------------------------------
    def _start(self) -> str | None:
        by_dir: dict[str, dict[str, str]] = {}
        for path in self._files:
            by_dir.setdefault(os.path.dirname(path), {})[os.path.basename(path)] = path
        fstypes = _mount_types() if self._fd is not None else []
        for directory, names in by_dir.items():
            wd = self._watch(directory, fstypes)
            if wd is None:
                self._always.update(names.values())
                continue
            self._always.update(path for path in names.values() if os.path.islink(path))
            self._dirs[wd] = (directory, _identity(directory), names)
        return _first_changed(self._files, self._files)

    def _watch(self, directory: str, fstypes: list[tuple[str, str]]) -> int | None:
        if self._fd is None or os.path.realpath(directory) != directory:
            return None
        if _fstype(directory, fstypes) not in LOCAL_FILE_SYSTEMS:
            return None
        wd = _LIBC.inotify_add_watch(self._fd, os.fsencode(directory), _WATCHED) if _LIBC else -1
        return wd if wd >= 0 else None

    def _read_events(self) -> None:
        if self._fd is None:
            return
        while True:
            try:
                data = os.read(self._fd, 1 << 16)
            except BlockingIOError:
                return
            except OSError:
                data = b""
            if not data:
                return
            offset = 0
            while offset + _EVENT.size <= len(data):
                wd, mask, _, length = _EVENT.unpack_from(data, offset)
                name = data[offset + _EVENT.size : offset + _EVENT.size + length].rstrip(b"\0")
                offset += _EVENT.size + length
                if mask & _IN_Q_OVERFLOW:  # events were lost: look at everything once
                    self._dirty.update(self._files)
                elif mask & _DIR_GONE:
                    self._give_up(wd)
                elif wd in self._dirs:
                    path = self._dirs[wd][2].get(os.fsdecode(name))
                    if path is not None:
                        self._dirty.add(path)

    def _check_dirs(self) -> None:
        for wd, (directory, identity, _) in list(self._dirs.items()):
            if _identity(directory) != identity:  # renamed or replaced above it: no event came
                self._give_up(wd)

    def _give_up(self, wd: int) -> None:
        """This directory's files are no longer vouched for by events: a stat each, from now on."""
        entry = self._dirs.pop(wd, None)
        if entry is not None:
            self._always.update(entry[2].values())


def _first_changed(paths: Iterable[str], files: Mapping[str, tuple[int, int]]) -> str | None:
    for path in paths:
        try:
            st = os.stat(path)
        except OSError:
            return path
        if (st.st_mtime_ns, st.st_size) != files[path]:
            return path
    return None


def _identity(path: str) -> tuple[int, int]:
    try:
        st = os.stat(path)
    except OSError:
        return (-1, -1)
    return (st.st_dev, st.st_ino)


def _load_libc() -> Any:
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.inotify_init1.argtypes = [ctypes.c_int]
        libc.inotify_add_watch.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_uint32]
        return libc
    except (OSError, AttributeError):  # not Linux
        return None


_LIBC = _load_libc()


def _inotify_init() -> int | None:
    if _LIBC is None:
        return None
    fd = _LIBC.inotify_init1(_IN_NONBLOCK | _IN_CLOEXEC)
    return fd if fd >= 0 else None  # EMFILE: fs.inotify.max_user_instances reached


def _mount_types() -> list[tuple[str, str]]:
    """(mount point, file system type) of this process's mounts, longest mount point first."""
    mounts: list[tuple[str, str]] = []
    try:
        with open("/proc/self/mountinfo") as f:
            for line in f:
                fields = line.split()
                if "-" not in fields:
                    continue
                point = os.fsdecode(re.sub(rb"\\([0-7]{3})", _unescape, os.fsencode(fields[4])))  # " " is \040
                mounts.append((point, fields[fields.index("-") + 1]))
    except OSError:
        return []
    mounts.sort(key=lambda m: len(m[0]), reverse=True)
    return mounts


def _unescape(m: re.Match[bytes]) -> bytes:
    return bytes([int(m.group(1), 8)])


def _fstype(path: str, mounts: list[tuple[str, str]]) -> str:
    for point, fstype in mounts:
        if path == point or path.startswith(point.rstrip("/") + "/"):
            return fstype
    return ""
