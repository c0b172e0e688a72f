"""The skypilot backend end to end, with only provisioning replaced.

A stand-in (tests/skypilot/standin.py, injected through ``$MONARCH_SKYPILOT_PROVISIONER``)
runs the task's real ``setup`` and ``run`` on two network-namespace nodes with SkyPilot's
environment; agent start-up with the keys from the secret, discovery on the fixed port,
workspace sync, a 2-node gloo run, status and teardown are the real ones.
"""

from __future__ import annotations

import io
import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from monarch_cli.jobs import job_load, serve
from monarch_cli.schedulers import Liveness

from .conftest import SkySsh
from .standin import NamespaceProvisioner, netns_pids

pytestmark = [pytest.mark.slow]
REPO = str(Path(__file__).resolve().parents[2])

ALLREDUCE = """\
import os, subprocess, torch, torch.distributed as dist
dist.init_process_group("gloo")
t = torch.ones(1) * (dist.get_rank() + 1)
dist.all_reduce(t)
print("sum", int(t.item()), "node", subprocess.check_output(["hostname", "-I"]).decode().split()[0], "cwd", os.getcwd(), "data", open("data.txt").read())
dist.destroy_process_group()
"""


@pytest.fixture
def standin(sky_nodes: list[tuple[str, str]], tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> NamespaceProvisioner:
    monkeypatch.setenv("MONARCH_SKYPILOT_PROVISIONER", "tests.skypilot.standin:NamespaceProvisioner")
    monkeypatch.setenv("MSKY_NODES", ",".join(f"{ns}={address}" for ns, address in sky_nodes))
    monkeypatch.setenv("MSKY_STATE", str(tmp_path / "standin"))
    monkeypatch.setenv("PYTHONPATH", REPO)  # the nodes run this checkout (setup finds this version: no pip)
    return NamespaceProvisioner()


def _monarch(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "monarch_cli", *args], cwd=cwd, capture_output=True, text=True, timeout=120
    )


def _maps_of(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/maps").read_text(errors="replace")
    except OSError:  # it has exited since it was listed
        return ""


def _environ_of(pid: int) -> str:
    return Path(f"/proc/{pid}/environ").read_bytes().replace(b"\0", b"\n").decode(errors="replace")


def test_serve_sync_gloo_run_status_and_stop_on_standin_nodes(
    standin: NamespaceProvisioner,
    sky_nodes: list[tuple[str, str]],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    sky_ssh: SkySsh,
) -> None:
    monkeypatch.setenv("MSKY_SSH", f"{sky_ssh.user}:{sky_ssh.key_file}")  # SSH access too: the open port wins
    ws = tmp_path / "ws"
    ws.mkdir()
    (ws / "train.py").write_text(ALLREDUCE)
    (ws / "data.txt").write_text("v1")
    monkeypatch.chdir(ws)
    state = ws / ".monarch" / "job_state.pkl"
    job = serve(None, "skypilot", state=state, hosts=2, cluster="msky-e2e")
    try:
        data = job.state.scheduler_data
        assert data["cluster"] == "msky-e2e" and data["node_ips"] == [a for _, a in sky_nodes]
        assert [h.agent for h in job.state.hosts] == [f"tcp://{a}:26600" for _, a in sky_nodes]
        assert data["reach"] == "direct"  # --reach auto: every agent answered on its port
        log = Path(os.environ["MSKY_STATE"], "msky-e2e.node0.log").read_text()
        assert "pip" not in log  # the real setup ran: it unzipped the mounted bundle, installed nothing
        disk = Path(os.environ["MSKY_STATE"], "msky-e2e.node0.disk")
        assert sorted(p.name.split("-")[0] for p in (disk / ".monarch-cli" / "bundles").iterdir()) == ["code", "deps"]
        secret = job.state.keys.split()[-1]
        for ns, _ in sky_nodes:  # the agent and all it started: no key in any environment or command line
            pids = netns_pids(ns)
            assert pids
            for pid in pids:
                text = _environ_of(pid) + Path(f"/proc/{pid}/cmdline").read_text(errors="replace")
                assert secret not in text and "MONARCH_RESERVATION_KEYS" not in text
        with monkeypatch.context() as m:  # every agent answers: a run's probe does not ask SkyPilot (seconds)
            m.setenv("MONARCH_SKYPILOT_PROVISIONER", "no_such_module:Nothing")
            assert job.scheduler.probe(job.state).liveness is Liveness.ALIVE
        out = io.BytesIO()
        notices: list[str] = []
        result = job.run_spmd(
            ["torchrun", "--nproc-per-node=1", "train.py"],
            stdout=out,
            stderr=out,
            on_event=notices.append,
            env={"GLOO_SOCKET_IFNAME": "eth0"},
        )
        text = out.getvalue().decode()
        logs = [Path(os.environ["MSKY_STATE"], f"msky-e2e.node{i}.log").read_text()[-1500:] for i in range(2)]
        assert result.exit_code == 0, "\n".join([text, repr(result), *notices, *logs])
        assert any(n.startswith("synced") and "to 2 hosts" in n for n in notices), notices
        lines = [line for line in text.splitlines() if " sum " in line]
        assert len(lines) == 2 and all("sum 3 " in line and "data v1" in line for line in lines), text
        assert {a for _, a in sky_nodes} == {line.split(" node ")[1].split()[0] for line in lines}
        assert str(ws) not in text  # ranks ran in the nodes' mirrors ($HOME/.monarch-cli), not the client's path
        status = _monarch("status", "--state", str(state), cwd=ws)
        assert status.returncode == 0 and "cluster msky-e2e: UP" in status.stdout, status.stdout + status.stderr
    finally:
        stopped = _monarch("stop", "--state", str(state), cwd=ws)
    assert stopped.returncode == 0, stopped.stderr
    assert all(not netns_pids(ns) for ns, _ in sky_nodes)  # nothing of the cluster is left
    assert not Path(os.environ["MSKY_STATE"], "msky-e2e.json").exists()  # it was torn down, not left up


def test_a_cluster_stopped_behind_our_back_is_reported_gone(
    standin: NamespaceProvisioner, sky_nodes: list[tuple[str, str]], tmp_path: Path
) -> None:
    state = tmp_path / ".monarch" / "job_state.pkl"
    job = serve(None, "skypilot", state=state, hosts=2, cluster="msky-gone")
    standin.stop_behind_our_back("msky-gone")
    assert job.scheduler.probe(job.state).reason == "SkyPilot reports cluster msky-gone as STOPPED"
    status = _monarch("status", "--state", str(state), cwd=tmp_path)
    text = status.stdout + status.stderr
    assert "gone" in text.lower() and "msky-gone as STOPPED" in text, text
    stopped = _monarch("stop", "--state", str(state), cwd=tmp_path)
    assert stopped.returncode == 0, stopped.stderr
    assert not Path(os.environ["MSKY_STATE"], "msky-gone.json").exists()  # stop still tears the cluster down
    assert all(not netns_pids(ns) for ns, _ in sky_nodes)


def _non_sshd(ns: str) -> list[str]:
    """What runs in a node besides sshd (the head's, and its sessions)."""
    names = [Path(f"/proc/{pid}/comm").read_text().strip() for pid in netns_pids(ns) if Path(f"/proc/{pid}").exists()]
    return [n for n in names if not n.startswith("sshd")]


def test_stop_keep_cluster_leaves_it_up_with_autostop_and_serve_cluster_reuses_it(
    standin: NamespaceProvisioner,
    sky_nodes: list[tuple[str, str]],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    sky_ssh: SkySsh,
) -> None:
    monkeypatch.setenv("MSKY_SSH", f"{sky_ssh.user}:{sky_ssh.key_file}")
    state = tmp_path / ".monarch" / "job_state.pkl"
    # --reach tunnel forces the SSH path though the agents' port is open.
    job = serve(None, "skypilot", state=state, hosts=2, cluster="msky-keep", autostop=20, reach="tunnel")
    try:
        assert job.state.scheduler_data["reach"] == "tunnel"
        assert all(h.startswith("tcp://127.0.0.1:") for h in job.scheduler.agent_addresses(job.state))
        assert job.status()["alive"]
        stopped = _monarch("stop", "--keep-cluster", "--state", str(state), cwd=tmp_path)  # the generic command
        assert stopped.returncode == 0, stopped.stderr
        record = standin._record("msky-keep")
        assert record["state"] == "UP" and record["autostop"] == {"idle_minutes": 20, "down": False}
        assert all(not _non_sshd(ns) for ns, _ in sky_nodes)  # the agents ended; the nodes are up
        assert not state.exists()

        # Another shape on that name is refused before SkyPilot is asked to launch; the cluster is untouched.
        wrong = _monarch(
            "serve",
            "--scheduler",
            "skypilot",
            "--hosts",
            "1",
            "--cluster",
            "msky-keep",
            "--state",
            str(state),
            cwd=tmp_path,
        )
        assert wrong.returncode != 0 and "cluster msky-keep exists (UP) with 2 node(s), not 1" in wrong.stderr
        assert len(wrong.stderr.strip().splitlines()) == 1, wrong.stderr
        assert standin._record("msky-keep")["launches"] == 1

        progress: list[str] = []
        job = serve(None, "skypilot", state=state, hosts=2, cluster="msky-keep", progress=progress.append)
        assert "reusing cluster msky-keep (UP, 2 node(s))" in progress and job.state.scheduler_data["reused"]
        assert standin._record("msky-keep")["launches"] == 2
        out = io.BytesIO()
        assert job.exec("hostname -I", stdout=out, stderr=out).exit_code == 0
        assert all(a in out.getvalue().decode() for _, a in sky_nodes), out.getvalue()
        job.stop(keep_cluster=True, autostop=3)  # the Python API takes the same options
        assert standin._record("msky-keep")["autostop"] == {"idle_minutes": 3, "down": False}
    finally:
        standin.down("msky-keep")


def _agent_peers(ns: str, port: int) -> list[str]:
    """The peer addresses of the connections into ``port`` inside namespace ``ns``."""
    out = subprocess.run(
        ["ip", "netns", "exec", ns, "ss", "-Htn", "state", "established", f"( sport = :{port} )"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    return [line.split()[-1].rpartition(":")[0] for line in out.splitlines() if line.strip()]


def test_agents_behind_a_firewall_are_reached_through_ssh_tunnels_to_the_head(
    standin: NamespaceProvisioner,
    sky_nodes: list[tuple[str, str]],
    sky_internal: list[tuple[str, str]],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    sky_ssh: SkySsh,
) -> None:
    # The nodes know each other by internal addresses the client has no route to; the agents listen
    # only there, so their port is closed to the client. SkyPilot gives SSH access to the head.
    monkeypatch.setenv("MSKY_INTERNAL", ",".join(f"{ns}={address}" for ns, address in sky_internal))
    monkeypatch.setenv("MSKY_SSH", f"{sky_ssh.user}:{sky_ssh.key_file}")
    ws = tmp_path / "ws"
    ws.mkdir()
    (ws / "train.py").write_text(ALLREDUCE)
    (ws / "data.txt").write_text("v2")
    state = ws / ".monarch" / "job_state.pkl"
    served = _monarch(
        "serve", "--scheduler", "skypilot", "--hosts", "2", "--cluster", "msky-fw", "--state", str(state), cwd=ws
    )
    try:
        assert served.returncode == 0, served.stderr
        for _, address in sky_nodes:  # nothing answers on the agents' port where the client can reach
            with pytest.raises(OSError):
                socket.create_connection((address, 26600), timeout=1).close()
        done = _monarch(
            "run-spmd",
            "--state",
            str(state),
            "-e",
            "GLOO_SOCKET_IFNAME=eth1",
            "--",
            "torchrun",
            "--nproc-per-node=1",
            "train.py",
            cwd=ws,
        )
        assert done.returncode == 0, done.stdout + done.stderr
        lines = [line for line in (done.stdout + done.stderr).splitlines() if " sum " in line]
        assert len(lines) == 2 and all("sum 3 " in line and "data v2" in line for line in lines), done.stderr
        # This process too reaches them through its own forwards; every connection into an agent
        # came over the head's sshd (from the head's internal address), none from the client.
        job = job_load(state)
        assert job.status()["alive"]
        head_internal = sky_internal[0][1]
        for ns, _ in sky_nodes:
            peers = _agent_peers(ns, 26600)
            assert peers and set(peers) == {head_internal}, peers
        status = _monarch("status", "--state", str(state), "--json", cwd=ws)
        assert status.returncode == 0, status.stderr
        info = json.loads(status.stdout)
        assert info["skypilot"]["reach"] == "tunnel" and [h["alive"] for h in info["hosts"]] == [True, True]
        text = _monarch("status", "--state", str(state), cwd=ws).stdout
        assert f"agents reached through SSH tunnels to root@{sky_ssh.address}:22" in text, text
    finally:
        stopped = _monarch("stop", "--state", str(state), cwd=ws)
    assert stopped.returncode == 0, stopped.stderr
    assert all(not netns_pids(ns) for ns, _ in sky_nodes)
    assert not Path(os.environ["MSKY_STATE"], "msky-fw.json").exists()


def test_the_heads_host_key_is_recorded_then_required(sky_ssh: SkySsh, tmp_path: Path) -> None:
    from monarch_cli.errors import SchedulerError
    from monarch_cli.schedulers.skypilot.ssh_access import SshAccess, connect

    access = SshAccess(sky_ssh.address, 22, sky_ssh.user, str(sky_ssh.key_file))
    connect(access).close()  # a node SkyPilot just made: its key is recorded
    assert access.host_key.startswith("ssh-ed25519 ")
    connect(access).close()  # and then required
    subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(tmp_path / "other")], check=True)
    other = (tmp_path / "other.pub").read_text().split()
    with pytest.raises(SchedulerError, match="host key has CHANGED"):
        connect(SshAccess(sky_ssh.address, 22, sky_ssh.user, str(sky_ssh.key_file), f"{other[0]} {other[1]}"))
    with pytest.raises(SchedulerError, match=r"10.215.0.99:22 is unreachable"):
        connect(SshAccess("10.215.0.99", 22, "root", str(sky_ssh.key_file)), timeout=1)


def test_nodes_whose_interpreter_has_nothing_of_ours_run_the_shipped_bundle(
    standin: NamespaceProvisioner, sky_nodes: list[tuple[str, str]], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A stock image's Python (Debian's, with torch and numpy only): setup unzips the bundle the task
    mounts, the agents and ranks run from it, a two-node gloo run needs no -e."""
    from tests.ssh.conftest import _bare_venv

    python = _bare_venv()
    monkeypatch.delenv("PYTHONPATH")  # the nodes see nothing of this checkout
    probe = subprocess.run([python, "-c", "import zmq"], capture_output=True, text=True)
    assert "No module named 'zmq'" in probe.stderr
    ws = tmp_path / "ws"
    ws.mkdir()
    (ws / "train.py").write_text(ALLREDUCE)
    (ws / "data.txt").write_text("bare")
    monkeypatch.chdir(ws)
    job = serve(None, "skypilot", state=ws / ".monarch" / "s.pkl", hosts=2, cluster="msky-bare", python=python)
    try:
        # The agent and what it started run our shipped code: their memory maps hold pyzmq's extension from
        # the unpacked bundle. (Not their environ: setproctitle reuses that memory once the title is set.)
        maps = [_maps_of(pid) for pid in netns_pids(sky_nodes[0][0])]
        assert any("/tmp/.monarch-cli/bundles/deps-" in m for m in maps), [m[:200] for m in maps]
        out = io.BytesIO()
        result = job.run_spmd(["torchrun", "--nproc-per-node=1", "train.py"], stdout=out, stderr=out)
        text = out.getvalue().decode()
        assert result.exit_code == 0 and text.count("sum 3 ") == 2 and text.count("data bare") == 2, text
    finally:
        job.stop()
