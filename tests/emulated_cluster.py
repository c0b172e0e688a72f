"""An emulated cluster: thousands of host agents served from a few processes (test infrastructure).

Each emulated agent is a real CURVE ROUTER on its own TCP port, authenticated with the
reservation's keys by a real ZAP handler, speaking the real wire protocol
(:mod:`monarch_cli.runtime.protocol`, :mod:`monarch_cli.runtime.transport.wire`): the client cannot tell
it from a real agent. It batches a run's events as a real agent does
(:mod:`monarch_cli.runtime.agent.batches`): what one round of its socket produced, one message. What it does not do is run anything: a rank "runs" as its environment
says and ends at once:

* ``EMULATED_OUTPUT``: what every rank prints on stdout (``{rank}`` is replaced by its rank);
* ``EMULATED_EXIT``: ``RANK=STATUS,...``, a rank's exit code, or a signal name (``17=SIGSEGV``);
  the others exit 0;
* ``EMULATED_HANG=1``: ranks run until signalled (``signal_ranks``), then die of that signal.

It answers ``ping`` (host info), ``fan_out`` (relaying as a real agent does), heartbeats, ``reserve_port``/``release_port``, ``probe_peers`` (every peer reached), ``run_ranks``,
``signal_ranks``, ``stopping``, ``telemetry_stacks``/``telemetry_sample``, ``client_exit``,
``forget_preload`` and ``shutdown``. A process serves up to :data:`PER_PROCESS` agents; it is
titled ``monarch agent ...`` so the local backend's probe sees a live agent, and it reads
control lines on stdin after the keys: ``mute NAME`` stops that agent answering heartbeats and passing on
what it relays (a lost host), ``freeze NAME`` stops it answering anything, ``unmute NAME`` undoes either; a line ``NAME`` in ``<address file>.mute`` mutes, a control line there acts
(checked every 0.1-0.2 s, for a process that does not hold the stdin). It exits when its stdin
closes or on SIGTERM.

From a test or benchmark: :func:`emulated_job` starts the processes and writes a job state
(scheduler ``local``) that :func:`monarch_cli.jobs.job_load` reads like any other.
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

#: Emulated agents per process.
PER_PROCESS = 512


# ----------------------------------------------------------------------- the emulator
class _Agent:
    def __init__(self, name: str, sock: Any, address: str) -> None:
        from monarch_cli.runtime.agent.batches import EventBatches

        self.name = name
        self.sock = sock
        self.address = address
        self.muted = False
        self.frozen = False  # answers nothing (``freeze NAME``): a host hung or gone
        self.relay: Any = None  # its FanOutRelay, made at its first ``fan_out``
        self.forwarder: Any = None  # its LinkForwarder, made at its first forwarded message
        self.hung: dict[str, list[tuple[int, str]]] = {}  # run_id -> [(rank, owner)]
        #: As a real agent: a run's events of one round (all it read from its socket) in one message.
        self.batches = EventBatches(self._send_now)
        from monarch_cli.runtime.agent.forwarding import ClientRoutes

        self.routes = ClientRoutes()  # as a real agent: a client is answered the way its last message came

    def _send_now(self, to: str, frames: list[Any]) -> None:
        import zmq

        try:
            self.sock.send_multipart([*self.routes.to(to), *frames], copy=False)
        except zmq.ZMQError:  # that client is gone
            pass


class _RelayCore:
    """What runtime/agent/relay.py needs of an agent (``core.AgentCore``'s part), for an emulated one."""

    def __init__(self, emulator: _Emulator, agent: _Agent) -> None:
        self._emulator = emulator
        self._agent = agent
        self.address = agent.address
        self.transport = emulator.transport

    def reply(self, address: str, cid: int, ok: bool, value: Any) -> None:
        self._emulator._reply(self._agent, address, cid, ok, value)

    def send_frames(self, address: str, frames: list[Any]) -> None:
        self._agent.batches.flush(address)  # what is held goes first, as a real agent's does
        self._agent._send_now(address, frames)


class _Emulator:
    def __init__(self, keys: Any, names: list[str]) -> None:
        import zmq

        from monarch_cli.runtime.transport.sockets import Transport

        self.zmq = zmq
        # A socket per agent, per relay connection kept, and per host a relay forwards to for each client.
        self.transport = Transport(keys, max_sockets=4 * len(names) + 4096)
        self.agents: list[_Agent] = []
        self.by_sock: dict[Any, _Agent] = {}
        for name in names:
            sock, address = self.transport.bind_router()
            sock.router_mandatory = True
            sock.router_handover = True
            agent = _Agent(name, sock, address)
            self.agents.append(agent)
            self.by_sock[sock] = agent
        self.running = True
        self.started = time.time()
        # Relaying (``fan_out``): each agent's real FanOutRelay, its DEALERs in this poller.
        self.poller = zmq.Poller()
        self.relay_socks: dict[Any, _Agent] = {}
        self.relays: list[Any] = []  # the relays made so far (ticked each round; most agents never relay)
        # Links carried for clients (runtime/agent/forwarding.py): each agent's real LinkForwarder.
        self.forward_socks: dict[Any, _Agent] = {}
        self.forwarders: list[Any] = []

    def serve(self, control_fd: int, mute_file: Path | None = None) -> None:
        zmq = self.zmq
        from monarch_cli.runtime.transport import wire

        poller = self.poller
        poller.register(self.transport.zap, zmq.POLLIN)
        poller.register(control_fd, zmq.POLLIN)
        for a in self.agents:
            poller.register(a.sock, zmq.POLLIN)
        control = b""
        next_check = 0.0
        while self.running:
            if mute_file is not None and time.monotonic() >= next_check:
                # Often: the benchmark times a lost host from the moment it writes this file.
                next_check = time.monotonic() + 0.02
                try:
                    for line in mute_file.read_text().splitlines():  # NAME, or a control line
                        words = line.split()
                        self._control(["mute", *words] if len(words) == 1 else words)
                except OSError:
                    pass
            wait = 200 if mute_file is None else 20
            if any(f.next_due() for f in self.forwarders):  # (messages wait for a relay's connections)
                wait = 5
            for item, _ in poller.poll(wait):
                if item in self.relay_socks:
                    self._relayed(item)
                elif item in self.forward_socks:  # a round of that relay's own loop: read, then send on
                    agent = self.forward_socks[item]
                    agent.forwarder.readable(item)
                    if not agent.muted:
                        agent.forwarder.flush()
                elif item is self.transport.zap:
                    while self.transport.zap.poll(0):
                        self.transport.serve_zap()
                elif item == control_fd:
                    data = os.read(control_fd, 4096)
                    if not data:
                        return
                    control += data
                    *lines, control = control.split(b"\n")
                    for line in lines:
                        self._control(line.decode().split())
                else:
                    agent = self.by_sock[item]
                    while item.getsockopt(zmq.EVENTS) & zmq.POLLIN:
                        try:
                            self._handle(agent, wire.recv_frames(item))
                        except Exception as e:  # noqa: BLE001 - as a real agent: keep serving
                            print(f"emulated agent {agent.name}: {type(e).__name__}: {e}", file=sys.stderr)
                    agent.batches.flush_all()  # the end of this agent's round
            for forwarder in self.forwarders:
                if not forwarder.agent._agent.muted:  # a muted host's network is gone, both ways
                    forwarder.flush()
            self._relay_tick()

    def _control(self, words: list[str]) -> None:
        if len(words) == 2 and words[0] in ("mute", "unmute", "freeze"):
            for a in self.agents:
                if a.name == words[1]:
                    a.muted = words[0] != "unmute"
                    a.frozen = words[0] == "freeze"

    # ------------------------------------------------------------------ relaying
    def _relay(self, agent: _Agent) -> Any:
        """The agent's relay: the real one (runtime/agent/relay.py), on this process's loop."""
        if agent.relay is None:
            from monarch_cli.runtime.agent.relay import FanOutRelay

            def watch(sock: Any) -> None:
                self.relay_socks[sock] = agent
                self.poller.register(sock, self.zmq.POLLIN)

            agent.relay = FanOutRelay(_RelayCore(self, agent), watch, self.poller.unregister)  # type: ignore[arg-type]
            self.relays.append(agent.relay)
        return agent.relay

    def _forwarder(self, agent: _Agent) -> Any:
        """The agent's forwarder: the real one (runtime/agent/forwarding.py), on this process's loop."""
        if agent.forwarder is None:
            from monarch_cli.runtime.agent.forwarding import LinkForwarder

            def watch(sock: Any) -> None:
                self.forward_socks[sock] = agent
                self.poller.register(sock, self.zmq.POLLIN)

            def unwatch(sock: Any) -> None:
                self.forward_socks.pop(sock, None)
                self.poller.unregister(sock)

            agent.forwarder = LinkForwarder(_RelayCore(self, agent), watch, unwatch)  # type: ignore[arg-type]
            self.forwarders.append(agent.forwarder)
        return agent.forwarder

    def _relayed(self, sock: Any) -> None:
        agent = self.relay_socks[sock]
        agent.relay.readable(sock)
        agent.batches.flush_all()

    def _relay_tick(self) -> None:
        for relay in self.relays:
            relay.tick()

    # ------------------------------------------------------------------ messages
    def _send(self, agent: _Agent, to: str, msg: Any, body: list[Any] = ()) -> None:  # type: ignore[assignment]
        from monarch_cli.runtime.transport import wire

        if not agent.batches.add(to, msg, body):
            agent.batches.flush(to)  # what is held goes first, as a real agent's does
            agent._send_now(to, wire.frames((msg.KIND, *msg), body))

    def _reply(self, agent: _Agent, to: str, cid: int, ok: bool, value: Any) -> None:
        from monarch_cli.runtime import protocol
        from monarch_cli.runtime.transport import wire

        self._send(agent, to, protocol.Result(cid, ok), wire.dumps_data(value if ok else (value, "", None)))

    def _handle(self, agent: _Agent, frames: list[Any]) -> None:
        from monarch_cli.runtime import protocol
        from monarch_cli.runtime.transport import wire

        if agent.frozen:  # a host that answers nothing at all
            return
        if len(frames) > 2 and frames[1].bytes == protocol.FORWARD:  # for a host behind this one
            if not agent.muted:  # (its network is gone: nothing passes)
                self._forwarder(agent).forward(frames[0].bytes, frames[1:])
            return
        head, body = wire.parse(frames[1:])
        msg = protocol.decode(head)
        kind = msg.KIND
        route = frames[0].bytes
        agent.routes.note(route, msg)
        if kind == "heartbeat":
            if not agent.muted:
                agent.sock.send_multipart([*agent.routes.back(route, msg.client), protocol.HEARTBEAT_ACK])
        elif kind == "ping":
            self._reply(agent, msg.reply_to, msg.cid, True, self._info(agent))
        elif kind == "fan_out":
            self._relay(agent).handlers()[protocol.FanOut](msg, body)
        elif kind == "probe_peers":  # every peer reached (a real agent connects to each): no partition here
            self._reply(agent, msg.reply_to, msg.cid, True, {peer: "" for peer in msg.peers})
        elif kind == "reserve_port":
            self._reply(agent, msg.reply_to, msg.cid, True, 29500)
        elif kind in ("release_port", "forget_preload", "shutdown"):
            self._reply(agent, msg.reply_to, msg.cid, True, 0 if kind == "forget_preload" else None)
            if kind == "shutdown":
                self.running = False
        elif kind == "run_ranks":
            self._run(agent, msg, wire.loads(body))
        elif kind == "signal_ranks":
            for rank, owner in agent.hung.pop(msg.run_id, []):
                self._exit(agent, owner, msg.run_id, rank, None, int(msg.signal))
            self._reply(agent, msg.reply_to, msg.cid, True, None)
        elif kind == "stopping":
            runs = sorted(agent.hung)
            for run_id in runs:
                owner = agent.hung[run_id][0][1]
                self._send(agent, owner, protocol.ReservationStopped(run_id, agent.address, msg.who))
            self._reply(agent, msg.reply_to, msg.cid, True, runs)
        elif kind == "telemetry_stacks":
            self._reply(agent, msg.reply_to, msg.cid, True, self._stacks(agent, msg))
        elif kind == "telemetry_sample":
            self._reply(agent, msg.reply_to, msg.cid, True, {"host": agent.name, "samples": [], "steps": {}})
        elif kind == "client_exit":
            agent.routes.forget(msg.client)
            if agent.forwarder is not None:
                agent.forwarder.client_gone(msg.client)
            for run_id in [r for r, ranks in agent.hung.items() if ranks and ranks[0][1] == msg.client]:
                del agent.hung[run_id]
        elif kind == "output_credit":
            pass
        elif hasattr(msg, "cid") and hasattr(msg, "reply_to"):
            self._reply(agent, msg.reply_to, msg.cid, False, f"the emulated agent does not answer {kind!r}")

    def _info(self, agent: _Agent) -> dict[str, Any]:
        from monarch_cli import __version__

        return {
            "host": agent.name,
            "version": __version__,
            "addr": "127.0.0.1",
            "pid": os.getpid(),
            "procs": 0,
            "ranks": sum(len(r) for r in agent.hung.values()),
            "cpus": 8,
            "gpus": 0,
            "preload": "",
            "warm": None,
            "telemetry_dir": None,
        }

    def _run(self, agent: _Agent, msg: Any, specs: list[dict[str, Any]]) -> None:
        from monarch_cli.runtime import protocol

        self._reply(agent, msg.reply_to, msg.cid, True, {"made_cold": [], "notices": []})
        for spec in specs:
            env, rank = {**spec.get("env_base", {}), **spec["env"]}, spec["rank"]
            text = env.get("EMULATED_OUTPUT", "")
            if text:
                data = text.replace("{rank}", str(rank)).encode()
                self._send(agent, msg.reply_to, protocol.Output(msg.run_id, rank, 1), [data])
            if env.get("EMULATED_HANG"):
                agent.hung.setdefault(msg.run_id, []).append((rank, msg.reply_to))
                continue
            code: int | None = 0
            sig: int | None = None
            for item in filter(None, env.get("EMULATED_EXIT", "").split(",")):
                who, _, status = item.partition("=")
                if int(who) == rank:
                    if status.startswith("SIG"):
                        code, sig = None, int(signal.Signals[status])
                    else:
                        code = int(status)
            self._exit(agent, msg.reply_to, msg.run_id, rank, code, sig)

    def _exit(self, agent: _Agent, owner: str, run_id: str, rank: int, code: int | None, sig: int | None) -> None:
        from monarch_cli.runtime import protocol

        self._send(agent, owner, protocol.RankExited(run_id, rank, code, sig, 0.01, 100000 + rank, ""))

    def _stacks(self, agent: _Agent, msg: Any) -> list[dict[str, Any]]:
        out = []
        for run_id, ranks in agent.hung.items():
            if msg.run_id is not None and run_id != msg.run_id:
                continue
            for rank, _ in ranks:
                if msg.ranks is not None and rank not in msg.ranks:
                    continue
                frames = [
                    {"function": "<module>", "file": "train.py", "line": 12},
                    {"function": "all_reduce", "file": "distributed_c10d.py", "line": 2501},
                ]
                out.append(
                    {
                        "run_id": run_id,
                        "rank": rank,
                        "host": agent.name,
                        "pid": 100000 + rank,
                        "method": "emulated",
                        "threads": [{"name": "MainThread", "main": True, "frames": frames}],
                        "error": None,
                        "fallback": None,
                    }
                )
        return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--names", required=True, help="first:count, e.g. 0:512 for emu0..emu511")
    parser.add_argument("--address-file", required=True)
    args = parser.parse_args(argv)
    os.environ["MONARCH_HOST"] = "127.0.0.1"
    from monarch_cli.runtime.transport.sockets import raise_fd_limit

    raise_fd_limit()  # (the agents' own: 512 of them hold thousands of connections)
    from monarch_cli.runtime.title import set_title
    from monarch_cli.runtime.transport.keys import Keys

    first, count = (int(x) for x in args.names.split(":"))
    names = [f"emu{i}" for i in range(first, first + count)]
    keys = Keys.decode(sys.stdin.buffer.readline().decode())
    emulator = _Emulator(keys, names)
    set_title(f"monarch agent emulated {names[0]}..{names[-1]}")
    signal.signal(signal.SIGTERM, lambda *_: setattr(emulator, "running", False))
    lines = "".join(f"{a.name} {a.address}\n" for a in emulator.agents)
    tmp = args.address_file + ".tmp"
    Path(tmp).write_text(lines)
    os.replace(tmp, args.address_file)
    emulator.serve(sys.stdin.fileno(), Path(args.address_file + ".mute"))
    return 0


# ------------------------------------------------------------------- the client's side
class EmulatedCluster:
    """The emulator processes of one job; ``mute(name)`` makes a host go silent."""

    def __init__(self, procs: list[subprocess.Popen], hosts: list[Any]) -> None:
        self.procs = procs
        self.hosts = hosts
        self._owner = {}
        for i, h in enumerate(hosts):
            self._owner[h.name] = procs[i // PER_PROCESS]

    def mute(self, name: str, how: str = "mute") -> None:
        """``mute``: no more heartbeat answers (a lost host); ``freeze``: no answers at all."""
        proc = self._owner[name]
        assert proc.stdin is not None
        proc.stdin.write(f"{how} {name}\n".encode())
        proc.stdin.flush()

    def close(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                try:
                    if p.stdin is not None:
                        p.stdin.close()
                except OSError:
                    pass
        for p in self.procs:
            try:
                p.wait(timeout=10)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()


def emulated_job(hosts: int, state: Path, timeout: float = 120.0, check: bool = True) -> tuple[Any, EmulatedCluster]:
    """A :class:`~monarch_cli.jobs.Job` whose ``hosts`` agents are emulated, and the cluster;
    ``check``: ask every host once, as ``serve`` does (through relays from
    ``settings().relay_from_hosts`` hosts: see :meth:`~monarch_cli.jobs.Job.check_relays`)."""
    from monarch_cli.jobs import job_load
    from monarch_cli.jobs.state import JobState, save_state
    from monarch_cli.runtime.transport.keys import Keys
    from monarch_cli.schedulers.base import HostRecord

    keys = Keys.generate()
    workdir = state.parent
    addresses = workdir / "emulated"
    addresses.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "MONARCH_HOST": "127.0.0.1"}
    root = str(Path(__file__).resolve().parents[1])
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [root, env.get("PYTHONPATH")]))
    procs: list[subprocess.Popen] = []
    files = []
    for first in range(0, hosts, PER_PROCESS):
        count = min(PER_PROCESS, hosts - first)
        f = addresses / f"emu{first}.addr"
        f.unlink(missing_ok=True)
        files.append(f)
        log = open(addresses / f"emu{first}.log", "ab")  # noqa: SIM115 - the child holds it
        proc = subprocess.Popen(
            [sys.executable, "-m", "tests.emulated_cluster", "--names", f"{first}:{count}", "--address-file", str(f)],
            stdin=subprocess.PIPE,
            stdout=log,
            stderr=log,
            env=env,
            cwd=root,
        )
        log.close()
        assert proc.stdin is not None
        proc.stdin.write(keys.encode().encode() + b"\n")
        proc.stdin.flush()
        procs.append(proc)
    records: list[HostRecord] = []
    deadline = time.monotonic() + timeout
    for f, proc in zip(files, procs):
        while not f.exists():
            if proc.poll() is not None or time.monotonic() > deadline:
                for p in procs:
                    p.kill()
                raise RuntimeError(f"emulator {f.name} did not start: {(f.with_suffix('.log')).read_text()[-2000:]}")
            time.sleep(0.05)
        for line in f.read_text().splitlines():
            name, address = line.split()
            records.append(HostRecord(name, address, proc.pid, len(records)))
    save_state(
        JobState(
            scheduler="local",
            reservation_id=f"emulated-{os.getpid()}-{int(time.time())}",
            hosts=records,
            keys=keys.encode(),
            default_command=[],
            created_at=time.time(),
            scheduler_data={"logs": "", "addresses": ""},
        ),
        state,
    )
    job = job_load(state)
    if check:
        job.check_relays()  # as `serve` does: from here on the relays hold their connections
    return job, EmulatedCluster(procs, records)


if __name__ == "__main__":
    sys.exit(main())
