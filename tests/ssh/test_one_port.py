"""One connection per host, for real: hosts that cannot route to the client, each reached only
through one port forwarded over SSH (the ssh backend's ``--tunnel``)."""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from monarch_cli.config import configure, settings
from monarch_cli.jobs import RunResult, serve
from monarch_cli.jobs.debug import DebugClient

from .conftest import CLIENT_ADDRESS, SshHosts
from .test_ssh_backend import PYTHON, REPO, _monarch, _ssh_config

pytestmark = [pytest.mark.slow, pytest.mark.ssh]

# Output past the hosts' credit window (1 MiB), then a run longer than the heartbeat timeout:
# output, credits, heartbeats both ways and exits all cross the forwards.
SCRIPT = """\
import os, sys, time, torch, torch.distributed as dist
dist.init_process_group("gloo")
t = torch.ones(1) * (dist.get_rank() + 1)
dist.all_reduce(t)
sys.stdout.write(("x" * 99 + "\\n") * 15000)
print("sum", int(t.item()), "rank", dist.get_rank(), flush=True)
time.sleep(4)
dist.destroy_process_group()
"""


def _agent_peers(ns: str, port: int) -> list[str]:
    """The peer addresses of the connections into ``port`` inside namespace ``ns``."""
    out = subprocess.run(
        ["ip", "netns", "exec", ns, "ss", "-Htn", "state", "established", f"( sport = :{port} )"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    return [line.split()[-1].rpartition(":")[0] for line in out.splitlines() if line.strip()]


def test_hosts_that_cannot_reach_the_client_are_driven_through_one_forwarded_port_each(
    ssh_hosts: SshHosts, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    config = _ssh_config(ssh_hosts, tmp_path / "ssh_config", ssh_hosts.known_hosts)
    ws = tmp_path / "ws"
    ws.mkdir()
    state = ws / ".monarch" / "job_state.pkl"
    before = (settings().host, settings().heartbeat_timeout, settings().heartbeat_interval)
    # The client's mailbox listens on its loopback: a host's 127.0.0.1 is the host itself, so no
    # agent can connect to this client; a heartbeat timeout shorter than the run proves both ways.
    configure(host="127.0.0.1", heartbeat_timeout=3.0, heartbeat_interval=0.25)
    job = serve(None, "ssh", state=state, hosts="h1,h2", ssh_config=str(config), python=PYTHON, tunnel=True)
    try:
        hs = job.hostset()
        assert all(h.agent.startswith("tcp://127.0.0.1:") for h in hs.hosts), hs.hosts  # the forwards
        client_port = hs.mb.address.rpartition(":")[2]
        reach = subprocess.run(
            [
                "ip",
                "netns",
                "exec",
                ssh_hosts.hosts[0].name,
                sys.executable,
                "-c",
                f"import socket; socket.create_connection(('127.0.0.1', {client_port}), 2)",
            ],
            capture_output=True,
            text=True,
        )
        assert reach.returncode != 0 and "refused" in reach.stderr.lower(), reach.stderr

        (ws / "train.py").write_text(SCRIPT)
        monkeypatch.chdir(ws)
        out = io.BytesIO()
        result = job.run_spmd(
            ["torchrun", "--nproc-per-node=1", "train.py"], stdout=out, stderr=out, env={"GLOO_SOCKET_IFNAME": "eth0"}
        )
        text = out.getvalue().decode()
        assert result.exit_code == 0 and not any(r.lost for r in result.ranks), (
            [r.how for r in result.ranks],
            text[-2000:],
        )
        assert text.count("x" * 99) == 30000 and text.count("sum 3 rank") == 2, text[-2000:]

        # Every connection into an agent's port came from its own host's sshd (the forward), none
        # from the client's address; and the agent has no other port for the client.
        for h, rec in zip(ssh_hosts.hosts, job.state.hosts):
            port = int(rec.agent.rpartition(":")[2])
            peers = _agent_peers(h.name, port)
            assert peers and set(peers) == {h.address} and CLIENT_ADDRESS not in peers, peers
        assert "heartbeat" not in hs.infos[0]

        # The debugger's relay: rank 0 on h1 pauses; its pdb is driven from here through the forward.
        (ws / "dbg.py").write_text("import os\nanswer = 6 * 7\nif os.environ['RANK'] == '0':\n    breakpoint()\n")
        runs: list[RunResult] = []
        runner = threading.Thread(
            target=lambda: runs.append(
                job.run_spmd(["torchrun", "--nproc-per-node=1", "dbg.py"], stdout=io.BytesIO(), stderr=io.BytesIO())
            ),
            daemon=True,
        )
        runner.start()
        client = DebugClient(job.hostset())
        try:
            deadline = time.monotonic() + 60
            while not [r for r in client.list() if r.state == "paused"] and time.monotonic() < deadline:
                time.sleep(0.2)
            assert "42" in str(client.cast({0}, "p answer")[0])
            client.continue_({0})
            runner.join(60)
        finally:
            client.close()
        assert runs and runs[0].exit_code == 0, runs

        # A fresh CLI process opens its own forwards: exec, status.
        done = _monarch("exec", "--state", str(state), "--", "hostname -I")
        assert done.returncode == 0 and all(h.address in done.stdout for h in ssh_hosts.hosts), done.stderr
        assert "Traceback" not in done.stderr and "FAILED" not in done.stderr, done.stderr
        status = _monarch("status", "--state", str(state), "--json")
        assert status.returncode == 0, status.stderr
        assert [(h["name"], h["alive"]) for h in json.loads(status.stdout)["hosts"]] == [("h1", True), ("h2", True)]
    finally:
        job.stop()
        configure(host=before[0], heartbeat_timeout=before[1], heartbeat_interval=before[2])


# An actor script driving a served reservation, as a user runs one: its own process (one
# process drives one reservation's actors), the reservation loaded from its state file.
ACTOR_SCRIPT = """\
import json, os, socket, sys, torch
from monarch_cli import Actor, endpoint
from monarch_cli.jobs import job_load
from monarch_cli.runtime.errors import SupervisionError

class Doubler(Actor):
    @endpoint
    def double(self, t):
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect(("10.214.0.1", 9))  # no packet sent: the kernel names this host's own address
            return t * 2, s.getsockname()[0]

    @endpoint
    def die(self):
        os._exit(3)

hosts = job_load(sys.argv[1]).host_mesh()
procs = hosts.spawn_procs({"gpus": 1})
doublers = procs.spawn("doubler", Doubler)
t = torch.arange(1 << 20, dtype=torch.float32)  # 4 MiB: out of band, through both relays
answers = doublers.double.call(t).get(timeout=60).values()
print(json.dumps({"relay": [h.relay for h in hosts._members], "where": [w for _, w in answers],
                  "doubled": [torch.equal(d, t * 2) for d, _ in answers]}), flush=True)
sys.stdin.readline()  # the test looks at the agents' connections meanwhile
try:
    doublers.slice(hosts=1).die.call_one().get(timeout=60)
    died = None
except SupervisionError as e:
    died = str(e)
after = doublers.slice(hosts=0).double.call_one(torch.ones(2)).get(timeout=60)[1]
failures = [f.exitcode for f in procs.failures]
procs.stop().get(timeout=60)
print(json.dumps({"died": died, "failures": failures, "after": after}), flush=True)
"""


def test_actor_procs_on_hosts_that_cannot_reach_the_client_are_relayed_through_their_agents(
    ssh_hosts: SshHosts, tmp_path: Path
) -> None:
    config = _ssh_config(ssh_hosts, tmp_path / "ssh_config", ssh_hosts.known_hosts)
    state = tmp_path / "job_state.pkl"
    job = serve(None, "ssh", state=state, hosts="h1,h2", ssh_config=str(config), python=PYTHON, tunnel=True)
    try:
        (tmp_path / "actors.py").write_text(ACTOR_SCRIPT)
        # The script's mailbox listens on its loopback: no host can connect to it.
        script = subprocess.Popen(
            [sys.executable, str(tmp_path / "actors.py"), str(state)],
            cwd=tmp_path,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env={**os.environ, "PYTHONPATH": REPO, "MONARCH_HOST": "127.0.0.1"},
        )
        try:
            first = json.loads(script.stdout.readline() or "null")
            assert first is not None, script.communicate(timeout=30)[1][-3000:]
            assert first == {
                "relay": [True, True],
                "where": [h.address for h in ssh_hosts.hosts],
                "doubled": [True, True],
            }, first
            # Only the forwards ever connected to the agents' ports: nothing came from the client.
            for h, rec in zip(ssh_hosts.hosts, job.state.hosts):
                peers = _agent_peers(h.name, int(rec.agent.rpartition(":")[2]))
                assert peers and set(peers) == {h.address}, peers
            out, err = script.communicate("go\n", timeout=120)
        finally:
            script.kill()
        assert script.returncode == 0, err[-3000:]
        # Supervision: the proc that died on h2 failed its call and was recorded; h1's still answered.
        second = json.loads(out)
        assert "exited with code 3" in second["died"] and second["failures"] == [3], second
        assert second["after"] == ssh_hosts.hosts[0].address, second
    finally:
        job.stop()
