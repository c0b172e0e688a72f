"""A run's output log: one append-only file for all its ranks, split into ``rankN.log`` files lazily.

The client writes every rank's output to ``<run dir>/output.log`` as records: a header line
``RANK STREAM LENGTH`` and then exactly the bytes the rank wrote. One file per run, not one per
rank: creating 32,768 files took a 4,096-host run's client seconds (more on NFS, and on this
project's CI disk, ext4 without a journal, where each new inode skips every recently deleted
one), a quarter of a 128-host run's CPU. The per-rank files users read (``monarch logs``, the
MCP server, ``grep -l``) are made from it when first asked for (:func:`split`), and brought up
to date at each later ask while the run goes on: whoever reads pays, once. A run's first line
names its ranks, so a silent rank still gets its (empty) file.

Standard library only: ``monarch logs`` must not load the runtime.
"""

from __future__ import annotations

import collections
import errno
import fcntl
import os
from collections.abc import Iterable
from pathlib import Path
from typing import BinaryIO

from .ranks import parse_rank_list, rank_ranges

#: The run's combined log, in its run directory.
LOG_NAME = "output.log"
_MAGIC = b"monarch-run-log 1 ranks "
_SPLIT_STATE = ".split"  # how far output.log has been split (bytes), beside it
_SPLIT_LOCK = ".split.lock"
_SPLIT_PENDING = ".split.pending"  # there while a split appends: a split killed then is done again
_READ = 1 << 20
_MAX_OPEN = 256  # rank files kept open at once while splitting
_LOG_MODE = 0o600


def header(ranks: Iterable[int]) -> bytes:
    """The log's first line: its ranks, as ranges (``0-4095,5000``)."""
    return _MAGIC + rank_ranges(ranks).encode() + b"\n"


def record(rank: int, stream: int, data: bytes) -> bytes:
    """One piece of a rank's output, as the log holds it."""
    return b"%d %d %d\n" % (rank, stream, len(data)) + data


def split(run_dir: Path) -> Path:
    """Bring the ``rankN.log`` files of ``run_dir`` up to date with its ``output.log``, and return the
    directory that holds them: ``run_dir`` itself, or, where it cannot be written (a read-only
    mount, a run directory of another user's), a private copy under the cache directory, split
    there. A run logged before the combined log already has whole rank files: a no-op.

    Safe to call from several readers at once (a lock), while the run still writes (only whole
    records are taken), and after a split was killed part way (a marker left while it appends:
    the next split starts again from the beginning, so no record is appended twice)."""
    log = run_dir / LOG_NAME
    if not log.exists():
        return run_dir
    try:
        _split_into(run_dir, log)
        return run_dir
    except OSError as e:
        if e.errno not in (errno.EROFS, errno.EACCES, errno.EPERM):
            raise
    where = _private_copy_dir(run_dir)
    _split_into(where, log)
    return where


def _split_into(where: Path, log: Path) -> None:
    with open(open_private(where / _SPLIT_LOCK, os.O_RDWR), "r+b") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        state, pending = where / _SPLIT_STATE, where / _SPLIT_PENDING
        killed = pending.exists()  # a split killed while appending: its rank files are made again
        done = 0
        if not killed:
            try:
                done = int(state.read_text() or 0)
            except (OSError, ValueError):
                done = 0
        with open(log, "rb") as f:
            if os.fstat(f.fileno()).st_size <= done:
                return  # nothing new (the usual case of `logs -f` between lines)
            os.close(open_private(pending, os.O_WRONLY))
            f.seek(done)
            new = _Splitter(where, fresh=done == 0)
            done += new.feed(f)
            new.close()
        tmp = state.with_name(_SPLIT_STATE + ".tmp")
        fd = open_private(tmp, os.O_WRONLY | os.O_TRUNC)
        try:
            os.write(fd, str(done).encode())
        finally:
            os.close(fd)
        os.replace(tmp, state)
        pending.unlink()


def _private_copy_dir(run_dir: Path) -> Path:
    """Where the rank files of a run directory this user cannot write are split: under the cache
    directory (owner-only), named by the run directory's resolved path."""
    import hashlib  # (not at import: every run-spmd imports this module, ~1.5 ms)

    from ..sysutil import cache_dir

    base = Path(cache_dir()) / "split-logs"
    base.mkdir(parents=True, exist_ok=True)
    os.chmod(base, 0o700)  # what ranks printed, from any run this user read: owner-only
    where = base / hashlib.sha256(str(run_dir.resolve()).encode()).hexdigest()[:20]
    where.mkdir(mode=0o700, exist_ok=True)
    where = where / run_dir.name
    where.mkdir(mode=0o700, exist_ok=True)
    return where


class _Splitter:
    def __init__(self, run_dir: Path, fresh: bool) -> None:
        self.run_dir = run_dir
        self.fresh = fresh  # from the log's start: the rank files are made empty at its first line
        self.files: collections.OrderedDict[int, BinaryIO] = collections.OrderedDict()

    def feed(self, f: BinaryIO) -> int:
        """Split what ``f`` holds from where it stands; the bytes taken (whole records only)."""
        taken = 0
        buf = f.read(_READ)
        at = 0
        while True:
            nl = buf.find(b"\n", at)
            if nl < 0:
                more = f.read(_READ)
                if not more:
                    return taken
                buf, at = buf[at:] + more, 0
                continue
            line = buf[at:nl]
            if line.startswith(_MAGIC):  # the run's first line, or a restart's (its attempts share the log)
                self._make_all(sorted(parse_rank_list(line[len(_MAGIC) :].decode(), None)))
                taken += nl + 1 - at
                at = nl + 1
                continue
            try:
                rank, _stream, length = (int(x) for x in line.split())
            except ValueError:
                return taken  # not a record: stop here rather than guess
            end = nl + 1 + length
            if end > len(buf):  # the rest of a long record: read just that
                want = end - len(buf)
                more = f.read(want)
                if len(more) < want:
                    return taken  # not all written yet
                buf += more
            self._append(rank, buf[nl + 1 : end])
            taken += end - at
            at = end

    def _make_all(self, ranks: list[int]) -> None:
        """A header: every rank's file exists (a silent rank's too). At the log's first line they
        are emptied: what a killed split had appended is written again (a restart's header, later
        in the log, keeps what the earlier attempts wrote)."""
        flags = os.O_WRONLY | (os.O_TRUNC if self.fresh else 0)
        self.fresh = False
        for r in ranks:
            os.close(open_private(self.run_dir / f"rank{r}.log", flags))

    def _append(self, rank: int, data: bytes) -> None:
        out = self.files.get(rank)
        if out is None:
            out = self.files[rank] = open(  # noqa: SIM115
                open_private(self.run_dir / f"rank{rank}.log", os.O_WRONLY | os.O_APPEND), "ab", buffering=0
            )
            if len(self.files) > _MAX_OPEN:
                self.files.popitem(last=False)[1].close()
        else:
            self.files.move_to_end(rank)
        out.write(data)

    def close(self) -> None:
        for out in self.files.values():
            out.close()
        self.files.clear()


def open_private(path: Path, flags: int) -> int:
    """A descriptor on ``path`` opened with ``flags``, made 0600 if new; an existing file is made
    owner-only too (logs hold what ranks print: tokens, paths)."""
    fd = os.open(path, flags | os.O_CREAT | os.O_CLOEXEC, _LOG_MODE)
    if os.fstat(fd).st_mode & 0o777 != _LOG_MODE:
        os.fchmod(fd, _LOG_MODE)
    return fd


def rank_log(run_dir: Path, rank: int) -> Path:
    """``rank``'s log file, brought up to date with the run's log first."""
    return split(run_dir) / f"rank{rank}.log"


def rank_logs(run_dir: Path) -> list[Path]:
    """Every rank's log file, by rank, brought up to date with the run's log first."""
    return sorted(split(run_dir).glob("rank*.log"), key=lambda p: int(p.stem[4:]))
