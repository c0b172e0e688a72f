"""The client's side of workspace mirroring: scanning the workspace into a manifest, and what a host lacks.

Runs on the client (:class:`Scanner`, :func:`diff`); the host's side is :mod:`.mirror`. Only
regular files and symlinks are mirrored; directories follow them.

Decisions a user can notice (docs/sync.md):

* Skipped always: ``.git``, ``.monarch``, ``__pycache__``, any directory holding a
  ``pyvenv.cfg`` (a virtualenv), sockets, fifos and devices. ``.gitignore`` files (nested,
  git's precedence: the deepest file with a matching pattern decides) and ``.monarchignore``
  files (same syntax, same places) are honoured.
* A symlink whose target stays inside the workspace is mirrored as that symlink (an absolute
  one as the relative link to the same file, so it leads into the mirror on the host). One that
  points outside (or dangles outside) is not mirrored and is reported: following it could
  copy unbounded data or secrets (``~/.ssh``), and recreating it would point at whatever that
  path is on the host.
"""

from __future__ import annotations

import errno
import hashlib
import os
import pickle
import stat
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any, NamedTuple

from ...config import EnvSettings
from ...sysutil import UnsafePath, atomic_write, check_private, loads_plain
from .manifest import Entry, FileUpdate, Manifest, WorkspaceError, digest

SKIPPED_NAMES = frozenset({".git", ".monarch", "__pycache__"})
IGNORE_FILES = (".gitignore", ".monarchignore")
DEFAULT_MAX_BYTES: int = EnvSettings.sync_max_bytes.default  # 1 GiB: past that, a workspace is data, not code


class _Rules:
    """The ignore files in effect for one directory: (base, spec) pairs, outermost first."""

    def __init__(self, chain: tuple[tuple[str, object], ...]) -> None:
        self.chain = chain

    def ignored(self, rel: str, is_dir: bool) -> bool:
        for base, spec in reversed(self.chain):  # the deepest file that has an opinion decides
            sub = rel[len(base) + 1 :] if base else rel
            result = spec.check_file(sub + "/" if is_dir else sub)  # type: ignore[attr-defined]
            if result.include is not None:
                return bool(result.include)
        return False


def _load_spec(path: str) -> object | None:
    import pathspec  # gitignore semantics (negation, anchoring, **) done right

    try:
        with open(path, encoding="utf-8", errors="surrogateescape") as f:
            return pathspec.GitIgnoreSpec.from_lines(f)
    except OSError:
        return None


class _DirListing(NamedTuple):
    mtime_ns: int
    rules_key: tuple[tuple[str, int, int], ...]  # (ignore file, size, mtime) in effect
    files: tuple[str, ...]  # regular files and symlinks kept, by name
    paths: tuple[str, ...]  # the same, relative to the workspace (built once, not per scan)
    dirs: tuple[str, ...]  # subdirectories descended into, by name


class ScanResult(NamedTuple):
    manifest: Manifest
    outside_links: list[str]  # symlinks not mirrored because they leave the workspace
    unreadable: list[str] = []  # files and directories (``dir/``) not mirrored: permission denied


class Scanner:
    """Scans one workspace, remembering per directory what its ignore rules kept.

    A directory whose mtime and ignore files are unchanged is not listed or matched again:
    a no-change scan costs one ``stat`` per directory and one ``lstat`` per file. Pickle it
    (see :func:`load_scanner`) to keep that across processes.
    """

    version = 6  # 6: absolute links inside the workspace are kept relative

    def __init__(self, root: str) -> None:
        self.root = os.path.abspath(root)
        self.dirs: dict[str, _DirListing] = {}
        self.entries: dict[str, tuple[int, int, int, int, Entry]] = {}  # rel -> (ino, mtime, size, st_mode, entry)
        self._unchanged = False  # the last scan found exactly the manifest before it
        self.hashes: dict[str, tuple[Entry, str]] = {}  # rel -> (entry it was hashed at, sha256)
        self.last_digest: str | None = None  # the digest of the last scan's manifest
        self.dirty = True  # something worth saving changed since the last save
        self.synced: tuple[str, Manifest] | None = None  # the digest and manifest last pushed to hosts

    def to_data(self) -> dict[str, object]:
        """Builtins only: what :func:`save_scanner` writes (read back with no globals)."""
        return {
            "version": self.version,
            "root": self.root,
            "dirs": {rel: tuple(listing) for rel, listing in self.dirs.items()},
            "entries": self.entries,
            "unchanged": self._unchanged,
            "hashes": self.hashes,
            "last_digest": self.last_digest,
            "synced": self.synced,
        }

    @classmethod
    def from_data(cls, data: dict[str, Any]) -> Scanner:
        if not isinstance(data, dict) or data.get("version") != cls.version:
            raise ValueError("not a scan cache of this version")
        scanner = cls(str(data["root"]))
        scanner.dirs = {str(rel): _DirListing(*listing) for rel, listing in data["dirs"].items()}
        scanner.entries = dict(data["entries"])
        scanner._unchanged = bool(data["unchanged"])
        scanner.hashes = dict(data["hashes"])
        scanner.last_digest = data["last_digest"]
        scanner.synced = tuple(data["synced"]) if data["synced"] is not None else None  # type: ignore[assignment]
        scanner.dirty = False
        return scanner

    def scan(self) -> ScanResult:
        manifest: Manifest = {}
        outside: list[str] = []
        unreadable: list[str] = []
        seen_dirs: dict[str, _DirListing] = {}
        entries: dict[str, tuple[int, int, int, int, Entry]] = {}
        old = self.entries
        specs: dict[str, object] = {}
        stack: list[tuple[str, tuple[tuple[str, str, int, int], ...]]] = [("", ())]
        root = self.root
        changed = False
        lstat, S_ISREG, S_ISLNK, S_IMODE = os.lstat, stat.S_ISREG, stat.S_ISLNK, stat.S_IMODE
        while stack:
            rel, inherited = stack.pop()
            absdir = os.path.join(root, rel) if rel else root
            try:
                fd = os.open(absdir, os.O_RDONLY | os.O_DIRECTORY)
            except OSError as e:
                changed = True
                if e.errno in (errno.EACCES, errno.EPERM):
                    unreadable.append(rel + "/")
                continue
            try:  # stat names relative to the directory: no path walk per file
                dir_mtime = os.fstat(fd).st_mtime_ns
                chain = list(inherited)
                for name in IGNORE_FILES:
                    try:
                        st = os.stat(name, dir_fd=fd)
                    except OSError:
                        continue
                    chain.append((rel, os.path.join(absdir, name), st.st_size, st.st_mtime_ns))
                key = tuple((p, sz, m) for _, p, sz, m in chain)
                listing = self.dirs.get(rel)
                if listing is None or listing.mtime_ns != dir_mtime or listing.rules_key != key:
                    rules = _Rules(
                        tuple((b, sp) for b, p, _, _ in chain if (sp := specs.get(p) or _cache_spec(specs, p)))
                    )
                    self.dirty = changed = True
                    try:
                        listing = self._list(rel, absdir, dir_mtime, key, rules)
                    except PermissionError:
                        unreadable.append(rel + "/")
                        continue
                seen_dirs[rel] = listing
                prefix = rel + "/" if rel else ""
                for name, r in zip(listing.files, listing.paths):
                    try:
                        st = lstat(name, dir_fd=fd)
                    except OSError:
                        changed = True
                        continue
                    known = old.get(r)
                    if (
                        known is not None
                        and known[1] == st.st_mtime_ns
                        and known[0] == st.st_ino
                        and known[2] == st.st_size
                        and known[3] == st.st_mode
                    ):
                        entries[r] = known  # the common case: nothing new to build
                        manifest[r] = known[4]
                        continue
                    else:
                        changed = True
                        if S_ISLNK(st.st_mode):
                            target = os.readlink(name, dir_fd=fd)
                            if not _inside(root, absdir, target):
                                outside.append(f"{r} -> {target}")
                                continue
                            if os.path.isabs(target):  # the mirror is elsewhere: lead to the same file there
                                target = os.path.relpath(os.path.normpath(target), absdir)
                            entry = (0, st.st_mtime_ns, 0, target)
                        elif S_ISREG(st.st_mode):
                            if not os.access(name, os.R_OK, dir_fd=fd, effective_ids=True):
                                unreadable.append(r)  # not kept: asked again next scan
                                continue
                            entry = (st.st_size, st.st_mtime_ns, S_IMODE(st.st_mode), "")
                        else:
                            continue
                    entries[r] = (st.st_ino, st.st_mtime_ns, st.st_size, st.st_mode, entry)
                    manifest[r] = entry
            finally:
                os.close(fd)
            for name in listing.dirs:
                stack.append((prefix + name, tuple(chain)))
        if len(entries) != len(old):
            changed = True
        self.dirs = seen_dirs
        self.entries = entries
        self._unchanged = not changed
        return ScanResult(manifest, outside, sorted(unreadable))

    def _list(
        self, rel: str, absdir: str, mtime_ns: int, key: tuple[tuple[str, int, int], ...], rules: _Rules
    ) -> _DirListing:
        files: list[str] = []
        dirs: list[str] = []
        prefix = rel + "/" if rel else ""
        try:
            it = list(os.scandir(absdir))
        except PermissionError:
            raise
        except OSError as e:
            raise WorkspaceError(f"cannot read {absdir}: {e.strerror}") from None
        for d in it:
            name = d.name
            if name in SKIPPED_NAMES:
                continue
            try:
                is_dir = d.is_dir(follow_symlinks=False)
            except OSError:
                continue
            if rules.ignored(prefix + name, is_dir):
                continue
            if is_dir:
                if not os.path.exists(os.path.join(d.path, "pyvenv.cfg")):
                    dirs.append(name)
            elif d.is_symlink() or d.is_file(follow_symlinks=False):
                files.append(name)
        return _DirListing(mtime_ns, key, tuple(files), tuple(prefix + f for f in files), tuple(dirs))

    def manifest_and_digest(self) -> tuple[ScanResult, str]:
        """Scan, and digest the manifest (the digest is reused when the manifest did not change)."""
        result = self.scan()
        if self.last_digest is not None and self._unchanged:
            return result, self.last_digest
        d = self.last_digest = digest(result.manifest)
        self.dirty = True
        return result, d

    def sha256(self, rel: str, entry: Entry) -> str:
        """A file's content hash (a symlink's: its target's text), cached while its entry holds."""
        known = self.hashes.get(rel)
        if known is not None and known[0] == entry:
            return known[1]
        if entry[3]:
            h = hashlib.sha256(entry[3].encode("utf-8", "surrogateescape")).hexdigest()
        else:
            h = self._hash_file(rel, entry)
        self.hashes[rel] = (entry, h)
        self.dirty = True
        return h

    def read(self, rel: str, entry: Entry) -> bytes:
        """The file's bytes as of ``entry``; a file rewritten while read is read again."""
        path = os.path.join(self.root, rel)
        for _ in range(5):
            with open(path, "rb") as f:
                data = f.read()
                st = os.fstat(f.fileno())
            if st.st_size == len(data) and (st.st_size, st.st_mtime_ns) == (entry[0], entry[1]):
                return data
            entry = (st.st_size, st.st_mtime_ns, entry[2], "")
        raise WorkspaceError(f"{path} keeps changing while it is read; sync again when it is written")

    def _hash_file(self, rel: str, entry: Entry) -> str:
        """The file's sha256, read in blocks (a big file is never held whole)."""
        path = os.path.join(self.root, rel)
        h = hashlib.sha256()
        with open(path, "rb") as f:
            while block := f.read(1 << 20):
                h.update(block)
            st = os.fstat(f.fileno())
        if (st.st_size, st.st_mtime_ns) != (entry[0], entry[1]):
            raise WorkspaceError(f"{path} keeps changing while it is read; sync again when it is written")
        return h.hexdigest()

    def updates_for(
        self, rel: str, entry: Entry, host_sha: str | None, host_entry: Entry | None, chunk: int
    ) -> Iterator[FileUpdate]:
        """:meth:`update_for`, with a file over ``chunk`` bytes sent in parts read one at a time."""
        if entry[3] or entry[0] <= chunk:
            yield self.update_for(rel, entry, host_sha, host_entry)
            return
        if host_sha is not None and host_entry is not None and host_entry[0] == entry[0] and not host_entry[3]:
            sha = self.sha256(rel, entry)
            if sha == host_sha:
                yield FileUpdate(rel, entry, sha, None)
                return
        path = os.path.join(self.root, rel)
        h = hashlib.sha256()
        with open(path, "rb") as f:
            st = os.fstat(f.fileno())
            if (st.st_size, st.st_mtime_ns, stat.S_IMODE(st.st_mode)) != entry[:3]:
                raise WorkspaceError(f"{path} changed since the scan; sync again when it is written")
            offset = 0
            while True:
                data = f.read(chunk)
                h.update(data)
                last = offset + len(data) >= entry[0]
                if last:
                    now = os.fstat(f.fileno())
                    if (now.st_size, now.st_mtime_ns) != (entry[0], entry[1]) or f.read(1):
                        raise WorkspaceError(f"{path} keeps changing while it is read; sync again when it is written")
                    yield FileUpdate(rel, entry, h.hexdigest(), data, offset, False)
                    return
                if not data:
                    raise WorkspaceError(f"{path} shrank while it was read; sync again when it is written")
                yield FileUpdate(rel, entry, "", data, offset, True)
                offset += len(data)

    def update_for(self, rel: str, entry: Entry, host_sha: str | None, host_entry: Entry | None) -> FileUpdate:
        """What to send for one changed path: metadata only when the host has the same content."""
        if entry[3]:
            return FileUpdate(rel, entry, self.sha256(rel, entry), None)
        if host_sha is not None and host_entry is not None and host_entry[0] == entry[0] and not host_entry[3]:
            sha = self.sha256(rel, entry)  # same size, other time: hash to tell a touch from an edit
            if sha == host_sha:
                return FileUpdate(rel, entry, sha, None)
        path = os.path.join(self.root, rel)
        for _ in range(5):  # the entry must describe the bytes we send
            data = self.read(rel, entry)
            st = os.lstat(path)
            now = (st.st_size, st.st_mtime_ns, stat.S_IMODE(st.st_mode), "")
            if now == entry:
                return FileUpdate(rel, entry, hashlib.sha256(data).hexdigest(), data)
            entry = now
        raise WorkspaceError(f"{path} keeps changing while it is read; sync again when it is written")


def _cache_spec(specs: dict[str, object], path: str) -> object | None:
    spec = _load_spec(path)
    if spec is not None:
        specs[path] = spec
    return spec


def _inside(root: str, absdir: str, target: str) -> bool:
    resolved = os.path.normpath(os.path.join(absdir, target))
    return resolved == root or resolved.startswith(root + os.sep)


def check_size(manifest: Manifest, limit: int, root: str) -> None:
    """A workspace over ``limit`` bytes is an error naming its biggest paths."""
    total = sum(e[0] for e in manifest.values())
    if total <= limit:
        return
    biggest = sorted(manifest.items(), key=lambda kv: kv[1][0], reverse=True)[:3]
    names = ", ".join(f"{p} ({human_bytes(e[0])})" for p, e in biggest)
    raise WorkspaceError(
        f"workspace {root} is {human_bytes(total)}, over the {human_bytes(limit)} sync limit; biggest: {names}; "
        f"list them in .monarchignore, or raise the limit with {EnvSettings.sync_max_bytes.var}, or use --no-sync"
    )


def human_bytes(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB"):
        if n < 1000 or unit == "GB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}".replace(".0 ", " ")
        n /= 1000
    return f"{n:.1f} TB"


class Changes(NamedTuple):
    """What a host lacks: paths to send (with the host's entry and hash, if it has one) and to delete."""

    changed: list[tuple[str, Entry, Entry | None, str | None]]
    deleted: list[str]


def diff(client: Manifest, host: Mapping[str, tuple[Entry, str | None]]) -> Changes:
    changed = []
    for path, entry in client.items():
        had = host.get(path)
        if had is None or had[0] != entry:
            changed.append((path, entry, had[0] if had else None, had[1] if had else None))
    deleted = [p for p in host if p not in client]
    return Changes(changed, deleted)


def load_scanner(cache_file: Path, root: str) -> Scanner:
    """The scanner saved for ``root`` in ``cache_file``, or a fresh one.

    The cache is plain data read with no globals (nothing in it can run code), and a cache
    file or directory another user created or can write is refused (:class:`WorkspaceError`).
    """
    try:
        check_private(cache_file.parent, directory=True)
        if not check_private(cache_file):
            return Scanner(root)
        with open(cache_file, "rb") as f:
            data = loads_plain(f.read())
        scanner = Scanner.from_data(data)
        if scanner.root == os.path.abspath(root):
            return scanner
    except UnsafePath as e:
        raise WorkspaceError(f"workspace scan cache: {e}") from None
    except (OSError, EOFError, pickle.UnpicklingError, AttributeError, ValueError, TypeError, KeyError, IndexError):
        pass
    return Scanner(root)


def save_scanner(scanner: Scanner, cache_file: Path) -> None:
    cache_file.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    scanner.dirty = False
    atomic_write(cache_file, pickle.dumps(scanner.to_data(), protocol=4))
