"""Mirroring the client's workspace to the hosts that do not share its filesystem (client side).

First one small round trip per host: does it see the workspace directory itself (same path,
inode, size and mtime)? Hosts that do are left alone, and when all do nothing is scanned.
Otherwise the reply carries the mirror's digest; the scan is cached by ``stat`` in the job's
``.monarch/`` directory, so when nothing changed that is all. When something changed, a second
request fetches the host's manifest and a third carries the changed files (hashed first when
only their time differs) and the deletions. See docs/sync.md.
"""

from __future__ import annotations

import collections
import dataclasses
import os
import re
import time
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..config import env
from ..runtime import protocol
from ..runtime.mailbox.future import gather
from ..runtime.mailbox.mailbox import Mailbox
from ..runtime.protocol.sync import SyncApply, SyncCheck, SyncStatus
from ..runtime.transport import wire
from .errors import JobError
from .state import HostRecord

if TYPE_CHECKING:  # the scanner is imported where a host needs a mirror: a run on shared hosts needs none of it
    from ..runtime.workspace import Changes, Entry, FileUpdate, Manifest

    #: A host's manifest: each path's entry and content hash (None: a hash this client does not know).
    HostFiles = Mapping[str, tuple[Entry, str | None]]

_BATCH_BYTES = 16 << 20  # bytes per apply request (and per chunk of a bigger file)
_IN_FLIGHT = 3  # apply requests on their way at once: memory stays a few batches whatever the files


@dataclasses.dataclass
class SyncReport:
    """What one sync did. ``directories``: host index -> where that host's mirror is."""

    workspace: str
    files: int = 0
    nbytes: int = 0
    deleted: int = 0
    synced_hosts: int = 0
    shared_hosts: int = 0
    total_files: int = 0
    seconds: float = 0.0
    directories: dict[int, str] = dataclasses.field(default_factory=dict)
    outside_links: list[str] = dataclasses.field(default_factory=list)
    unreadable: list[str] = dataclasses.field(default_factory=list)  # relative; a directory ends in "/"

    @property
    def warnings(self) -> list[str]:
        """One line per path left out because this user cannot read it (the rest is synced)."""
        return [
            f"not synced: {os.path.join(self.workspace, p)} is an unreadable "
            f"{'directory' if p.endswith('/') else 'file'} (permission denied)"
            for p in self.unreadable
        ]

    @property
    def changed(self) -> bool:
        return bool(self.files or self.deleted)

    def __str__(self) -> str:
        ms = f"{self.seconds * 1000:.0f} ms"
        hosts = f"{self.synced_hosts} host{'s' if self.synced_hosts != 1 else ''}"
        if not self.synced_hosts:
            return f"no sync needed: all {self.shared_hosts} host(s) share this filesystem ({ms})"
        if not self.changed:
            text = f"workspace up to date on {hosts} ({self.total_files} files checked in {ms})"
        else:
            from ..runtime.workspace import human_bytes

            text = f"synced {self.files} file{'s' if self.files != 1 else ''}, {human_bytes(self.nbytes)}"
            if self.deleted:
                text += f", {self.deleted} deleted"
            text += f" to {hosts} in {ms}"
        if self.outside_links:
            text += f"; not synced (symlinks leaving the workspace): {', '.join(self.outside_links[:3])}"
            if len(self.outside_links) > 3:
                text += f" and {len(self.outside_links) - 3} more"
        return text

    def to_json(self) -> dict[str, Any]:
        return {**dataclasses.asdict(self), "seconds": round(self.seconds, 4), "message": str(self)}


def mirror_name(workspace: str) -> str:
    """One mirror per client workspace on each host: its basename plus a hash of its path."""
    base = re.sub(r"[^A-Za-z0-9._-]", "_", os.path.basename(workspace.rstrip("/")) or "root").lstrip(".-_") or "ws"
    try:  # hashlib's blake2b itself, without hashlib loading OpenSSL's hashes (~2 ms on every run)
        from _blake2 import blake2b
    except ImportError:  # not CPython
        from hashlib import blake2b
    return f"{base[:40]}-{blake2b(workspace.encode(), digest_size=4).hexdigest()}"


def sync_workspace(
    mb: Mailbox,
    hosts: Sequence[HostRecord],
    reservation: str,
    workspace: str,
    cache_dir: Path,
    *,
    max_bytes: int | None = None,
    timeout: float = 60.0,
) -> SyncReport:
    """Bring every host that does not share ``workspace`` up to date with it."""
    started = time.perf_counter()
    workspace = os.path.abspath(workspace)
    if not os.path.isdir(workspace):
        raise JobError(f"workspace {workspace} is not a directory")
    name = mirror_name(workspace)
    try:  # first: which hosts see this directory themselves (the same inode and mtime at the same path)?
        st = os.stat(workspace)
    except OSError as e:
        raise JobError(f"cannot read workspace {workspace}: {e.strerror}") from None
    probe = wire.dumps_data(SyncCheck(reservation, name, "", workspace, "", (st.st_ino, st.st_size, st.st_mtime_ns)))
    statuses: list[SyncStatus] = _gather(
        [mb.request(h.agent, lambda cid: protocol.SyncManifest(cid, mb.address), probe) for h in hosts], hosts, timeout
    )
    report = SyncReport(workspace)
    far = [i for i, s in enumerate(statuses) if not s.shared]
    report.shared_hosts = len(hosts) - len(far)
    report.synced_hosts = len(far)
    report.directories = {i: statuses[i].directory for i in far}
    if not far:  # nothing to mirror: no scan at all
        report.seconds = time.perf_counter() - started
        return report
    from ..runtime.workspace import WorkspaceError, check_size, load_scanner, save_scanner

    limit = max_bytes if max_bytes is not None else env.sync_max_bytes
    cache_file = cache_dir / "sync" / f"{name}.pkl"
    try:
        scanner = load_scanner(cache_file, workspace)
        scan, client_digest = scanner.manifest_and_digest()
        check_size(scan.manifest, limit, workspace)
    except WorkspaceError as e:
        raise JobError(str(e)) from None
    report.total_files, report.outside_links = len(scan.manifest), scan.outside_links
    report.unreadable = scan.unreadable
    stale = [i for i in far if statuses[i].digest != client_digest]
    synced = scanner.synced
    # the manifest this client last synced, without the hashes only a host knows
    known: dict[str, HostFiles] = {synced[0]: {p: (e, None) for p, e in synced[1].items()}} if synced else {}
    unknown = [i for i in stale if statuses[i].digest not in known]
    if unknown:  # hosts in a state this client did not leave them in: fetch their manifests
        ask = wire.dumps(SyncCheck(reservation, name, client_digest, workspace, "", (0, 0, 0)))
        got = _gather(
            [mb.request(hosts[i].agent, lambda cid: protocol.SyncManifest(cid, mb.address), ask) for i in unknown],
            [hosts[i] for i in unknown],
            timeout,
        )
        for i, status in zip(unknown, got):
            statuses[i] = status
    files: dict[int, HostFiles] = {}  # each stale host's manifest: as it sent it, else as this client left it
    for i in stale:
        host_files: HostFiles | None = statuses[i].files
        if host_files is None:
            host_files = known.get(statuses[i].digest)
        if host_files is not None:
            files[i] = host_files
    groups: dict[str, list[int]] = {}  # hosts in the same state share one plan (usually all of them)
    for i in stale:
        if statuses[i].digest != client_digest and i in files:
            groups.setdefault(statuses[i].digest, []).append(i)
    final: dict[int, str] = {}  # each host's digest after its last batch
    for base, group in groups.items():
        changes = _changes(scan.manifest, files[group[0]])
        report.files, report.deleted = (
            max(report.files, len(changes.changed)),
            max(report.deleted, len(changes.deleted)),
        )
        window: collections.deque[list[Any]] = collections.deque()  # batches in flight, oldest first
        sent = 0
        for j, batch in enumerate(_batches(scanner, changes.changed)):
            sent += sum(len(u.data) for u in batch if u.data is not None)
            body = wire.dumps(
                SyncApply(reservation, name, batch, changes.deleted if j == 0 else [], base if j == 0 else "")
            )
            window.append(
                [
                    mb.request(hosts[i].agent, lambda cid: protocol.SyncApplyRequest(cid, mb.address), body)
                    for i in group
                ]
            )
            del body, batch
            if len(window) >= _IN_FLIGHT:  # bounded memory: a few batches on their way, whatever the files' size
                _settle(window.popleft(), group, hosts, timeout, final)
        while window:
            _settle(window.popleft(), group, hosts, timeout, final)
        report.nbytes = max(report.nbytes, sent)
    if final and all(d == client_digest for d in final.values()):  # the next change is diffed here, not fetched
        scanner.synced = (client_digest, scan.manifest)
        scanner.dirty = True
    if scanner.dirty:
        try:
            save_scanner(scanner, cache_file)
        except OSError:
            pass  # only the cache: the next sync scans afresh
    report.seconds = time.perf_counter() - started
    return report


def _changes(manifest: Manifest, host_files: HostFiles) -> Changes:
    from ..runtime.workspace import diff

    return diff(manifest, host_files)


def _batches(scanner: Any, changed: list[Any]) -> Iterator[list[FileUpdate]]:
    """The updates to send, read as they are sent: batches of at most ~_BATCH_BYTES, a big file in
    chunks (so neither side ever holds a whole big file)."""
    from ..runtime.workspace import WorkspaceError

    batch: list[FileUpdate] = []
    size = 0
    try:
        for path, entry, host_entry, host_sha in changed:
            try:
                updates = scanner.updates_for(path, entry, host_sha, host_entry, _BATCH_BYTES)
                for update in updates:
                    n = len(update.data) if update.data is not None else 0
                    if batch and size + n > _BATCH_BYTES:
                        yield batch
                        batch, size = [], 0
                    batch.append(update)
                    size += n
            except FileNotFoundError:
                continue  # deleted since the scan: the next sync deletes it there too
            except PermissionError:
                raise JobError(f"cannot read {os.path.join(scanner.root, path)}: permission denied") from None
    except WorkspaceError as e:
        raise JobError(str(e)) from None
    yield batch


def _settle(
    futures: list[Any], group: list[int], hosts: Sequence[HostRecord], timeout: float, final: dict[int, str]
) -> None:
    applied = _gather(futures, [hosts[i] for i in group], timeout)
    for i, a in zip(group, applied):
        final[i] = a.digest


def _gather(futures: list[Any], hosts: Sequence[HostRecord], timeout: float) -> list[Any]:
    try:
        return gather(futures).get(timeout=timeout)
    except Exception as e:  # noqa: BLE001 - name the host that failed, in one line
        for h, f in zip(hosts, futures):
            if f.done():
                try:
                    f.get(timeout=0)
                except Exception as one:  # noqa: BLE001
                    raise JobError(f"workspace sync to {h.name} failed: {str(one).splitlines()[0]}") from None
        raise JobError(
            f"workspace sync did not finish within {timeout:.0f} s: {str(e).splitlines()[0] if str(e) else type(e).__name__}"
        ) from None
