"""A fork server: a single-threaded process that has already imported what procs need.

Forking it makes a ready proc in a few milliseconds instead of paying interpreter start
and imports each time. It never creates a ZeroMQ context (not fork-safe) or a thread.
Children get SIGKILL when the zygote dies (PR_SET_PDEATHSIG), and the zygote gets it when
its agent dies, so a killed agent leaves no procs behind.

A warm zygote (torch and what runs imported: hundreds of MB) takes ~5-10 ms to fork, and
forks a run's ranks one after the other. After a run the agent asks it for spares
(:class:`~..protocol.Spares`): children forked then, each idle on a socket of its own, that
the next run's ranks are handed to (their boot record and fds, as a fork would give them), so
that run's ranks start at once instead of one fork apart. An idle spare runs nothing of
anyone's and dies with the zygote; its exit is not reported (it was never a rank).
"""

from __future__ import annotations

import array
import collections
import errno
import gc
import importlib
import os
import pickle
import signal
import socket
import sys
import threading
from typing import TYPE_CHECKING, Any, cast

from ... import config
from ...sysutil import ready_fds, signal_if_alive
from .. import protocol
from ..rank import preload
from .zygote_child import _child, _spare, die_with_parent

if TYPE_CHECKING:
    from ..protocol import RankSpec

PRELOAD_ENV = config.PRELOAD_ENV


class _Spares:
    """The zygote's idle spare children, by pid, each with the zygote's end of its socket."""

    def __init__(self, title: str) -> None:
        #: ``monarch spare local-1a2b host h0`` for the zygote ``monarch warm local-1a2b host h0``
        self.title = "monarch spare " + title.split(" ", 2)[-1]
        self.idle: dict[int, socket.socket] = {}
        self.lost: set[int] = set()  # spares found dead when handed a rank, not reaped yet
        #: Idle kept ranks (among ``idle``): the LOCAL_RANK their last run had (its device, its
        #: compiled graphs); handed only runs that keep ranks, that local rank's first.
        self.tags: dict[int, str] = {}
        self.kept: dict[int, socket.socket] = {}  # kept ranks running a run, by pid: their socket
        self.ending: set[int] = set()  # those of them whose run ended: putting themselves back

    def fill(self, count: int, inherited: list[Any], children: set[int]) -> None:
        """Fork spares until ``count`` are idle (at most :data:`MAX_SPARES`)."""
        while len(self.idle) < min(count, MAX_SPARES):
            ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
            sys.stdout.flush()
            sys.stderr.flush()
            gc.freeze()
            pid = os.fork()
            if pid == 0:
                _spare(theirs, [*inherited, ours, *self.idle.values(), *self.kept.values()], self.title)
            theirs.close()
            self.idle[pid] = ours
            children.add(pid)

    def pick(self, boot: dict[str, Any]) -> int | None:
        """An idle child for this rank: a kept one of its local rank, another kept one, a plain
        spare; a run that does not keep ranks gets a plain spare only (a kept one is not fresh)."""
        plain = [p for p in self.idle if p not in self.tags]
        if not boot.get("keep"):
            return plain[0] if plain else None
        local = str(boot.get("env", {}).get("LOCAL_RANK", ""))
        same = [p for p, tag in self.tags.items() if tag == local]
        return next(iter(same or plain or list(self.tags)), None)

    def hand_over(self, data: bytes, fds: list[int], boot: dict[str, Any]) -> int | None:
        """Give a rank's fork request to an idle child; its pid, or None when none could take it."""
        while (pid := self.pick(boot)) is not None:
            ours = self.idle.pop(pid)
            self.tags.pop(pid, None)
            try:
                ancillary = [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", fds))] if fds else []
                ours.sendmsg([data], ancillary)
            except OSError:  # it died meanwhile: its exit is reaped (and not reported) as a spare's
                self.lost.add(pid)
                ours.close()
                continue
            if boot.get("keep"):
                self.kept[pid] = ours
            else:
                ours.close()
            return pid
        return None

    def heard(self, pid: int) -> None:
        """A kept rank's socket is readable: ``idle LOCAL_RANK`` after its run, or closed (it exits)."""
        ours = self.kept[pid]
        try:
            said = ours.recv(64)
        except OSError:
            said = b""
        if said == b"ending":
            self.ending.add(pid)
            return
        del self.kept[pid]
        self.ending.discard(pid)
        if said.startswith(b"idle"):
            self.idle[pid] = ours
            self.tags[pid] = said[5:].decode(errors="replace")
        else:
            ours.close()

    def discard(self) -> None:
        """Let every idle plain spare go (it exits on the closed socket; its exit is not reported);
        kept ranks stay (they import what they need themselves)."""
        for pid in [p for p in self.idle if p not in self.tags]:
            self.idle.pop(pid).close()
            self.lost.add(pid)

    def exited(self, pid: int) -> bool:
        """A spare died before it was a rank (killed from outside): forget it; True if it was one."""
        ours = self.idle.pop(pid, None)
        self.tags.pop(pid, None)
        if ours is not None:
            ours.close()
            return True
        running = self.kept.pop(pid, None)  # a kept rank that ended during a run: a rank's exit
        self.ending.discard(pid)
        if running is not None:
            running.close()
            return False
        if pid in self.lost:
            self.lost.discard(pid)
            return True
        return False


#: Spares a zygote keeps at most (one per rank the last run had here, up to this).
MAX_SPARES = 64


def _exit_if_orphaned(parent: int, done: threading.Event) -> None:
    while not done.wait(0.2):
        if os.getppid() != parent:
            os._exit(0)


def serve(fd: int, title: str = "monarch fork-server") -> None:
    die_with_parent()
    from ..title import set_title

    set_title(title)
    sock = socket.socket(fileno=fd)
    preload.note_environment()
    # Importing torch takes seconds, during which the zygote cannot see its agent's socket
    # close; where PR_SET_PDEATHSIG is not delivered (some sandboxes), watch the parent
    # meanwhile. The thread ends before the first fork: forks still happen single-threaded.
    importing = threading.Event()
    watchdog = threading.Thread(target=_exit_if_orphaned, args=(os.getppid(), importing), daemon=True)
    watchdog.start()
    from ..actor import proc  # noqa: F401 - the point of the zygote: import once, fork many
    from ..rank import (
        debug,  # noqa: F401 - every python rank installs it (pdb, ~8 ms when imported there)
        fresh,  # every warm rank runs it
        start,  # noqa: F401 - every rank runs it
        telemetry,  # noqa: F401 - every rank installs it; ~0.15 ms each when imported there
    )

    stop_env_reads = preload.watch_env_reads()
    for name in filter(None, os.environ.get(PRELOAD_ENV, "").split(",")):
        try:
            importlib.import_module(name)
        except Exception as e:  # noqa: BLE001
            print(f"monarch zygote: could not preload {name}: {e}", file=sys.stderr)
    _load_learned(sock, stop_env_reads)  # (the watchdog counts in its thread baseline: it lives until now)
    stop_env_reads()
    preload.finish_environment()
    preload.mark_start()  # once for every rank forked from here
    fresh.prepare()
    importing.set()
    watchdog.join()
    _Server(sock, title).loop()


class _Server:
    """The fork server's loop, once everything is imported: fork requests, spares, kept ranks,
    children's exits. Single-threaded (every fork happens from here)."""

    def __init__(self, sock: socket.socket, title: str) -> None:
        self.sock = sock
        self.wake_r, self.wake_w = os.pipe()
        os.set_blocking(self.wake_r, False)
        os.set_blocking(self.wake_w, False)
        signal.set_wakeup_fd(self.wake_w)
        signal.signal(signal.SIGCHLD, lambda *_: None)
        self.children: set[int] = set()
        self.spares = _Spares(title)
        self.tainted = False  # a LearnMore made it unsafe to fork warm ranks: it runs the queued ones cold
        # Replies never block: with hundreds of forks asked at once, a blocking reply while the agent
        # is still sending requests would deadlock both ends of the socket pair. They wait here and
        # go as the socket takes them, while requests keep being read.
        self.replies: collections.deque[bytes] = collections.deque()
        #: Runs that keep ranks, asked while a kept rank of theirs is still putting itself back
        #: (it said ``ending``, not yet ``idle``): handed to it once it is, not forked afresh.
        self.deferred: list[tuple[int, str, dict[str, Any], list[int]]] = []

    def loop(self) -> None:
        sock, spares = self.sock, self.spares
        while True:
            try:
                ready, _ = ready_fds([sock, self.wake_r, *spares.kept.values()], [sock] if self.replies else [])
            except InterruptedError:
                continue
            if self.wake_r in ready:
                self._reap()
            for pid in [p for p, kept in spares.kept.items() if kept in ready]:
                spares.heard(pid)
            if self.deferred and not spares.ending:
                deferred, self.deferred = self.deferred, []
                for request in deferred:
                    self._fork(*request)
            if sock in ready:
                self._request()
            _send_replies(sock, self.replies)

    def _reap(self) -> None:
        try:
            while os.read(self.wake_r, 4096):
                pass
        except BlockingIOError:
            pass
        while self.children:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                break
            if pid == 0:
                break
            self.children.discard(pid)
            if not self.spares.exited(pid):
                self.replies.append(pickle.dumps(protocol.header(protocol.ChildExited(pid, status))))

    def _request(self) -> None:
        try:
            data, fds, _, _ = socket.recv_fds(self.sock, 1 << 20, 16)
        except OSError as e:
            if e.errno == errno.EINTR:
                return
            data = b""
        if not data:  # the agent is gone
            for pid in self.children:
                signal_if_alive(pid, signal.SIGKILL)
            os._exit(0)
        msg = protocol.decode(pickle.loads(data))
        if isinstance(msg, protocol.Spares):
            if not self.tainted:
                self.spares.fill(msg.wanted, [self.sock, self.wake_r, self.wake_w], self.children)
        elif isinstance(msg, protocol.LearnMore):
            self.spares.discard()
            self.tainted = _learn_more(msg) or self.tainted
            self.replies.append(pickle.dumps(protocol.header(protocol.WarmReady())))
        else:
            msg.boot["_zygote_pid"] = os.getpid()
            if msg.boot.get("keep") and self.spares.ending and self.spares.pick(msg.boot) is None:
                self.deferred.append((msg.req_id, msg.kind, msg.boot, list(fds)))
            else:
                self._fork(msg.req_id, msg.kind, msg.boot, list(fds))

    def _fork(self, req_id: int, kind: str, boot: dict[str, Any], fds: list[int]) -> None:
        pid = None
        if self.tainted and kind in ("rank", "cold"):  # what it learned last makes it unsafe to fork
            pid = _start_cold(cast("RankSpec", boot), fds)  # (these kinds' boot is a rank spec)
            self.children.add(pid)
        if kind == "rank" and pid is None and self.spares.idle:
            pid = self.spares.hand_over(pickle.dumps(protocol.header(protocol.Fork(req_id, kind, boot))), fds, boot)
        if pid is None:
            pid = self._fork_child(kind, boot, fds)
        for f in fds:
            os.close(f)
        self.replies.append(pickle.dumps(protocol.header(protocol.Forked(req_id, pid))))

    def _fork_child(self, kind: str, boot: dict[str, Any], fds: list[int]) -> int:
        keep = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET) if boot.get("keep") else None
        sys.stdout.flush()
        sys.stderr.flush()
        # What the zygote holds never becomes garbage a rank could collect: leave it out of the
        # rank's collections. A full one (HF Trainer calls gc.collect()) otherwise writes to every
        # object, copying ~130 MB of the zygote's pages into the rank (~0.3-1 s) and freeing them
        # at its exit. (The CPython docs' advice for a process that forks.)
        gc.freeze()
        pid = os.fork()
        if pid == 0:
            spares = self.spares
            inherited = [self.sock, self.wake_r, self.wake_w, *spares.idle.values(), *spares.kept.values()]
            _child([*inherited, *(keep[:1] if keep else ())], kind, boot, fds, keep[1] if keep else None)
        self.children.add(pid)
        if keep is not None:
            keep[1].close()
            self.spares.kept[pid] = keep[0]
        return pid


def _send_replies(sock: socket.socket, replies: collections.deque[bytes]) -> None:
    """Send what the socket takes now; the rest waits for it to be writable."""
    while replies:
        try:
            sock.send(replies[0], socket.MSG_DONTWAIT)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:  # the agent is gone: the next read says so
            replies.clear()
            return
        replies.popleft()


def _start_cold(boot: RankSpec, fds: list[int]) -> int:
    """A cold rank started without ``os.fork()``: a zygote that learned a module refusing forks
    (its ``register_at_fork`` hook, a thread pool that hangs in the child) must not run Python's
    fork hooks. ``subprocess`` forks and execs in C and runs none; the rank is a fresh
    interpreter, as any cold rank."""
    import json
    import subprocess

    from ..rank import start as rank_start

    boot.pop("_zygote_pid", None)
    extra = {role: fds[i] for role, i in boot.pop("_fd_roles", {}).items()}
    env = dict(boot["env"])
    if boot["mode"] == "no_python":
        extra = {}  # (a program gets no debugger or store socket: the caller closes them)
    else:
        env[rank_start.SPEC_ENV] = json.dumps({**boot, "extra_fds": extra})
    proc = subprocess.Popen(
        rank_start.cold_command(boot),
        stdin=fds[0],
        stdout=fds[1],
        stderr=fds[2],
        pass_fds=list(extra.values()),
        cwd=boot["cwd"],
        env=env,
        start_new_session=True,
    )
    _started.append(proc)  # (reaped by the loop's waitpid, reported as any child)
    return proc.pid


_started: list[Any] = []


def _learn_more(msg: protocol.LearnMore) -> bool:
    """Import more learned modules in this (idle) zygote; True if one made it unsafe to fork."""
    from ..rank import fresh

    stop_env_reads = preload.watch_env_reads()
    try:
        imported = preload.import_learned(msg.learned)
    finally:
        stop_env_reads()
    preload.finish_environment()
    if imported[3] is None:
        preload.mark_start()  # ranks report only what is not held now
        fresh.prepare()  # loggers the new modules made
    preload.write_ready(msg.ready, imported)
    return imported[3] is not None


def _load_learned(sock: socket.socket, stop_env_reads: Any) -> None:
    """A warm-rank zygote: import what ranks were seen to import, then say it is ready."""
    ready = os.environ.get(preload.READY_ENV)
    if not ready:
        return
    learned = os.environ.get(preload.LEARNED_ENV)
    imported: preload.Imported = preload.import_learned(learned) if learned else ([], {}, [], None)
    stop_env_reads()
    preload.write_ready(ready, imported)
    offender = imported[3]
    sock.send(pickle.dumps(protocol.header(protocol.WarmReady())))
    if offender is not None:  # not safe to fork any more: the agent starts another without it
        os._exit(0)


if __name__ == "__main__":
    serve(int(sys.argv[1]), *sys.argv[2:3])
