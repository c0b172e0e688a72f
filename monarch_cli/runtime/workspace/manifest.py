"""The manifest both sides of a workspace sync compare, and the update a host applies.

A manifest maps a workspace-relative POSIX path to an :data:`Entry` (size, mtime in ns, mode
bits, symlink target); the client (:mod:`.scan`) and each host (:mod:`.mirror`) digest it the
same way, so "nothing changed" is one digest compared per host.
"""

from __future__ import annotations

import hashlib
from typing import NamedTuple

from ..errors import MonarchError


class WorkspaceError(MonarchError):
    """The workspace cannot be mirrored as it is (too big, unreadable); the message says why."""


#: One mirrored path: (size, mtime_ns, mode bits, symlink target or ""). A plain tuple, not a
#: NamedTuple: manifests of thousands of entries are pickled on every sync, and a NamedTuple
#: costs a Python call per entry to pickle.
Entry = tuple[int, int, int, str]


Manifest = dict[str, Entry]


class FileUpdate(NamedTuple):
    """A path to (re)write on a host: ``data`` None means only mode/mtime changed (content equal).

    A big file travels as several updates: ``data`` is the part at ``offset`` and ``more`` says
    that parts follow (the file takes its place with the last one, which carries the hash)."""

    path: str
    entry: Entry
    sha256: str
    data: bytes | None
    offset: int = 0
    more: bool = False


def digest(manifest: Manifest) -> str:
    """The same on both sides for equal manifests; what a no-change check compares."""
    h = hashlib.blake2b(digest_size=16)
    for path in sorted(manifest):
        e = manifest[path]
        h.update(f"{path}\0{e[0]}\0{e[1]}\0{e[2]}\0{e[3]}\n".encode("utf-8", "surrogateescape"))
    return h.hexdigest()
