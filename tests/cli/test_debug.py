"""`monarch debug` driven as a user drives it: a real terminal (pexpect), real ranks, real pdb.

One local reservation of two hosts; each test starts `monarch run-spmd` in the background
with 4 ranks that stop in breakpoint(), then debugs them from other processes.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pexpect
import pytest

from monarch_cli.jobs import job_load, serve
from monarch_cli.jobs.debug import DebugClient

from ..conftest import wait_until

pytestmark = pytest.mark.slow

SCRIPT = """\
import os, sys, time
rank = int(os.environ["RANK"])
secret = f"s{rank}"

def step(x):
    y = x * 2
    return y

breakpoint()
total = step(rank + 1)
print(f"rank {rank} total {total}", flush=True)
if os.environ.get("CRASH") == str(rank):
    bad = {"rank": rank}
    raise ValueError(f"boom on {rank}")
"""

SET_TRACE_SCRIPT = """\
import os, pdb
rank = int(os.environ["RANK"])
pdb.set_trace()
print(f"rank {rank} after set_trace", flush=True)
"""

DAP_SCRIPT = """\
import os
rank = int(os.environ["RANK"])
breakpoint()
value = 40 + rank
print(f"value {value}", flush=True)   # line 5: the IDE's breakpoint
"""

DAP_AGAIN_SCRIPT = """\
import os, time
breakpoint()
step = 0
while not os.path.exists("dap-done"):
    step += 1   # line 5: the IDEs' breakpoint
    with open("dap-step", "w") as f:
        f.write(str(step))
    time.sleep(0.02)
print(f"steps {step}", flush=True)
"""


@pytest.fixture(scope="module")
def reservation(tmp_path_factory) -> Iterator[Path]:
    work = tmp_path_factory.mktemp("debug")
    (work / "dbg.py").write_text(SCRIPT)
    (work / "dap.py").write_text(DAP_SCRIPT)
    (work / "dap_again.py").write_text(DAP_AGAIN_SCRIPT)
    (work / "settrace.py").write_text(SET_TRACE_SCRIPT)
    state = work / ".monarch" / "job_state.pkl"
    job = serve(["torchrun", "--nproc-per-node=2", "dbg.py"], hosts=2, state=state, cwd=work)
    yield state
    job.stop()


def _env(state: Path, **extra: str) -> dict[str, str]:
    return {
        **os.environ,
        "MONARCH_STATE": str(state),
        "MONARCH_DEBUG_HISTORY": str(state.parent / "history"),
        "TERM": "dumb",
        "NO_COLOR": "1",
        **extra,
    }


class Run:
    """`monarch run-spmd` in the background."""

    def __init__(self, state: Path, *args: str, **env: str) -> None:
        self.out = open(state.parent / f"run-{time.time_ns()}.log", "w+")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "monarch_cli", "run-spmd", "--no-color", *args],
            cwd=state.parent.parent,
            env=_env(state, **env),
            stdout=self.out,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
        )

    def wait(self, timeout: float = 60) -> int:
        return self.proc.wait(timeout)

    def output(self) -> str:
        self.out.seek(0)
        return self.out.read()

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()

    def __enter__(self) -> Run:
        return self

    def __exit__(self, *exc: object) -> None:
        """Whatever the test did, no run outlives it."""
        self.kill()
        self.out.close()


def wait_paused(
    state: Path, ranks: int = 4, timeout: float = 60, reason: str | None = None, line: int | None = None
) -> list[Any]:
    client = DebugClient(job_load(state).hostset())
    deadline = time.monotonic() + timeout
    try:
        while time.monotonic() < deadline:
            rows = [
                r
                for r in client.list()
                if r.state == "paused" and (reason is None or r.reason == reason) and (line is None or r.line == line)
            ]
            if len(rows) >= ranks:
                return rows
            time.sleep(0.2)
    finally:
        client.close()
    raise AssertionError(f"only {len(rows)} rank(s) paused after {timeout} s")


def monarch_debug(state: Path, *args: str) -> pexpect.spawn:
    child = pexpect.spawn(
        sys.executable,
        ["-m", "monarch_cli", "debug", *args],
        env=_env(state),
        cwd=str(state.parent.parent),
        encoding="utf-8",
        timeout=30,
        dimensions=(50, 200),
    )
    child.logfile_read = open(state.parent / f"pexpect-{time.time_ns()}.log", "w")  # kept for post-mortems of failures
    return child


def debug_cmd(state: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "monarch_cli", "debug", *args],
        env=_env(state),
        cwd=state.parent.parent,
        capture_output=True,
        text=True,
        timeout=60,
    )


def test_list_attach_print_step_cast_continue(reservation):
    with Run(reservation) as run:
        paused = wait_paused(reservation)
        assert [(r.rank, r.host, r.line) for r in paused] == [
            (0, "local0", 10),
            (1, "local0", 10),
            (2, "local1", 10),
            (3, "local1", 10),
        ]
        shell = monarch_debug(reservation)
        shell.expect("4 rank\\(s\\) paused")
        shell.expect("monarch_dbg> ")
        shell.sendline("list")
        for rank in range(4):
            shell.expect(f"{rank} +local{rank // 2} +\\d+ +[^\\n]*dbg.py:10 +<module> +paused")
        shell.expect("monarch_dbg> ")

        shell.sendline("attach 1")
        shell.expect("attached to rank 1")
        shell.expect_exact("(Pdb) ")
        shell.sendline("p secret")
        shell.expect_exact("'s1'")
        shell.expect_exact("(Pdb) ")
        shell.sendline("s")  # into step()
        shell.expect_exact("(Pdb) ")
        shell.sendline("s")
        shell.expect_exact("(Pdb) ")
        shell.sendline("n")
        shell.expect_exact("-> return y")
        shell.sendline("p y")
        shell.expect_exact("4")  # (rank 1 + 1) * 2
        shell.sendline("w")
        shell.expect("step\\(\\)")
        shell.sendline("u")
        shell.expect("<module>\\(\\)")
        shell.sendline("d")
        shell.expect("step\\(\\)")
        shell.sendline("ll")
        shell.expect_exact("def step(x):")
        shell.sendline("b 12")
        shell.expect("Breakpoint 1 at .*dbg.py:12")
        shell.sendline("interact")
        shell.expect_exact(">>> ")
        shell.sendline("print(secret * 2, x)")
        shell.expect_exact("s1s1 2")
        shell.expect_exact(">>> ")
        shell.sendeof()  # leaves `interact`, back in pdb
        shell.expect_exact("(Pdb) ")
        shell.sendline("detach")
        shell.expect("monarch_dbg> ")

        shell.sendline("cast hosts=1 p secret")
        shell.expect_exact("[rank2] 's2'")
        shell.expect_exact("[rank3] 's3'")
        shell.expect("monarch_dbg> ")
        shell.sendline("cast 0:2 p rank + 100")
        shell.expect_exact("[rank0] 100")
        shell.expect_exact("[rank1] 101")  # rank 1 is inside step(); `rank` is a global there
        shell.expect("monarch_dbg> ")

        shell.sendline("continue")
        for rank in range(4):
            shell.expect_exact(f"[rank{rank}] continued")
        shell.expect("monarch_dbg> ")
        # rank 1 stops again at the breakpoint set at line 12
        paused = wait_paused(reservation, ranks=1, line=12)  # the others may not have reported running yet
        assert [(r.rank, r.line) for r in paused] == [(1, 12)]
        shell.sendline("continue 1")
        shell.expect_exact("[rank1] continued")
        shell.sendline("quit")
        shell.expect(pexpect.EOF)
        assert run.wait() == 0
        out = run.output()
        for rank in range(4):
            assert f"[rank{rank}] rank {rank} total {(rank + 1) * 2}" in out
            assert f"rank {rank} paused at" in out and f"monarch debug attach {rank}" in out
        finished = debug_cmd(reservation, "continue", "2")
        assert finished.returncode == 0 and "already finished (exit 0); nothing to continue" in finished.stdout


def test_scripted_json_two_clients_replay_and_client_death(reservation):
    with Run(reservation) as run:
        wait_paused(reservation)
        listed = json.loads(debug_cmd(reservation, "list", "--json").stdout)
        assert [r["rank"] for r in listed] == [0, 1, 2, 3] and all(r["state"] == "paused" for r in listed)
        assert listed[3]["coords"] == {"hosts": 1, "gpus": 1}

        cast = json.loads(debug_cmd(reservation, "cast", "*", "p secret", "--json").stdout)
        assert {r: v["output"].strip() for r, v in cast.items()} == {str(r): f"'s{r}'" for r in range(4)}

        # Client A holds rank 0 and asks for slow output, then is killed before it arrives.
        a = monarch_debug(reservation, "attach", "0")
        a.expect_exact("(Pdb) ")
        b = debug_cmd(reservation, "cast", "0", "p 1", "--json")
        assert b.returncode == 1 and "is attached by" in json.loads(b.stdout)["0"]["error"]
        a.sendline("p __import__('time').sleep(1.5) or 'late answer'")
        time.sleep(0.3)
        a.kill(signal.SIGKILL)
        # The rank is unharmed; once A's heartbeats stop, B can attach and sees what A missed.
        time.sleep(7)
        b = monarch_debug(reservation, "attach", "0")
        b.expect_exact("'late answer'")
        b.expect_exact("(Pdb) ")
        b.sendline("p secret")
        b.expect_exact("'s0'")
        b.sendcontrol("c")  # Ctrl-C detaches; the rank stays paused
        b.expect(pexpect.EOF)
        assert [r.state for r in wait_paused(reservation)] == ["paused"] * 4

        done = debug_cmd(reservation, "continue", "--json")
        assert json.loads(done.stdout) == {str(r): "continued" for r in range(4)}
        assert run.wait() == 0


def test_pdb_set_trace_pauses_too_and_quit_leaves_the_ranks_paused(reservation):
    with Run(reservation, "--", "torchrun", "--nproc-per-node=2", "settrace.py") as run:
        rows = wait_paused(reservation)
        assert [(r.rank, r.line) for r in rows] == [(rank, 4) for rank in range(4)]
        shell = monarch_debug(reservation)
        shell.expect_exact("monarch_dbg> ")
        shell.sendline("quit")
        shell.expect(pexpect.EOF)
        assert [r.state for r in wait_paused(reservation)] == ["paused"] * 4
        assert debug_cmd(reservation, "continue").returncode == 0
        assert run.wait() == 0
        for rank in range(4):
            assert f"[rank{rank}] rank {rank} after set_trace" in run.output()


def test_rank_dying_while_attached_ends_the_session_clearly(reservation):
    with Run(reservation) as run:
        wait_paused(reservation)
        shell = monarch_debug(reservation, "attach", "2")
        shell.expect_exact("(Pdb) ")
        shell.sendline("import os; os._exit(9)")
        shell.expect("rank 2 exited \\(exit 9\\); session ended")
        shell.expect(pexpect.EOF)
        debug_cmd(reservation, "continue")
        assert run.wait() == 9  # the first failure is rank 2's


def test_post_mortem_keeps_the_failing_frame(reservation):
    with Run(reservation, "--post-mortem", CRASH="3") as run:
        wait_paused(reservation)
        debug_cmd(reservation, "continue")
        rows = wait_paused(reservation, ranks=1, reason="post-mortem")
        assert rows[0].rank == 3 and rows[0].line == 14
        shell = monarch_debug(reservation, "attach", "3")
        shell.expect_exact("(Pdb) ")
        shell.sendline("p bad")
        shell.expect_exact("{'rank': 3}")
        shell.sendline("continue")
        shell.expect("rank 3 (is running again|exited)")
        assert run.wait() == 1
        assert "stopped after an uncaught exception" in run.output()
        assert "ValueError: boom on 3" in run.output()


class DapClient:
    """Just enough of the Debug Adapter Protocol to drive debugpy."""

    def __init__(self, host: str, port: int) -> None:
        self.sock = socket.create_connection((host, port), timeout=30)
        self.seq = 0
        self.buf = b""
        self.seen: list[dict[str, Any]] = []

    def send(self, command: str, **arguments: Any) -> int:
        self.seq += 1
        body = json.dumps({"seq": self.seq, "type": "request", "command": command, "arguments": arguments}).encode()
        self.sock.sendall(b"Content-Length: %d\r\n\r\n" % len(body) + body)
        return self.seq

    def _read(self) -> dict[str, Any]:
        while b"\r\n\r\n" not in self.buf:
            self.buf += self.sock.recv(65536)
        head, _, rest = self.buf.partition(b"\r\n\r\n")
        length = int(head.split(b":")[1])
        while len(rest) < length:
            rest += self.sock.recv(65536)
        self.buf = rest[length:]
        return json.loads(rest[:length])

    def wait(self, predicate, timeout: float = 30) -> dict[str, Any]:
        deadline = time.monotonic() + timeout
        for msg in self.seen:
            if predicate(msg):
                self.seen.remove(msg)
                return msg
        while time.monotonic() < deadline:
            msg = self._read()
            if predicate(msg):
                return msg
            self.seen.append(msg)
        raise AssertionError("no such DAP message")

    def request(self, command: str, **arguments: Any) -> dict[str, Any]:
        seq = self.send(command, **arguments)
        response = self.wait(lambda m: m.get("type") == "response" and m.get("request_seq") == seq)
        assert response["success"], response
        return response.get("body", {})


# Run as `nobody` (system python, no access to this checkout): every port given on argv gets
# a DAP session that would run os.system in the rank; prints what each port sent back.
ATTACK = """
import json, socket, sys, threading
marker = sys.argv[1]
def frame(seq, command, **arguments):
    body = json.dumps({"seq": seq, "type": "request", "command": command, "arguments": arguments}).encode()
    return b"Content-Length: %d\\r\\n\\r\\n" % len(body) + body
payload = (frame(1, "initialize", adapterID="debugpy") + frame(2, "attach", justMyCode=False)
           + frame(3, "configurationDone")
           + frame(4, "evaluate", expression=f"__import__('os').system('touch {marker}')", context="repl"))
got = {}
def attack(port):
    try:
        s = socket.create_connection(("127.0.0.1", port), timeout=3)
        s.sendall(payload)
        data = b""
        while True:
            chunk = s.recv(65536)
            if not chunk:
                break
            data += chunk
        got[port] = data.decode("latin-1")
    except OSError as e:
        got[port] = type(e).__name__
threads = [threading.Thread(target=attack, args=(int(p),)) for p in sys.argv[2:]]
[t.start() for t in threads]
[t.join() for t in threads]
print(json.dumps(got))
"""


def _tcp_listeners(pids: list[int]) -> dict[int, list[int]]:
    """Listening TCP ports of each pid."""
    import psutil

    ports: dict[int, list[int]] = {}
    for pid in pids:
        try:
            conns = psutil.Process(pid).net_connections(kind="tcp")
        except psutil.NoSuchProcess:
            continue
        ports[pid] = sorted(c.laddr.port for c in conns if c.status == psutil.CONN_LISTEN)
    return ports


def _run_processes(state: Path, rank_pid: int) -> list[int]:
    """The rank, its agent and everything the agent started (zygotes, ranks)."""
    import psutil

    agents = {h.pid for h in job_load(state).state.hosts}
    agent = next(p for p in psutil.Process(rank_pid).parents() if p.pid in agents)
    return [agent.pid, *(c.pid for c in agent.children(recursive=True))]


_AS_ANOTHER_USER = pytest.mark.skipif(os.geteuid() != 0, reason="acting as another user (runuser -u nobody) needs root")


@_AS_ANOTHER_USER
def test_dap_attach_breakpoint_continue_and_variables_and_no_other_user_gets_in(reservation, tmp_path):
    with Run(reservation, "--", "torchrun", "--nproc-per-node=1", "--nnodes=1", "dap.py") as run:
        rank_pid = wait_paused(reservation, ranks=1)[0].pid
        before = _tcp_listeners(_run_processes(reservation, rank_pid))
        relay_err = open(tmp_path / "relay.err", "w+")
        relay = subprocess.Popen(
            [sys.executable, "-m", "monarch_cli", "debug", "--dap", "0", "--json"],
            env=_env(reservation),
            cwd=reservation.parent.parent,
            stdout=subprocess.PIPE,
            stderr=relay_err,
            text=True,
        )
        try:
            info = json.loads(relay.stdout.readline())
            assert info["host"] == "127.0.0.1"
            assert info["vscode"]["request"] == "attach" and info["vscode"]["connect"]["port"] == info["port"]
            assert info["vscode"]["pathMappings"][0]["remoteRoot"] == str(reservation.parent.parent)

            # Another local user tries the IDE port and every TCP port of the run's processes.
            processes = _run_processes(reservation, rank_pid)
            after = _tcp_listeners(processes)
            assert after.get(rank_pid) == before.get(rank_pid), "the rank opened a port for DAP"
            ports = {port for listed in after.values() for port in listed}
            ports |= set(_tcp_listeners([relay.pid])[relay.pid])
            assert info["port"] in ports
            marker = tmp_path / "pwned"
            attack = subprocess.run(
                [
                    "runuser",
                    "-u",
                    "nobody",
                    "--",
                    "/usr/bin/python3",
                    "-c",
                    ATTACK,
                    str(marker),
                    *map(str, sorted(ports)),
                ],
                capture_output=True,
                text=True,
                timeout=60,
                cwd="/",
            )
            assert attack.returncode == 0, attack.stderr
            answers = json.loads(attack.stdout)
            assert answers[str(info["port"])] in ("", "ConnectionResetError"), "the IDE port answered another user"
            assert not any("Content-Length" in a for a in answers.values()), answers
            time.sleep(0.5)
            assert not marker.exists(), "another user ran code in the rank"
            relay_err.seek(0)
            assert "refused a debugger connection from uid 65534" in relay_err.read()

            # The holder's IDE still attaches, stops at its breakpoint, reads a variable, continues.
            dap = DapClient(info["host"], info["port"])
            dap.request(
                "initialize",
                adapterID="debugpy",
                clientID="monarch-test",
                linesStartAt1=True,
                columnsStartAt1=True,
                pathFormat="path",
            )
            attach_seq = dap.send("attach", justMyCode=False)
            dap.wait(lambda m: m.get("event") == "initialized")
            path = str(reservation.parent.parent / "dap.py")
            bps = dap.request("setBreakpoints", source={"path": path}, breakpoints=[{"line": 5}])
            assert bps["breakpoints"][0]["verified"]
            dap.request("configurationDone")
            dap.wait(lambda m: m.get("type") == "response" and m.get("request_seq") == attach_seq)
            stopped = dap.wait(lambda m: m.get("event") == "stopped", timeout=60)
            frames = dap.request("stackTrace", threadId=stopped["body"]["threadId"])["stackFrames"]
            assert frames[0]["line"] == 5 and frames[0]["source"]["path"].endswith("dap.py")
            scopes = dap.request("scopes", frameId=frames[0]["id"])["scopes"]
            local = next(s for s in scopes if s["name"].lower().startswith(("locals", "globals")))
            variables = dap.request("variables", variablesReference=local["variablesReference"])["variables"]
            assert {v["name"]: v["value"] for v in variables}["value"] == "40"
            dap.request("continue", threadId=stopped["body"]["threadId"])
            assert run.wait() == 0
            assert "[rank0] value 40" in run.output()
            assert relay.wait(30) == 0  # the rank is gone: so is the relay
            assert not marker.exists()
        finally:
            if relay.poll() is None:
                relay.kill()
            relay.wait()


def _ide_stops_at(info: dict[str, Any], path: str, line: int) -> tuple[DapClient, int, dict[str, str]]:
    """An IDE session that sets one breakpoint and waits there: (client, thread id, local variables)."""
    dap = DapClient(info["host"], info["port"])
    dap.request(
        "initialize",
        adapterID="debugpy",
        clientID="monarch-test",
        linesStartAt1=True,
        columnsStartAt1=True,
        pathFormat="path",
    )
    attach_seq = dap.send("attach", justMyCode=False)
    dap.wait(lambda m: m.get("event") == "initialized")
    assert dap.request("setBreakpoints", source={"path": path}, breakpoints=[{"line": line}])["breakpoints"][0][
        "verified"
    ]
    dap.request("configurationDone")
    dap.wait(lambda m: m.get("type") == "response" and m.get("request_seq") == attach_seq)
    thread = dap.wait(lambda m: m.get("event") == "stopped", timeout=60)["body"]["threadId"]
    frame = dap.request("stackTrace", threadId=thread)["stackFrames"][0]
    assert frame["line"] == line
    scope = dap.request("scopes", frameId=frame["id"])["scopes"][0]
    variables = dap.request("variables", variablesReference=scope["variablesReference"])["variables"]
    return dap, thread, {v["name"]: v["value"] for v in variables}


def test_dap_ide_that_vanishes_lets_the_rank_run_on_and_the_next_ide_attaches(reservation):
    work = reservation.parent.parent
    (work / "dap-done").unlink(missing_ok=True)
    (work / "dap-step").unlink(missing_ok=True)
    with Run(reservation, "--", "torchrun", "--nproc-per-node=1", "--nnodes=1", "dap_again.py") as run:
        wait_paused(reservation, ranks=1)
        relay = subprocess.Popen(
            [sys.executable, "-m", "monarch_cli", "debug", "--dap", "0", "--json"],
            env=_env(reservation),
            cwd=work,
            stdout=subprocess.PIPE,
            text=True,
        )
        try:
            info = json.loads(relay.stdout.readline())
            first, _, seen = _ide_stops_at(info, str(work / "dap_again.py"), 5)
            first.sock.close()  # the IDE crashes: no `disconnect`
            # Its breakpoint is gone and the rank runs on.
            steps = work / "dap-step"
            assert wait_until(lambda: steps.exists() and int(steps.read_text() or 0) > int(seen["step"]) + 5, 30)
            second, thread, later = _ide_stops_at(info, str(work / "dap_again.py"), 5)
            assert int(later["step"]) > int(seen["step"]) + 5
            (work / "dap-done").touch()
            second.request("disconnect")
            assert run.wait() == 0
            assert relay.wait(30) == 0
        finally:
            if relay.poll() is None:
                relay.kill()
            relay.wait()


# Run as `nobody` with a copy of pyzmq: sends the agent what `monarch debug` sends (pdb lines
# that would run os.system in a paused rank, and a pickle that would run it in the agent),
# first without CURVE, then with a key pair of its own and the reservation's public key.
PDB_ATTACK = """
import sys, time, zmq
agent, server_public = sys.argv[1], sys.argv[2].encode()
frames = [bytes.fromhex(h) for h in sys.argv[3:]]
ctx = zmq.Context()
for curve in (False, True):
    sock = ctx.socket(zmq.DEALER)
    sock.linger = 0
    if curve:
        sock.curve_publickey, sock.curve_secretkey = zmq.curve_keypair()
        sock.curve_serverkey = server_public
    sock.connect(agent)
    for frame in frames:
        sock.send(frame)
    time.sleep(1.0)
    sock.close()
ctx.destroy(linger=0)
print("sent")
"""


class _Evil:
    def __init__(self, path: str) -> None:
        self.path = path

    def __reduce__(self):
        return (os.system, (f"touch {self.path}",))


@pytest.fixture
def zmq_for_nobody() -> Iterator[Path]:
    """A world-readable copy of this pyzmq (the real one lives where `nobody` cannot read)."""
    import shutil
    import tempfile

    import zmq

    site = Path(zmq.__file__).parent.parent
    with tempfile.TemporaryDirectory(prefix="monarch-nobody-") as tmp:
        target = Path(tmp)
        for name in ("zmq", "pyzmq.libs"):
            if (site / name).exists():
                shutil.copytree(site / name, target / name)
        for path in [target, *target.rglob("*")]:
            path.chmod(0o755 if path.is_dir() else 0o644 | (path.stat().st_mode & 0o111))
        yield target


@_AS_ANOTHER_USER
def test_pdb_relay_takes_nothing_from_another_user(reservation, tmp_path, zmq_for_nobody):
    import pickle
    import struct

    from monarch_cli.jobs import job_load

    with Run(reservation, "--", "torchrun", "--nproc-per-node=1", "--nnodes=1", "dap.py") as run:
        row = wait_paused(reservation, ranks=1)[0]
        job = job_load(reservation)
        agent = job.state.hosts[0].agent
        assert agent.startswith("tcp://")
        marker, marker2 = tmp_path / "pwned-rank", tmp_path / "pwned-agent"
        line = f"import os; os.system('touch {marker}')\n"
        headers = [
            ("debug_input", 1, "tcp://127.0.0.1:1", row.run_id, 0, line),
            ("debug_cast", 2, "tcp://127.0.0.1:1", row.run_id, 0, line),
            ("debug_continue", 3, "tcp://127.0.0.1:1", row.run_id, 0),
        ]
        frames = [struct.pack("<I", len(h)) + h for h in (pickle.dumps(x, 5) for x in headers)]
        evil = pickle.dumps(_Evil(str(marker2)))
        frames.append(struct.pack("<I", len(evil)) + evil)
        attack = subprocess.run(
            [
                "runuser",
                "-u",
                "nobody",
                "--",
                "env",
                f"PYTHONPATH={zmq_for_nobody}",
                "/usr/bin/python3",
                "-c",
                PDB_ATTACK,
                agent,
                job.keys.public.decode(),
                *(f.hex() for f in frames),
            ],
            capture_output=True,
            text=True,
            timeout=60,
            cwd="/",
        )
        assert attack.returncode == 0 and attack.stdout.strip() == "sent", attack.stderr
        time.sleep(0.5)
        assert not marker.exists() and not marker2.exists(), "another user got code run"
        assert [r.state for r in wait_paused(reservation, ranks=1)] == ["paused"]  # not continued either
        # The holder still drives it.
        cast = json.loads(debug_cmd(reservation, "cast", "0", "p rank + 1", "--json").stdout)
        assert cast["0"]["output"].strip() == "1"
        assert debug_cmd(reservation, "continue").returncode == 0
        assert run.wait() == 0


HALF_EXIT_SCRIPT = """\
import os
if int(os.environ["GROUP_RANK"]) == 1:
    breakpoint()
print("done", flush=True)
"""


def test_the_prompt_counts_exited_ranks_apart_from_paused_ones(reservation):
    (reservation.parent.parent / "half_exit.py").write_text(HALF_EXIT_SCRIPT)
    with Run(reservation, "--", "torchrun", "--nproc-per-node=2", "half_exit.py") as run:
        wait_paused(reservation, ranks=2)
        client = DebugClient(job_load(reservation).hostset())
        try:
            assert wait_until(lambda: sum(r.state == "exited" for r in client.list()) == 2, timeout=60)
        finally:
            client.close()
        shell = monarch_debug(reservation)
        shell.expect_exact("monarch debug: 2 rank(s) paused, 2 exited;")
        shell.expect_exact("monarch_dbg> ")
        shell.sendline("quit")
        shell.expect(pexpect.EOF)
        assert debug_cmd(reservation, "continue").returncode == 0
        assert run.wait() == 0


def test_a_pdb_print_of_16000_non_ascii_characters_reaches_the_client_whole(reservation):
    """16,000 'é' are 96 KB of JSON: the rank sends them in pieces a packet holds, so the agent
    lives on and the run continues (it overflowed the agent's 64 KiB read and killed it, and the
    reservation with it)."""
    with Run(reservation) as run:
        wait_paused(reservation)
        shell = monarch_debug(reservation, "attach", "0")
        shell.expect_exact("(Pdb) ")
        shell.sendline('p "\\u00e9" * 16000')
        shell.expect_exact("(Pdb) ", timeout=60)
        assert shell.before.count("\u00e9") == 16000, shell.before[-300:]
        shell.sendline("detach")
        assert [r.state for r in wait_paused(reservation)] == ["paused"] * 4  # every agent still answers
        assert debug_cmd(reservation, "continue").returncode == 0
        assert run.wait() == 0, run.output()
