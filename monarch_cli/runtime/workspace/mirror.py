"""The host's side of workspace mirroring: a copy of one client workspace, and applying a change set to it.

Runs in each host's agent (:class:`Mirror`); the client's side is :mod:`.scan`.

* Deletions propagate only to what an earlier sync put there: files that ranks wrote into
  the mirror (checkpoints, logs) are left alone.
* Every file is written to a temporary file in its own directory and renamed into place,
  with the client's mode and mtime, so a rank never reads a half-written file.
"""

from __future__ import annotations

import os
import pickle
import shutil
import tempfile
from collections.abc import Iterable, Sequence

from ...sysutil import UnsafePath, atomic_write, check_private, loads_plain, private_dirs
from .manifest import Entry, FileUpdate, WorkspaceError, digest


class Mirror:
    """A host's copy of one client workspace, with the manifest of what syncs put there.

    The manifest (with each file's content hash) is kept in memory and in ``<dir>.manifest``,
    so an agent that restarts still knows what it mirrored.
    """

    def __init__(self, directory: str, root: str | None = None) -> None:
        """``root``: the directory below which every directory of the mirror must be ours (made 0700)."""
        self.dir = os.path.abspath(directory)
        self._state_file = self.dir.rstrip("/") + ".manifest"
        self.files: dict[str, tuple[Entry, str]] = {}
        self.digest = digest({})
        self._partial: dict[str, tuple[str, int]] = {}  # a big file's parts so far: (temporary file, size)
        try:  # a directory or manifest someone else made or can write is refused: it could plant files
            private_dirs(os.path.dirname(self.dir), root if root is not None else os.path.dirname(self.dir))
            check_private(self.dir, directory=True)
            has_manifest = check_private(self._state_file)
        except UnsafePath as e:
            raise WorkspaceError(f"workspace mirror: {e}") from None
        if not has_manifest:
            return
        try:  # plain data read with no globals: nothing in it can run code
            with open(self._state_file, "rb") as f:
                files, mirror_digest = loads_plain(f.read())
            if isinstance(files, dict) and isinstance(mirror_digest, str):
                self.files, self.digest = files, mirror_digest
        except (OSError, EOFError, pickle.UnpicklingError, ValueError, TypeError):
            pass

    def apply(self, updates: Sequence[FileUpdate], deleted: Iterable[str]) -> tuple[int, int]:
        """Delete, then write each update atomically; returns (files written, bytes written)."""
        os.makedirs(self.dir, mode=0o700, exist_ok=True)
        dirs_touched = set()
        for rel in sorted(deleted, reverse=True):
            path = self._path(rel)
            try:
                if os.path.isdir(path) and not os.path.islink(path):
                    shutil.rmtree(path)
                else:
                    os.unlink(path)
            except FileNotFoundError:
                pass
            self.files.pop(rel, None)
            dirs_touched.add(os.path.dirname(path))
        written = nbytes = 0
        for u in updates:
            path = self._path(u.path)
            parent = os.path.dirname(path)
            _make_dirs(parent, self.dir)
            if os.path.isdir(path) and not os.path.islink(path):
                shutil.rmtree(path)  # a directory became a file or a link
            if u.entry[3]:
                tmp = os.path.join(parent, f".{os.path.basename(path)}.monarch-{os.urandom(4).hex()}")
                os.symlink(u.entry[3], tmp)
                os.utime(tmp, ns=(u.entry[1], u.entry[1]), follow_symlinks=False)
                os.replace(tmp, path)
            elif u.data is None:
                try:
                    os.chmod(path, u.entry[2])
                    os.utime(path, ns=(u.entry[1], u.entry[1]))
                except FileNotFoundError:  # removed here since (by a rank): the next sync sends it again
                    self.files.pop(u.path, None)
                    continue
            else:
                if u.offset == 0:
                    self._drop_partial(u.path)
                    fd, tmp = tempfile.mkstemp(prefix=f".{os.path.basename(path)}.", suffix=".monarch", dir=parent)
                    os.close(fd)
                else:  # a later part of a big file: it goes on where the last part ended
                    tmp = self._partial.pop(u.path, ("", -1))[0]
                    if not tmp or os.path.getsize(tmp) != u.offset:
                        if tmp:
                            _unlink_quietly(tmp)
                        raise WorkspaceError(
                            f"part of {u.path} at {u.offset} came without what precedes it; sync again"
                        )
                try:
                    with open(tmp, "r+b") as f:
                        f.seek(u.offset)
                        f.write(u.data)
                    nbytes += len(u.data)
                    if u.more:
                        self._partial[u.path] = (tmp, u.offset + len(u.data))
                        continue
                    os.chmod(tmp, u.entry[2])
                    os.utime(tmp, ns=(u.entry[1], u.entry[1]))
                    os.replace(tmp, path)
                except BaseException:
                    _unlink_quietly(tmp)
                    raise
            written += 1
            self.files[u.path] = (u.entry, u.sha256)
        for d in sorted(dirs_touched, key=len, reverse=True):
            _prune_empty(d, self.dir)
        self.digest = digest({p: e for p, (e, _) in self.files.items()})
        atomic_write(self._state_file, pickle.dumps((self.files, self.digest), protocol=pickle.HIGHEST_PROTOCOL))
        return written, nbytes

    def _drop_partial(self, rel: str) -> None:
        tmp = self._partial.pop(rel, None)
        if tmp is not None:
            _unlink_quietly(tmp[0])

    def _path(self, rel: str) -> str:
        path = os.path.normpath(os.path.join(self.dir, rel))
        if not path.startswith(self.dir + os.sep) or os.path.isabs(rel):
            raise WorkspaceError(f"refusing to write outside the mirror: {rel!r}")
        return path

    def remove(self) -> None:
        shutil.rmtree(self.dir, ignore_errors=True)
        _unlink_quietly(self._state_file)


def _make_dirs(path: str, root: str) -> None:
    """Create ``path``'s missing directories, replacing a file or link that is in the way."""
    if os.path.isdir(path) and not os.path.islink(path):
        return
    if path != root:
        _make_dirs(os.path.dirname(path), root)
    if os.path.lexists(path):
        os.unlink(path)
    os.mkdir(path)


def _prune_empty(path: str, root: str) -> None:
    while path != root and path.startswith(root + os.sep):
        try:
            os.rmdir(path)
        except OSError:
            return
        path = os.path.dirname(path)


def _unlink_quietly(path: str) -> None:
    try:
        os.unlink(path)
    except OSError:
        pass
