"""The bodies of workspace-sync messages (``sync_manifest``, ``sync_apply``: see :mod:`.to_agent`),
pickled beside their headers. Here rather than beside the agent's code that answers them, so
a client checking a workspace loads neither that code nor the workspace scanner."""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from ..workspace import Entry, FileUpdate

__all__ = ["SyncCheck", "SyncStatus", "SyncApply", "SyncApplied"]


@dataclasses.dataclass
class SyncCheck:
    """Client -> host: which mirror, the client's digest, and the probe for a shared filesystem."""

    reservation: str
    name: str
    digest: str  # "" asks only whether the workspace is shared, and the mirror's digest
    workspace: str  # the client's absolute workspace path
    probe: str  # a file of the workspace (relative; "" for the directory itself) ...
    probe_stat: tuple[int, int, int]  # ... and its (inode, size, mtime_ns) as the client sees it


@dataclasses.dataclass
class SyncStatus:
    """Host -> client: ``files`` is the mirror's manifest (with hashes), sent only when digests differ."""

    shared: bool
    directory: str
    digest: str
    files: dict[str, tuple[Entry, str]] | None


@dataclasses.dataclass
class SyncApply:
    reservation: str
    name: str
    updates: list[FileUpdate]
    deleted: list[str]
    base: str  # the mirror digest these changes were computed against ("" for a later batch)


@dataclasses.dataclass
class SyncApplied:
    written: int
    nbytes: int
    digest: str
