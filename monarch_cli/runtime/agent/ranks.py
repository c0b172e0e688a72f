"""The agent's side of SPMD runs: start ranks, forward their output, report their exits.

Ranks are forked from a zygote that has already imported the preloaded modules (torch by
default), or, for cold runs, forked from the plain zygote and ``exec``'d into a fresh
interpreter. Output travels as raw bytes, in order; a rank's exit is reported only after
both of its pipes reach EOF (or a short grace if a grandchild keeps them open), so no line
can arrive after the exit that ended it.

When a run ends here, what its ranks left running ends with it: their process groups, and
(the agent being a child subreaper) every descendant seen under a rank or carrying the
run's ``MONARCH_RUN_ID``, even one that started its own session.

Output is flow-controlled per run: at most :data:`OUTPUT_WINDOW` bytes travel ahead of the
client's ``output_credit`` messages (sent as it prints them). Past that, the ranks' pipes
are not read, so a rank writing faster than the client's console takes it blocks in
``write()``, as it would under torchrun, instead of every process between them buffering
without bound. Output and exits leave through ``agent.send``, which holds them to the end of
the loop's round and sends them to each client as one message (:mod:`.batches`); the byte
count above is taken as they are read, so batching does not change it.
"""

from __future__ import annotations

import dataclasses
import os
import signal
import socket
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from ...config import PREFIX
from .. import bundle_site, protocol
from ..exit_status import describe_status, from_wait_status
from ..transport import wire
from . import lineage, network

if TYPE_CHECKING:
    from .core import AgentCore

_READ = 1 << 16
#: Bytes of one run's output a host sends ahead of the client's credit.
OUTPUT_WINDOW = 8 << 20
_EOF_GRACE = 2.0  # seconds to wait for pipes after a rank exits
#: Spares are asked for this long after a run ended here, not at once: forking them (a few ms of
#: CPU each) beside the client's own end of the run slowed that end by ~10 ms on 2 cores, and the
#: next run from the CLI comes ~0.1 s later at the earliest.
SPARES_AFTER_S = 0.05
_SCAN_EVERY = 1.0  # seconds between looks at the live ranks' descendants
_PORT_HOLD = 300.0  # a reserved port no run claims is closed after this long
#: Read once, at interpreter start-up: a warm rank inherits the zygote's values, so when the
#: rank's environment asks for others it must start cold to get them (e.g. a PYTHONPATH or
#: PYTHONHASHSEED exported after `monarch serve`).
_START_UP_ENV = (
    "PYTHONPATH",
    "PYTHONHOME",
    "PYTHONHASHSEED",
    "PYTHONOPTIMIZE",
    "PYTHONDEBUG",
    "PYTHONVERBOSE",
    "PYTHONDONTWRITEBYTECODE",
    "PYTHONNOUSERSITE",
    "PYTHONUSERBASE",
    "PYTHONSAFEPATH",
    "PYTHONWARNINGS",
    "PYTHONDEVMODE",
    "PYTHONUTF8",
    "PYTHONCOERCECLOCALE",
    "PYTHONMALLOC",
    "PYTHONTRACEMALLOC",
    "PYTHONFAULTHANDLER",
    "PYTHONINTMAXSTRDIGITS",
    "PYTHONPLATLIBDIR",
    "PYTHONPYCACHEPREFIX",
    "PYTHONWARNDEFAULTENCODING",
    "PYTHONNODEBUGRANGES",
    "PYTHONPROFILEIMPORTTIME",
)
#: Of those, the ones a warm rank sets for itself as it starts (``rank_start._apply_start_up_env``):
#: they never make a run cold (many images export PYTHONDONTWRITEBYTECODE=1, and an SSH host's
#: agent does not get the client's shell environment, so every run would be cold).
_SET_IN_A_WARM_RANK = frozenset(
    {"PYTHONDONTWRITEBYTECODE", "PYTHONPYCACHEPREFIX", "PYTHONINTMAXSTRDIGITS", "PYTHONFAULTHANDLER"}
)


@dataclasses.dataclass
class _Rank:
    run_id: str
    rank: int
    owner: str
    started: float
    fds: dict[int, int]  # read fd -> stream (1 stdout, 2 stderr)
    pid: int | None = None
    status: int | None = None
    exited_at: float | None = None
    zygote_pid: int = 0  # the fork server it came from
    cause: str = ""  # why it ended, when not by itself (its warm process died)
    sampled: bool = False  # its client records telemetry: the agent samples it each second
    #: Signals sent to the run before this rank's fork completed: delivered once it has a pid,
    #: so a run stopped early never waits for a rank nobody signalled.
    signals: list[int] = dataclasses.field(default_factory=list)


class RankHost:
    def __init__(self, agent: AgentCore) -> None:
        self.agent = agent
        self.pending: dict[int, _Rank] = {}  # fork request -> rank
        self.by_pid: dict[int, _Rank] = {}
        self.by_fd: dict[int, _Rank] = {}
        self.ports: dict[str, socket.socket] = {}  # run id -> held listening socket
        self.groups: dict[str, list[int]] = {}  # run id -> its ranks' process groups here (pgid == pid)
        self.reaping: dict[int, float] = {}  # process group left behind by a run -> when to SIGKILL it
        self.in_flight: dict[str, int] = {}  # run id -> output bytes sent and not yet credited
        self.held: dict[str, set[int]] = {}  # run id -> pipes not read until credit comes back
        self.unthrottled: set[str] = set()  # runs whose client is gone: nobody will credit them
        self.port_held_at: dict[str, float] = {}
        self.tracked: dict[str, set[lineage.Pid]] = {}  # run id -> descendants seen under its ranks
        self.leftovers: dict[lineage.Pid, float] = {}  # a run's leftover process -> when to SIGKILL it
        self.kept: set[int] = set()  # kept ranks between runs (their process groups are left alone)
        self.warm_forks: dict[str, int] = {}  # run id -> its warm ranks here (the spares to keep after it)
        self.spares_due: list[tuple[float, int]] = []  # (when, how many warm ranks the run had) to ask for
        self._next_scan = 0.0

    # ---------------------------------------------------------------- requests
    def handlers(self) -> dict[type, Callable[[Any, list[Any]], None]]:
        """The messages this part of the agent answers."""
        agent = self.agent
        return {
            protocol.ReservePort: lambda m, _: agent.reply(m.reply_to, m.cid, True, self.reserve_port(m.run_id)),
            protocol.ReleasePort: lambda m, _: agent.reply(m.reply_to, m.cid, True, self.release_port(m.run_id)),
            protocol.RunRanks: self._on_run_ranks,
            protocol.OutputCredit: lambda m, _: self.credit(m.run_id, int(m.nbytes)),
            protocol.SignalRanks: lambda m, _: agent.reply(
                m.reply_to, m.cid, True, self.signal_run(m.run_id, m.signal)
            ),
            # The reservation is being released: tell running runs who did it.
            protocol.Stopping: lambda m, _: agent.reply(m.reply_to, m.cid, True, self.announce_stop(m.who)),
        }

    def _on_run_ranks(self, msg: protocol.RunRanks, body: list[Any]) -> None:
        self.agent.register_client(msg.reply_to, msg.heartbeat_timeout)
        self.agent.reply(msg.reply_to, msg.cid, True, self.start(msg.reply_to, msg.run_id, wire.loads(body)))

    def reserve_port(self, run_id: str) -> int:
        """Bind and listen now, keep it open, hand the socket to rank 0 later: no race."""
        from ...config import advertised_host, bind_port_candidates

        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        candidates = bind_port_candidates()
        for i, port in enumerate(candidates):
            try:
                sock.bind((advertised_host(), port))
                break
            except OSError:
                if i == len(candidates) - 1:
                    sock.close()
                    raise
        sock.listen(128)
        self.ports[run_id] = sock
        self.port_held_at[run_id] = time.monotonic()
        return sock.getsockname()[1]

    def release_port(self, run_id: str) -> bool:
        """Close a reserved port whose run will not start (e.g. the controller refused it)."""
        sock = self.ports.pop(run_id, None)
        self.port_held_at.pop(run_id, None)
        if sock is not None:
            sock.close()
        return sock is not None

    def start(self, owner: str, run_id: str, specs: list[protocol.RankSpec]) -> dict[str, list[str]]:
        """Start the ranks; returns ``made_cold``, the start-up variables that made warm ranks
        start cold, and ``notices`` for the user (e.g. a fresh warm process, and why)."""
        from ..rank import preload  # (the agent's side; controllers import this module too)

        held = self.ports.pop(run_id, None)
        self.port_held_at.pop(run_id, None)
        base = {k: v for k, v in os.environ.items() if not k.startswith(PREFIX)}
        made_cold: set[str] = set()
        notices: list[str] = []
        warm_zygote: Any = None
        for spec in specs:
            # The controller's view wins: its host-wide base, then the rank's own variables.
            spec["env"] = {**base, **spec.pop("env_base", {}), **spec["env"], lineage.RUN_ENV: run_id}
            network.set_socket_ifname(spec["env"])  # unless the user set them
            bundle_site.keep_importable(spec["env"])  # a user's PYTHONPATH still finds shipped code
            differ = [
                k for k in _START_UP_ENV if k not in _SET_IN_A_WARM_RANK and spec["env"].get(k) != os.environ.get(k)
            ]
            if spec["warm"] and differ:
                spec["warm"] = False  # the zygote's interpreter was started with other settings
                made_cold.update(differ)
            if not os.path.isdir(spec["cwd"]):
                spec["cwd"] = os.getcwd()
            out_r, out_w = os.pipe()
            err_r, err_w = os.pipe()
            devnull = os.open(os.devnull, os.O_RDONLY)
            fds = [devnull, out_w, err_w]
            roles: dict[str, int] = {}
            if held is not None and spec.get("host_store"):
                roles["listen"] = len(fds)
                fds.append(held.fileno())
            debug_ours: socket.socket | None = None
            if spec["mode"] != "no_python":
                debug_ours, debug_theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
                roles["debug"] = len(fds)
                fds.append(debug_theirs.fileno())
            spec["_fd_roles"] = roles
            if spec["warm"]:
                if warm_zygote is None:
                    warm_zygote, notices = self.agent.warm.for_run(bool(spec.get("keep")))
                if self.agent.warm.learning:
                    spec[preload.REPORT_KEY] = self.agent.warm.report_path(run_id, spec["rank"])
            zygote = warm_zygote if spec["warm"] else self.agent.fork_server()
            rank = _Rank(
                run_id,
                spec["rank"],
                owner,
                time.monotonic(),
                {out_r: 1, err_r: 2},
                zygote_pid=zygote.process.pid,
                sampled=bool(spec.get("telemetry")),
            )
            req = self.agent.next_request()
            self.pending[req] = rank
            zygote.fork(req, spec, fds, kind="rank" if spec["warm"] else "cold")
            if spec["warm"]:
                self.agent.warm.fork_asked(zygote)
                self.warm_forks[run_id] = self.warm_forks.get(run_id, 0) + 1
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
        for rank in self.pending.values():  # still being forked (its warm process is busy)
            if rank.run_id == run_id:
                rank.signals.append(sig)
                hit += 1
        return hit

    def announce_stop(self, who: str) -> list[str]:
        """Tell each run with ranks here that ``who`` is releasing the reservation; returns those runs.

        Sent as :class:`~..protocol.ReservationStopped` before the agent is stopped, so the run
        ends saying why instead of as a lost host.
        """
        runs: dict[tuple[str, str], None] = {}
        for rank in (*self.by_pid.values(), *self.pending.values()):
            if rank.status is None:
                runs[(rank.owner, rank.run_id)] = None
        for owner, run_id in runs:
            self.agent.send(owner, protocol.ReservationStopped(run_id, self.agent.address, who))
        return sorted({run_id for _, run_id in runs})

    def reap_owner(self, owner: str) -> None:
        for rank in self.by_pid.values():
            if rank.owner == owner and rank.status is None:
                _killpg(rank.pid, signal.SIGKILL)
        for run_id in {r.run_id for r in self.by_pid.values() if r.owner == owner}:
            self.unthrottled.add(run_id)  # nobody will credit it: let the pipes drain to their end
            self.credit(run_id, self.in_flight.get(run_id, 0))

    def credit(self, run_id: str, nbytes: int) -> None:
        """The client has printed ``nbytes`` more of the run's output: read held pipes again."""
        if run_id not in self.in_flight:
            return  # the run has ended here
        self.in_flight[run_id] = max(0, self.in_flight[run_id] - nbytes)
        if self.in_flight[run_id] < OUTPUT_WINDOW:
            for fd in self.held.pop(run_id, ()):
                if fd in self.by_fd:
                    self.agent.watch_fd(fd)

    def kill_all(self) -> None:
        for rank in self.by_pid.values():
            if rank.status is None:
                _killpg(rank.pid, signal.SIGKILL)
        for pgid in [*self.reaping, *(g for groups in self.groups.values() for g in groups)]:
            _signal_group(pgid, signal.SIGKILL)
        for proc in [*self.leftovers, *(p for seen in self.tracked.values() for p in seen)]:
            lineage.signal_exact(proc, signal.SIGKILL)

    def zygote_died(self, zygote_pid: int, cause: str) -> None:
        """The fork server of some ranks died: they die with it (PDEATHSIG) and, re-parented
        to the agent, are reaped and reported with ``cause``; ranks it never forked are
        reported now."""
        for rank in self.by_pid.values():
            if rank.zygote_pid == zygote_pid and rank.status is None:
                rank.cause = cause
        for req, rank in list(self.pending.items()):
            if rank.zygote_pid == zygote_pid:
                del self.pending[req]
                for fd in list(rank.fds):
                    self._close(fd)
                rank.cause = f"{cause} before starting it"
                self.agent.debug.rank_exited(rank.run_id, rank.rank, rank.cause)
                self._send_exit(rank, None, None)
                self._end_run(rank.run_id)

    # ------------------------------------------------------------------ events
    def forked(self, req: int, pid: int) -> bool:
        rank = self.pending.pop(req, None)
        if rank is None:
            return False
        rank.pid = pid
        self.kept.discard(pid)  # (a kept rank handed this run)
        self.by_pid[pid] = rank
        self.groups.setdefault(rank.run_id, []).append(pid)
        self.agent.debug.set_pid(rank.run_id, rank.rank, pid)
        for sig in rank.signals:
            _killpg(pid, sig)
        return True

    def exited(self, pid: int, status: int) -> bool:
        rank = self.by_pid.get(pid)
        if rank is None:
            return False
        rank.status = status
        rank.exited_at = time.monotonic()
        self._maybe_report(rank)
        return True

    def exiting(self, pid: int, status: int, kept: bool = False) -> None:
        """A warm rank said, as its last act, that it exits with ``status`` and has closed its
        output: it is reported as soon as its pipes say so too. Tearing down a process forked
        from a warm process of hundreds of MB takes the kernel 3-10 ms, and the fork server's
        ``exit`` comes after that (and is then not needed: it finds the rank reported). A kept
        rank (``--keep-ranks``) does not exit: it waits for the next run, and the end of this one
        leaves it (and what its libraries started under it) alone."""
        rank = self.by_pid.get(pid)
        if rank is None or rank.status is not None:
            return
        if kept:
            self.kept.add(pid)
            self.agent.warm.rank_kept(rank.zygote_pid)
        rank.status = (status & 0xFF) << 8  # a wait status, as ``waitpid`` would give it
        rank.exited_at = time.monotonic()
        self._maybe_report(rank)

    def readable(self, fd: int) -> bool:
        rank = self.by_fd.get(fd)
        if rank is None:
            return False
        sent = self.in_flight.setdefault(rank.run_id, 0)
        if sent >= OUTPUT_WINDOW and rank.run_id not in self.unthrottled:  # the client is behind: wait
            held = self.held.setdefault(rank.run_id, set())
            if fd not in held:
                held.add(fd)
                self.agent.unwatch_fd(fd)
            return True
        try:
            data = os.read(fd, _READ)
        except BlockingIOError:
            return True
        if data:
            self.in_flight[rank.run_id] = sent + len(data)
            self.agent.send(rank.owner, protocol.Output(rank.run_id, rank.rank, rank.fds[fd]), [data])
        else:
            self._close(fd)
            self._maybe_report(rank)
        return True

    def next_due(self) -> float | None:
        """When :meth:`tick` has something to do before its usual round (spares to ask for)."""
        return min((due for due, _ in self.spares_due), default=None)

    def tick(self) -> None:
        """Report ranks whose pipes a grandchild still holds open after the grace period;
        SIGKILL what is left of finished runs; note the live ranks' descendants; ask for spares."""
        now = time.monotonic()
        while self.spares_due and self.spares_due[0][0] <= now:
            _, count = self.spares_due.pop(0)
            busy = {r.zygote_pid for r in (*self.pending.values(), *self.by_pid.values())}
            self.agent.warm.keep_spares(count, busy)  # (a busy warm process: at the end of that run)
        for run_id, held_at in list(self.port_held_at.items()):
            if now - held_at > _PORT_HOLD:
                self.release_port(run_id)
        for proc, kill_at in list(self.leftovers.items()):
            if now >= kill_at:
                del self.leftovers[proc]
                lineage.signal_exact(proc, signal.SIGKILL)
        if now >= self._next_scan:
            self._next_scan = now + _SCAN_EVERY
            self._track_descendants()
        for pgid, kill_at in list(self.reaping.items()):
            if now >= kill_at:
                del self.reaping[pgid]
                if pgid not in self.by_pid:  # never a new rank that got the same pid
                    _signal_group(pgid, signal.SIGKILL)
        for rank in list(self.by_pid.values()):
            if self.held.get(rank.run_id) or (
                self.in_flight.get(rank.run_id, 0) >= OUTPUT_WINDOW and rank.run_id not in self.unthrottled
            ):
                continue  # the client is behind: what is in the pipes waits for it, not the grace
            if rank.exited_at is not None and rank.fds and now - rank.exited_at > _EOF_GRACE:
                for fd in list(rank.fds):
                    self.readable(fd)  # whatever is buffered still goes out first
                    if fd in rank.fds:  # readable() closes it itself at end of file
                        self._close(fd)
                self._maybe_report(rank)

    def _close(self, fd: int) -> None:
        rank = self.by_fd.pop(fd, None)
        if rank is None:  # closed already: the number may belong to a new file by now
            return
        rank.fds.pop(fd, None)
        held = self.held.get(rank.run_id, set())
        if fd in held:
            held.discard(fd)  # not watched while held
        else:
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
        exitcode, sig = from_wait_status(status)
        self.agent.debug.rank_exited(rank.run_id, rank.rank, describe_status(exitcode, sig)[0])
        self.agent.telemetry.rank_ended(rank)  # its last step records go out before its exit
        self._send_exit(rank, exitcode, sig)
        self._end_run(rank.run_id)

    def _send_exit(self, rank: _Rank, exitcode: int | None, sig: int | None) -> None:
        duration = (rank.exited_at or time.monotonic()) - rank.started
        self.agent.send(
            rank.owner, protocol.RankExited(rank.run_id, rank.rank, exitcode, sig, duration, rank.pid, rank.cause)
        )

    def _track_descendants(self) -> None:
        live = [r for r in self.by_pid.values() if r.status is None and r.pid is not None]
        if not live:
            return
        for rank in live:
            self.tracked.setdefault(rank.run_id, set()).update(lineage.descendants([rank.pid]))  # type: ignore[list-item]

    def _end_run(self, run_id: str) -> None:
        """Once every rank of a run here has ended, end what they left running, as torchrun
        does: SIGTERM to each rank's process group, SIGKILL to what is left a grace later."""
        if any(r.run_id == run_id for r in (*self.by_pid.values(), *self.pending.values())):
            return
        self.agent.warm.learn(run_id)
        forked = self.warm_forks.pop(run_id, 0)
        if forked:  # the next run, likely the same, starts from spares
            self.spares_due.append((time.monotonic() + SPARES_AFTER_S, forked))
        self.in_flight.pop(run_id, None)
        self.held.pop(run_id, None)
        self.unthrottled.discard(run_id)
        kill_at = time.monotonic() + _EOF_GRACE
        for pgid in self.groups.pop(run_id, ()):
            if pgid not in self.kept and _signal_group(pgid, signal.SIGTERM):
                self.reaping[pgid] = kill_at
        # Those that left the group (setsid): seen under a rank, or carrying the run's id.
        under_agent = lineage.descendants([os.getpid()])
        ours = {p for p in under_agent if p[0] in self.agent.zygote_pids() or p[0] in self.by_pid}
        ours |= {p for p in under_agent if p[0] in self.kept} | lineage.descendants(self.kept)
        left = (self.tracked.pop(run_id, set()) | lineage.carrying(run_id, under_agent - ours)) - ours
        for proc in left:
            if lineage.signal_exact(proc, signal.SIGTERM):
                self.leftovers[proc] = kill_at

    def running_since(self) -> float | None:
        """When the oldest rank still running here started (``time.monotonic()``), if any."""
        live = [r.started for r in (*self.by_pid.values(), *self.pending.values()) if r.status is None]
        return min(live, default=None)

    def live_fds(self) -> set[int]:
        return set(self.by_fd)


def _killpg(pid: int | None, sig: int) -> None:
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
