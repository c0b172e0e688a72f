"""The agent's side of SPMD runs: start ranks, forward their output, report their exits.

Ranks are forked from a zygote that has already imported the preloaded modules (torch by
default), or, for cold runs, forked from the plain zygote and ``exec``'d into a fresh
interpreter. Output travels as raw bytes, in order; a rank's exit is reported only after
both of its pipes reach EOF (or a short grace if a grandchild keeps them open), so no line
can arrive after the exit that ended it.
"""

from __future__ import annotations

import dataclasses
import os
import signal
import socket
import time
from typing import TYPE_CHECKING, Any, Dict, List, Optional, Set, Tuple

if TYPE_CHECKING:
    from .agent import HostAgent

_READ = 1 << 16
_EOF_GRACE = 2.0  # seconds to wait for pipes after a rank exits
#: Read once, at interpreter start-up: a warm rank inherits the zygote's values, so when the
#: rank's environment asks for others it must start cold to get them (e.g. a PYTHONPATH or
#: PYTHONHASHSEED exported after `monarch serve`).
_START_UP_ENV = (
    "PYTHONPATH", "PYTHONHOME", "PYTHONHASHSEED", "PYTHONOPTIMIZE", "PYTHONDEBUG", "PYTHONVERBOSE",
    "PYTHONDONTWRITEBYTECODE", "PYTHONNOUSERSITE", "PYTHONUSERBASE", "PYTHONSAFEPATH", "PYTHONWARNINGS",
    "PYTHONDEVMODE", "PYTHONUTF8", "PYTHONCOERCECLOCALE", "PYTHONMALLOC", "PYTHONTRACEMALLOC",
    "PYTHONFAULTHANDLER", "PYTHONINTMAXSTRDIGITS", "PYTHONPLATLIBDIR", "PYTHONPYCACHEPREFIX",
    "PYTHONWARNDEFAULTENCODING", "PYTHONNODEBUGRANGES", "PYTHONPROFILEIMPORTTIME",
)


@dataclasses.dataclass
class _Rank:
    run_id: str
    rank: int
    owner: str
    started: float
    fds: Dict[int, int]  # read fd -> stream (1 stdout, 2 stderr)
    pid: Optional[int] = None
    status: Optional[int] = None
    exited_at: Optional[float] = None


class RankHost:
    def __init__(self, agent: "HostAgent") -> None:
        self.agent = agent
        self.pending: Dict[int, _Rank] = {}  # fork request -> rank
        self.by_pid: Dict[int, _Rank] = {}
        self.by_fd: Dict[int, _Rank] = {}
        self.ports: Dict[str, socket.socket] = {}  # run id -> held listening socket
        self.groups: Dict[str, List[int]] = {}  # run id -> its ranks' process groups here (pgid == pid)
        self.reaping: Dict[int, float] = {}  # process group left behind by a run -> when to SIGKILL it

    # ---------------------------------------------------------------- requests
    def reserve_port(self, run_id: str) -> int:
        """Bind and listen now, keep it open, hand the socket to rank 0 later: no race."""
        from ..config import advertised_host

        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((advertised_host(), 0))
        sock.listen(128)
        self.ports[run_id] = sock
        return sock.getsockname()[1]

    def start(self, owner: str, run_id: str, specs: List[Dict[str, Any]]) -> Dict[str, List[str]]:
        """Start the ranks; returns ``made_cold``, the start-up variables that made warm ranks
        start cold, and ``notices`` for the user (e.g. a fresh warm process, and why)."""
        from . import preload  # (the agent's side; controllers import this module too)

        held = self.ports.pop(run_id, None)
        base = {k: v for k, v in os.environ.items() if not k.startswith("MONARCH_")}
        made_cold: Set[str] = set()
        notices: List[str] = []
        warm_zygote: Any = None
        for spec in specs:
            spec["env"] = {**base, **spec["env"]}  # the controller's view wins over this host's
            differ = [k for k in _START_UP_ENV if spec["env"].get(k) != os.environ.get(k)]
            if spec["warm"] and differ:
                spec["warm"] = False  # the zygote's interpreter was started with other settings
                made_cold.update(differ)
            if not os.path.isdir(spec["cwd"]):
                spec["cwd"] = os.getcwd()
            out_r, out_w = os.pipe()
            err_r, err_w = os.pipe()
            devnull = os.open(os.devnull, os.O_RDONLY)
            fds = [devnull, out_w, err_w]
            roles: Dict[str, int] = {}
            if held is not None and spec.get("host_store"):
                roles["listen"] = len(fds)
                fds.append(held.fileno())
            debug_ours: Optional[socket.socket] = None
            if spec["mode"] != "no_python":
                debug_ours, debug_theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
                roles["debug"] = len(fds)
                fds.append(debug_theirs.fileno())
            spec["_fd_roles"] = roles
            rank = _Rank(run_id, spec["rank"], owner, time.monotonic(), {out_r: 1, err_r: 2})
            req = self.agent.next_request()
            self.pending[req] = rank
            if spec["warm"]:
                if warm_zygote is None:
                    warm_zygote, notices = self.agent.warm.for_run()
                spec[preload.REPORT_KEY] = self.agent.warm.report_path(run_id, spec["rank"])
            zygote = warm_zygote if spec["warm"] else self.agent.zygote
            zygote.fork(req, spec, fds, kind="rank" if spec["warm"] else "cold")
            for fd in (devnull, out_w, err_w):
                os.close(fd)
            if debug_ours is not None:
                debug_theirs.close()
                coords = {"hosts": int(spec["env"].get("GROUP_RANK", 0)), "gpus": int(spec["env"].get("LOCAL_RANK", 0))}
                self.agent.debug.add(run_id, spec["rank"], owner, debug_ours, coords)
            for fd in (out_r, err_r):
                os.set_blocking(fd, False)
                self.by_fd[fd] = rank
                self.agent.watch_fd(fd)
        if held is not None:
            held.close()
        return {"made_cold": sorted(made_cold), "notices": notices}

    def signal_run(self, run_id: str, sig: int) -> int:
        hit = 0
        for rank in self.by_pid.values():
            if rank.run_id == run_id and rank.status is None:
                _killpg(rank.pid, sig)
                hit += 1
        return hit

    def reap_owner(self, owner: str) -> None:
        for rank in self.by_pid.values():
            if rank.owner == owner and rank.status is None:
                _killpg(rank.pid, signal.SIGKILL)

    def kill_all(self) -> None:
        for rank in self.by_pid.values():
            if rank.status is None:
                _killpg(rank.pid, signal.SIGKILL)
        for pgid in [*self.reaping, *(g for groups in self.groups.values() for g in groups)]:
            _signal_group(pgid, signal.SIGKILL)

    # ------------------------------------------------------------------ events
    def forked(self, req: int, pid: int) -> bool:
        rank = self.pending.pop(req, None)
        if rank is None:
            return False
        rank.pid = pid
        self.by_pid[pid] = rank
        self.groups.setdefault(rank.run_id, []).append(pid)
        self.agent.debug.set_pid(rank.run_id, rank.rank, pid)
        return True

    def exited(self, pid: int, status: int) -> bool:
        rank = self.by_pid.get(pid)
        if rank is None:
            return False
        rank.status = status
        rank.exited_at = time.monotonic()
        self._maybe_report(rank)
        return True

    def readable(self, fd: int) -> bool:
        rank = self.by_fd.get(fd)
        if rank is None:
            return False
        try:
            data = os.read(fd, _READ)
        except BlockingIOError:
            return True
        if data:
            self.agent.send(rank.owner, ("event", "output", rank.run_id, rank.rank, rank.fds[fd]), [data])
        else:
            self._close(fd)
            self._maybe_report(rank)
        return True

    def tick(self) -> None:
        """Report ranks whose pipes a grandchild still holds open after the grace period;
        SIGKILL what is left of finished runs' process groups."""
        now = time.monotonic()
        for pgid, kill_at in list(self.reaping.items()):
            if now >= kill_at:
                del self.reaping[pgid]
                if pgid not in self.by_pid:  # never a new rank that got the same pid
                    _signal_group(pgid, signal.SIGKILL)
        for rank in list(self.by_pid.values()):
            if rank.exited_at is not None and rank.fds and now - rank.exited_at > _EOF_GRACE:
                for fd in list(rank.fds):
                    self.readable(fd)  # whatever is buffered still goes out first
                    self._close(fd)
                self._maybe_report(rank)

    def _close(self, fd: int) -> None:
        rank = self.by_fd.pop(fd, None)
        if rank is not None:
            rank.fds.pop(fd, None)
        self.agent.unwatch_fd(fd)
        try:
            os.close(fd)
        except OSError:
            pass

    def _maybe_report(self, rank: _Rank) -> None:
        if rank.status is None or rank.fds or rank.pid is None:
            return
        self.by_pid.pop(rank.pid, None)
        status = rank.status
        exitcode = os.WEXITSTATUS(status) if os.WIFEXITED(status) else None
        sig = os.WTERMSIG(status) if os.WIFSIGNALED(status) else None
        duration = (rank.exited_at or time.monotonic()) - rank.started
        self.agent.debug.rank_exited(rank.run_id, rank.rank, describe_status(exitcode, sig)[0])
        self.agent.send(rank.owner, ("event", "rank_exit", rank.run_id, rank.rank, exitcode, sig, duration, rank.pid))
        self._end_run(rank.run_id)

    def _end_run(self, run_id: str) -> None:
        """Once every rank of a run here has ended, end what they left running, as torchrun
        does: SIGTERM to each rank's process group, SIGKILL to what is left a grace later."""
        if any(r.run_id == run_id for r in (*self.by_pid.values(), *self.pending.values())):
            return
        self.agent.warm.learn(run_id)
        kill_at = time.monotonic() + _EOF_GRACE
        for pgid in self.groups.pop(run_id, ()):
            if _signal_group(pgid, signal.SIGTERM):
                self.reaping[pgid] = kill_at

    def live_fds(self) -> Set[int]:
        return set(self.by_fd)


def _killpg(pid: Optional[int], sig: int) -> None:
    if pid is None:
        return
    try:
        os.killpg(pid, sig)
    except (ProcessLookupError, PermissionError):
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            pass


def _signal_group(pgid: int, sig: int) -> bool:
    """Signal a process group only (never a lone pid that may have been reused); False if empty."""
    try:
        os.killpg(pgid, sig)
        return True
    except (ProcessLookupError, PermissionError):
        return False


def describe_status(exitcode: Optional[int], sig: Optional[int]) -> Tuple[str, int]:
    """A human description and the shell-style status (128+N for a signal)."""
    if sig is not None:
        try:
            name = signal.Signals(sig).name
        except ValueError:
            name = f"signal {sig}"
        return f"killed by {name}", 128 + sig
    return f"exit {exitcode}", int(exitcode or 0)
