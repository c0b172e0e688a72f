"""The host agent: one long-lived process per host that spawns and supervises procs.

Start it from any scheduler as ``python -m monarch_cli.runtime.agent --address-file F``
with the reservation keys in ``$MONARCH_KEYS``/``$MONARCH_KEY_FILE`` or on stdin. It binds
a free port, writes its address, and then:

* forks procs from its fork server (zygote, started at the first need) on request and reports
  each proc's exit (code or signal) to the process that owns it at once;
* kills a client's procs when the client says it exits or stops heartbeating, so no mesh
  outlives its owner;
* is a child subreaper: when a fork server (zygote) dies, its ranks and procs, killed with it,
  are re-parented here, reaped and reported with the cause, and the next need starts a new one;
* with ``--state-file``, registers itself (see :mod:`.registry`) and exits on its own
  once that state file no longer records its reservation.
* with ``--lease``, exits on its own unless a client holding the keys asks it something
  within that time (:mod:`.lease`: a ``serve`` killed before it saved the reservation).

This module is the core: the poll loop, clients and their heartbeats, the zygotes (each
through a :class:`~.forkserver.ForkServerHandle`). What the
agent answers is a table from message kind (:mod:`..protocol`) to handler, built at start-up
from what each part registers: :mod:`.procs` (procs), :mod:`.ranks` (SPMD runs),
:mod:`.debug`, :mod:`.telemetry`, :mod:`.sync`, :mod:`.relay`. A request of a kind nobody
registered is answered with an error naming it.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import shlex
import shutil
import signal
import socket
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import zmq

from ...config import KEY_FILE_ENV, configure
from ...sysutil import atomic_write, private_tmpdir
from ...version import __version__
from .. import protocol
from ..launch import command
from ..title import set_title
from ..transport import wire
from ..transport.keys import Keys, keys_from_environment
from ..transport.sockets import Transport, raise_fd_limit
from . import lineage, registry, sync
from .batches import EventBatches
from .debug import DebugHost
from .forkserver import ForkServerHandle
from .forwarding import ClientRoutes, LinkForwarder
from .lease import Lease, remove_own_directory
from .peers import PeerProbes
from .procs import ProcHost
from .ranks import RankHost
from .relay import FanOutRelay
from .telemetry import TelemetryHost
from .warm import WarmRanks

READY_PREFIX = command.READY_PREFIX
_STATE_FIRST_SEEN = 120.0
_FORWARD_SIZE = len(protocol.FORWARD)
#: ZeroMQ sockets the agent may hold: a relay keeps one per host it asks or forwards to, per client.
_MAX_SOCKETS = 16384  # seconds `serve` has to record a new agent in its state file


@dataclasses.dataclass
class _Client:
    last_seen: float
    timeout: float


class HostAgent:
    def __init__(
        self,
        keys: Keys,
        name: str | None = None,
        preload: str | None = None,
        reservation: str = "",
        port: int | None = None,
    ) -> None:
        self.keys = keys
        self.transport = Transport(keys, max_sockets=_MAX_SOCKETS)
        self.inbox, self.address = self.transport.bind_router(port)
        # One port per host: everything for a client goes back on the connection it opened
        # (its link names itself by its mailbox address); a client it cannot route to (gone,
        # or one that never linked) is sent to directly, as before.
        self.inbox.router_mandatory = True
        self.inbox.router_handover = True  # a client's reconnection (a restarted tunnel) takes its route over
        self.batches = EventBatches(self._send_now)
        self.host = name or socket.gethostname()
        self.label = f"{reservation} host {self.host}" if reservation else f"host {self.host}"
        lineage.become_subreaper()
        # The plain fork server (cold ranks, actor procs) starts when first asked for: a host
        # that only runs warm ranks never pays its ~15 MB.
        self._fork_server: ForkServerHandle | None = None
        self.preload = _default_preload() if preload is None else preload
        self.poller = zmq.Poller()
        self._zygotes: dict[int, ForkServerHandle] = {}  # every fork server watched, by socket fd
        self.warm = WarmRanks(
            self.host,
            self.preload,
            self._start_warm,
            self._watch_zygote,
            self._unwatch_zygote,
            running_since=lambda: self.ranks.running_since(),
        )
        self.procs = ProcHost(self)
        self.ranks: RankHost = RankHost(self)  # annotated: the lambda above reads it before it is set
        self.debug = DebugHost(self)
        self.telemetry = TelemetryHost(self)
        self.peers = PeerProbes(self)
        self.relay = FanOutRelay(self, lambda sock: self.poller.register(sock, zmq.POLLIN), self.poller.unregister)
        self.forwarder = LinkForwarder(
            self, lambda sock: self.poller.register(sock, zmq.POLLIN), self.poller.unregister
        )
        #: What this agent answers, by message kind: the core's own, then each part's.
        self.handlers: dict[str, Callable[[Any, list[Any]], None]] = {}
        for part in (
            self._handlers(),
            self.procs.handlers(),
            self.ranks.handlers(),
            self.debug.handlers(),
            self.telemetry.handlers(),
            self.peers.handlers(),
            self.relay.handlers(),
            sync.handlers(self),
        ):
            for cls, handler in part.items():
                kind = protocol.kind_of(cls)
                if kind in self.handlers:
                    raise RuntimeError(f"two agent handlers for {kind!r}")
                self.handlers[kind] = handler
        self.clients: dict[str, _Client] = {}
        self._signal_r: socket.socket | None = None
        self._socks: dict[str, zmq.Socket] = {}
        self.routes = ClientRoutes()  # how each client is answered: its link, or a relay's connection
        self._next_req = 0
        self.running = True
        self.reservation = reservation
        self.state_file: str | None = None
        self._state_check = (0.0, 0.0, 0)  # (interval, next check, misses in a row)
        self._state_seen_by: float | None = None  # until the file first records us: when to give up
        self.lease = Lease()  # (--lease: confirmed by the first request from a key holder)

    # ------------------------------------------------------------------ sending
    def send(self, address: str, msg: Any, body: list[Any] = ()) -> None:  # type: ignore[assignment]
        """A :mod:`..protocol` message to ``address``, through the connection it opened to us,
        else by connecting to it; a run's events are held to the round's end (:mod:`.batches`)."""
        if not self.batches.add(address, msg, body):
            self.send_frames(address, wire.frames((msg.KIND, *msg), body))

    def send_frames(self, address: str, frames: list[Any]) -> None:
        """A message's frames, as they are, to ``address`` (as :meth:`send`): the relay's path.
        What is held for ``address`` goes first."""
        if address in self.batches:
            self.batches.flush(address)
        self._send_now(address, frames)

    def _send_now(self, address: str, frames: list[Any]) -> None:
        try:
            self.inbox.send_multipart([*self.routes.to(address), *frames], copy=False)
            return
        except zmq.ZMQError as e:
            if e.errno != zmq.EHOSTUNREACH:
                raise
        sock = self._socks.get(address)
        if sock is None:
            sock = self._socks[address] = self.transport.dealer(address)
        sock.send_multipart(frames, copy=False)

    def reply(self, address: str, cid: int, ok: bool, value: Any) -> None:
        self.send(address, protocol.Result(cid, ok), wire.dumps(value if ok else (value, "", None)))

    # --------------------------------------------------------------------- loop
    def next_request(self) -> int:
        self._next_req += 1
        return self._next_req

    def rank_zygote(self) -> None:
        """Start the fork server for warm ranks now rather than at the first run."""
        self.warm.warm_up()

    def _start_warm(self, preload: str, learned: str | None, ready: str) -> ForkServerHandle:
        # Every warm process, the first and each re-warmed one, carries the same title.
        return ForkServerHandle(preload, title=f"monarch warm {self.label}", learned=learned, ready=ready)

    def _watch_zygote(self, zygote: ForkServerHandle) -> None:
        self._zygotes[zygote.sock.fileno()] = zygote
        self.poller.register(zygote.sock.fileno(), zmq.POLLIN)

    def _unwatch_zygote(self, zygote: ForkServerHandle) -> None:
        if self._zygotes.pop(zygote.sock.fileno(), None) is not None:
            self.poller.unregister(zygote.sock.fileno())
            zygote.sock.close()

    def fork_server(self) -> ForkServerHandle:
        """The plain fork server, started now if none is running (first use, or after it died)."""
        if self._fork_server is None:
            self._fork_server = ForkServerHandle(title=f"monarch fork-server {self.label}")
            self._watch_zygote(self._fork_server)
        return self._fork_server

    def _own_zygotes(self) -> list[ForkServerHandle]:
        plain = [] if self._fork_server is None else [self._fork_server]
        return [*plain, *self.warm.zygotes()]

    def zygote_pids(self) -> set[int]:
        return {z.process.pid for z in self._own_zygotes()}

    def watch_state_file(self, state_file: str, interval: float) -> None:
        """Exit once ``state_file`` no longer records this agent's reservation (local hosts only:
        elsewhere the controller's files are not visible)."""
        self.state_file = state_file
        self._state_check = (interval, time.monotonic() + interval, 0)
        self._state_seen_by = time.monotonic() + _STATE_FIRST_SEEN

    def watch_fd(self, fd: int) -> None:
        self.poller.register(fd, zmq.POLLIN)

    def unwatch_fd(self, fd: int) -> None:
        self.poller.unregister(fd)

    def wake_on_signals(self) -> None:
        """Make a signal (SIGTERM: stop) end the loop's wait at once, not at its next timeout
        (up to 0.2 s: for a machine of local agents stopped together, that was most of `stop`).
        Main thread only."""
        self._signal_r, w = socket.socketpair()
        self._signal_r.setblocking(False)
        w.setblocking(False)
        self._signal_w = w  # kept: the kernel writes to it
        signal.set_wakeup_fd(w.fileno(), warn_on_full_buffer=False)
        self.poller.register(self._signal_r.fileno(), zmq.POLLIN)

    @staticmethod
    def _drain_signals(signal_r: socket.socket) -> None:
        try:
            while signal_r.recv(512):
                pass
        except (BlockingIOError, InterruptedError, OSError):
            pass

    def close(self) -> None:
        """After :meth:`serve`: send what is still queued (a last reply) for up to 0.5 s, then
        close every socket."""
        self.transport.ctx.destroy(linger=500)

    def serve(self) -> None:
        poller = self.poller
        poller.register(self.inbox, zmq.POLLIN)
        poller.register(self.transport.zap, zmq.POLLIN)
        while self.running:
            dues = (self.ranks.next_due(), self.relay.next_due(), self.forwarder.next_due())
            due = min((d for d in dues if d is not None), default=None)
            wait_ms = 200 if due is None else max(0, min(200, int((due - time.monotonic()) * 1000) + 1))
            events = dict(poller.poll(wait_ms))
            if self._signal_r is not None and self._signal_r.fileno() in events:
                self._drain_signals(self._signal_r)
            if self.transport.zap in events:
                self.transport.serve_zap()
            for fd in [fd for fd in self._zygotes if fd in events]:
                if fd in self._zygotes:
                    self._from_zygote(self._zygotes[fd])
            for fd in self.ranks.live_fds() & events.keys():
                self.ranks.readable(fd)
            for fd in set(self.debug.by_fd) & events.keys():
                self.debug.readable(fd)
            for sock in [s for s in self.relay.socks if s in events]:
                self.relay.readable(sock)
            for sock in [s for s in self.forwarder.socks if s in events]:
                self.forwarder.readable(sock)
            if self.inbox in events:
                while True:
                    try:
                        frames = wire.recv_frames(self.inbox, zmq.NOBLOCK)
                    except zmq.Again:
                        break
                    try:
                        self._handle(frames)
                    except Exception as e:  # noqa: BLE001 - keep serving the other clients
                        print(f"monarch agent: bad request: {type(e).__name__}: {e}", file=sys.stderr)
            self.batches.flush_all()  # this round's output and exits, one message per client
            self.forwarder.flush()  # what the hosts behind us sent our clients this round
            self._check_clients()
            self.procs.tick()
            self._reap_adopted()
            self.ranks.tick()
            self.warm.tick()
            self._check_state_file()
            if self.lease.check():
                self.running = False
            self.telemetry.tick(events)
            self.peers.tick()
            self.relay.tick()
            self.batches.flush_all()  # what the ticks reported (exits after the EOF grace, telemetry)
        self.telemetry.close()
        self.relay.close()
        self.forwarder.close()
        self.procs.kill_all()
        self.ranks.kill_all()
        lineage.kill_tree()  # whatever else is below us, even in sessions of its own
        if self._fork_server is not None:
            self._fork_server.kill()
        self.warm.close()

    def _handle(self, frames: list[zmq.Frame]) -> None:
        self.lease.confirm()  # (only holders of the reservation's keys get past CURVE)
        if len(frames) > 2 and len(frames[1]) == _FORWARD_SIZE and frames[1].bytes == protocol.FORWARD:
            self.forwarder.forward(frames[0].bytes, frames[1:])
            return
        head, body = wire.parse(frames[1:])
        try:
            msg = protocol.decode(head)
            handler = self.handlers[msg.KIND] if msg.KIND != "heartbeat" else None
        except (KeyError, TypeError):  # a newer client, most likely: tell it, if it waits for an answer
            self._refuse(head)
            return
        if not self.routes.note(frames[0].bytes, msg):
            print(
                f"monarch agent: refused a {msg.KIND} from a relay that named a client with its own link",
                file=sys.stderr,
                flush=True,
            )
            return
        if handler is None:  # answered on the connection it came on, whoever that is
            self._heartbeat(frames[0].bytes, msg.client)
        else:
            handler(msg, body)

    def _refuse(self, head: tuple[Any, ...]) -> None:
        why = protocol.not_understood(head, f"the host agent on {self.host}")
        answer = protocol.answer_to(head)
        if answer is None:
            print(f"monarch agent: {why}", file=sys.stderr, flush=True)
        else:
            self.reply(answer[1], answer[0], False, why)

    # -------------------------------------------------------- the core's requests
    def _handlers(self) -> dict[type, Callable[[Any, list[Any]], None]]:
        return {
            protocol.Ping: lambda m, _: self.reply(m.reply_to, m.cid, True, self.info()),
            protocol.ForgetPreload: lambda m, _: self.reply(m.reply_to, m.cid, True, self.warm.forget()),
            protocol.WarmHints: lambda m, _: self.reply(m.reply_to, m.cid, True, self.warm.hint(list(m.modules))),
            protocol.LearnedModules: lambda m, _: self.reply(m.reply_to, m.cid, True, self.warm.store.names()),
            protocol.ClientExit: lambda m, _: self._reap_client(m.client, "client exited"),
            protocol.Shutdown: self._on_shutdown,
        }

    def _on_shutdown(self, msg: protocol.Shutdown, _body: list[Any]) -> None:
        self.reply(msg.reply_to, msg.cid, True, None)
        self.running = False

    def register_client(self, addr: str, heartbeat_timeout: float) -> None:
        """Track ``addr``'s heartbeats; when they stop, it is reaped (its procs, ranks and holds
        go). The request that registers it is itself a sign of life, so its clock starts afresh
        even if it is tracked already: a client heartbeats only while it has something running
        here, and a run asked for just under the timeout after its last heartbeat was otherwise
        reaped at the next check, its new ranks SIGKILLed as they started (seen in the suite)."""
        self.clients[addr] = _Client(time.monotonic(), heartbeat_timeout)

    def info(self) -> dict[str, Any]:
        from ...config import advertised_host

        return {
            "host": self.host,
            "version": __version__,  # a client of another version refuses to drive this agent
            "addr": advertised_host(),
            "pid": os.getpid(),
            "procs": len(self.procs.by_pid),
            "ranks": len(self.ranks.by_pid),
            "cpus": os.cpu_count() or 1,
            "gpus": _count_gpus(),
            "preload": self.preload,
            "warm": self.warm.info(),
            **self.telemetry.info(),
        }

    def _heartbeat(self, route: bytes, client_addr: str) -> None:
        client = self.clients.get(client_addr)
        if client is not None:
            client.last_seen = time.monotonic()
        try:
            self.inbox.send_multipart([*self.routes.back(route, client_addr), protocol.HEARTBEAT_ACK])
        except zmq.ZMQError:  # its connection closed meanwhile
            pass

    def _from_zygote(self, zygote: ForkServerHandle) -> None:
        msg = zygote.receive()
        if msg is None:
            self._zygote_died(zygote)
            return
        if self.warm.on_message(zygote, msg):
            return
        if msg.KIND == "forked":
            if not self.ranks.forked(msg.req_id, msg.pid):
                self.procs.forked(msg.req_id, msg.pid)
        elif msg.KIND == "exit":
            self._child_exited(msg.pid, msg.status)

    def _child_exited(self, pid: int, status: int) -> None:
        if not self.ranks.exited(pid, status):
            self.procs.exited(pid, status)

    def _zygote_died(self, zygote: ForkServerHandle) -> None:
        """Its children die with it (PDEATHSIG) and come to us to be reaped: report them with
        the cause; what comes next starts a new one."""
        warm = zygote is not self._fork_server
        if not warm:
            self._unwatch_zygote(zygote)
        cause = f"{'warm process' if warm else 'fork server'} on {self.host} died ({zygote.how_it_died()})"
        print(f"monarch agent: the {cause}; a new one takes its place", file=sys.stderr, flush=True)
        self.ranks.zygote_died(zygote.process.pid, cause)
        if warm:
            in_use = self.warm.gone(zygote)  # unwatches it
            if in_use and time.monotonic() - zygote.started > 10:  # else the next run starts it: no crash loop
                self.rank_zygote()
            return
        self.procs.zygote_died(cause)
        self._fork_server = None  # the next cold rank or proc starts one

    def _reap_adopted(self) -> None:
        own = {z.process.pid: z.process for z in self._own_zygotes()}
        for pid, status in lineage.reap_adopted(own):
            self._child_exited(pid, status)

    def _check_state_file(self) -> None:
        interval, next_check, misses = self._state_check
        if self.state_file is None or time.monotonic() < next_check:
            return
        present = registry.reservation_present(self.state_file, self.reservation)
        if present and self._state_seen_by is not None:
            self._state_seen_by = None  # `serve` saves the file once every agent is up
        waiting = self._state_seen_by is not None and time.monotonic() < self._state_seen_by
        misses = misses + 1 if present is False and not waiting else 0
        self._state_check = (interval, time.monotonic() + interval, misses)
        if misses >= 2:  # twice in a row: not a state file being rewritten
            print(
                f"monarch agent: {self.state_file} no longer records reservation {self.reservation}; exiting",
                file=sys.stderr,
                flush=True,
            )
            self.running = False

    def _check_clients(self) -> None:
        now = time.monotonic()
        for addr, client in list(self.clients.items()):
            if now - client.last_seen > client.timeout:
                self._reap_client(addr, f"no heartbeat for {now - client.last_seen:.1f} s")

    def _reap_client(self, addr: str, why: str) -> None:
        self.clients.pop(addr, None)
        self.forwarder.client_gone(addr)
        self.routes.forget(addr)
        self.procs.reap_owner(addr, why)
        self.ranks.reap_owner(addr)
        self.debug.client_gone(addr)
        sock = self._socks.pop(addr, None)
        if sock is not None:
            sock.close(linger=0)


def _default_preload() -> str:
    """Preload torch into warm ranks when it is installed (checked without importing it)."""
    import importlib.util

    return "torch" if importlib.util.find_spec("torch") is not None else ""


def _count_gpus() -> int:
    """NVIDIA devices visible to this host (no torch import: the agent stays light)."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None:
        return len([d for d in visible.split(",") if d.strip() and d.strip() != "-1"])
    try:
        return len([n for n in os.listdir("/dev") if n.startswith("nvidia") and n[6:].isdigit()])
    except OSError:
        return 0


def _watch_stdin(agent: HostAgent) -> None:
    while sys.stdin.buffer.read(4096):
        pass
    plain = agent._fork_server  # (its procs follow it, PDEATHSIG; warm processes follow us)
    if plain is not None:
        plain.kill()
    os._exit(0)


def _compile_caches() -> str | None:
    """torch.compile's on-disk caches (inductor's graphs and kernels, Triton's binaries) in one
    private directory per reservation, shared by all its runs and ranks, unless the user chose
    one: a re-run of a compiled script finds what the last one compiled, and no other user can
    plant code there (torch's default, ``/tmp/torchinductor_<user>``, is a name anyone can take
    first). Set in the agent's own environment before any warm process starts, so the warm
    process's torch and every rank see the same value."""
    if os.environ.get("TORCHINDUCTOR_CACHE_DIR"):
        return None
    root = private_tmpdir("compile")
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = os.path.join(root, "inductor")
    os.environ.setdefault("TRITON_CACHE_DIR", os.path.join(root, "triton"))
    return root


def main(argv: list[str] | None = None) -> int:
    parser = command.parser()
    parser.add_argument("--state-check-interval", type=float, default=2.0, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.port_range:
        configure(port_range=args.port_range)
    if args.host:
        configure(host=args.host)
    try:
        if args.keys_stdin:
            keys: Keys | None = Keys.decode(sys.stdin.readline())
        else:
            keys = keys_from_environment()
    except (ValueError, OSError) as e:
        print(f"monarch agent: cannot read the reservation keys: {e}", file=sys.stderr)
        return 2
    if keys is None:
        print(f"monarch agent: no reservation keys (set {KEY_FILE_ENV} or pass --keys-stdin)", file=sys.stderr)
        return 2
    signal.signal(signal.SIGTERM, lambda *_: setattr(agent, "running", False))
    raise_fd_limit()  # (hundreds of ranks on one host: a few fds each)
    try:
        agent = HostAgent(keys, name=args.name, preload=args.preload, reservation=args.reservation, port=args.port)
    except OSError as e:
        print(f"monarch agent: {e}", file=sys.stderr)
        return 2
    agent.wake_on_signals()
    # The title below replaces the command line in ps; the log keeps what was started.
    print(f"monarch agent: started as: {shlex.join(sys.orig_argv)}", file=sys.stderr, flush=True)
    set_title(f"monarch agent {agent.label}")
    registered: Path | None = None
    if args.state_file and args.reservation:
        registered = registry.register(args.state_file, args.reservation, agent.host)
        agent.watch_state_file(args.state_file, args.state_check_interval)
    agent.lease = Lease(args.lease)
    caches = _compile_caches()
    if args.warm_up:
        agent.rank_zygote()
    if args.exit_with_stdin:
        threading.Thread(target=_watch_stdin, args=(agent,), daemon=True).start()
    line = f"{READY_PREFIX}{agent.address}\n"
    if args.address_file:
        atomic_write(args.address_file, line, 0o600)  # (read back by its starter, the same user)
    if args.ready_fd is not None:
        os.write(args.ready_fd, line.encode())
        os.close(args.ready_fd)
    if not args.address_file and args.ready_fd is None:
        print(line, end="", flush=True)
    try:
        agent.serve()
    finally:
        if registered is not None:
            registered.unlink(missing_ok=True)
        if caches is not None:
            shutil.rmtree(caches, ignore_errors=True)
    agent.close()
    if agent.lease.ran_out:
        remove_own_directory(args.reservation)
    return 0
