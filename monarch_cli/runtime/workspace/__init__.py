"""Workspace mirroring: the client scans its workspace (:mod:`.scan`), each host keeps a mirror (:mod:`.mirror`).

Both sides compare the manifest of :mod:`.manifest`: a workspace-relative POSIX path to an
:data:`Entry` (size, mtime in ns, mode bits, symlink target), digested the same way on each side,
so "nothing changed" is one digest compared per host. Callers import from here.
"""

from __future__ import annotations

from .manifest import Entry, FileUpdate, Manifest, WorkspaceError, digest
from .mirror import Mirror
from .scan import (
    DEFAULT_MAX_BYTES,
    IGNORE_FILES,
    SKIPPED_NAMES,
    Changes,
    Scanner,
    ScanResult,
    check_size,
    diff,
    human_bytes,
    load_scanner,
    save_scanner,
)

__all__ = [
    "DEFAULT_MAX_BYTES",
    "IGNORE_FILES",
    "SKIPPED_NAMES",
    "Changes",
    "Entry",
    "FileUpdate",
    "Manifest",
    "Mirror",
    "ScanResult",
    "Scanner",
    "WorkspaceError",
    "check_size",
    "diff",
    "digest",
    "human_bytes",
    "load_scanner",
    "save_scanner",
]
