"""The out-of-cluster path: pods whose IPs the client cannot reach, driven through one port-forward
per pod over the Kubernetes API (the real ``kubernetes`` client's websocket port-forward).

Each pod runs in a network namespace of its own (tests/netns.py: ``mk8s-h1``, ``mk8s-h2`` on a
bridge, ``10.216.0.11``/``.12``), and the client's namespace has no route to them (the bridge
has no address here, the subnet is ``unreachable``); the pods reach each other over the
bridge. The emulator relays each port-forward to the agent's port on the pod's localhost,
from a thread inside the pod's namespace, as the kubelet does. The pods' interpreter has
nothing of ours: the bundle reaches them through the forwards too. Needs root.
"""

from __future__ import annotations

import json
import os
import socket
from collections.abc import Iterator
from pathlib import Path

import pytest

from monarch_cli.jobs import job_load
from monarch_cli.runtime.mailbox.mailbox import Mailbox

from ..netns import add_hosts, remove_hosts, sh
from .apiserver import ApiServer
from .kubelet import Kubelet
from .test_kubernetes_backend import ALLREDUCE, IMAGE, _maps_of, _monarch, _processes_of

pytestmark = pytest.mark.slow
PREFIX, SUBNET = "mk8s", "10.216.0"  # apart from the ssh (mssh) and skypilot (msky) tests' hosts
PORT = 29600


@pytest.fixture(scope="module")
def pod_network() -> Iterator[list[tuple[str, str]]]:
    if os.geteuid() != 0:
        pytest.skip("pods in network namespaces of their own need root")
    sh("ip", "route", "del", "unreachable", f"{SUBNET}.0/24", check=False)
    remove_hosts(PREFIX, 2)  # what a killed run left
    hosts = add_hosts(PREFIX, SUBNET, 2)
    try:
        sh("ip", "addr", "del", f"{SUBNET}.1/24", "dev", f"{PREFIX}-br0")  # no route from here...
        sh("ip", "route", "add", "unreachable", f"{SUBNET}.0/24")  # ...and a quick "No route to host"
        yield hosts
    finally:
        sh("ip", "route", "del", "unreachable", f"{SUBNET}.0/24", check=False)
        remove_hosts(PREFIX, 2)


@pytest.fixture
def cluster(
    pod_network: list[tuple[str, str]], tmp_path: Path, stock: str
) -> Iterator[tuple[ApiServer, Kubelet, str, Path]]:
    workspace = tmp_path / "project"
    workspace.mkdir()
    server = ApiServer()
    kubelet = Kubelet(
        server.store, images={IMAGE: ""}, root=tmp_path / "kubelet", hide=[workspace], nodes=pod_network, python=stock
    )
    server.dial = kubelet.dial
    yield server, kubelet, server.kubeconfig(tmp_path / "kubeconfig"), workspace
    kubelet.close()
    server.close()
    assert not kubelet.errors, kubelet.errors


def _agent_peers(netns: str) -> list[str]:
    """The peer addresses of the connections into the agent's port inside ``netns``."""
    out = sh("ip", "netns", "exec", netns, "ss", "-Htn", "state", "established", f"( sport = :{PORT} )").stdout
    return [line.split()[-1].rpartition(":")[0] for line in out.splitlines() if line.strip()]


def test_a_client_outside_the_cluster_drives_the_pods_through_port_forwards(
    cluster: tuple[ApiServer, Kubelet, str, Path], pod_network: list[tuple[str, str]]
) -> None:
    server, kubelet, kubeconfig, workspace = cluster
    (workspace / "allreduce.py").write_text(ALLREDUCE + "print('data', open('data.txt').read())\n")
    (workspace / "data.txt").write_text("from the laptop")
    for _, ip in pod_network:  # the pods are out of this client's reach
        with pytest.raises(OSError):
            socket.create_connection((ip, PORT), timeout=1).close()

    served = _monarch(
        workspace, "serve", "-s", "kubernetes", "--hosts", "2", "--image", IMAGE, "--kubeconfig", kubeconfig
    )
    assert served.returncode == 0, served.stderr
    assert "Traceback" not in served.stderr, served.stderr
    job = job_load(workspace / ".monarch" / "job_state.pkl")
    rid = job.state.reservation_id
    assert job.state.scheduler_data["kubernetes"]["reach"] == "port-forward"
    shipped = job.state.scheduler_data["kubernetes"]["bundle"]  # through the forwards, to a stock interpreter
    assert all(b["shipped"] > 1_000_000 for b in shipped), shipped
    for pid in kubelet.pids():  # the agents run it: pyzmq's extension from the pod's bundle volume
        assert f"/volumes/monarch-bundle/bundles/{shipped[0]['deps']}/site/zmq" in _maps_of(pid), pid
    assert sorted(h.agent for h in job.state.hosts) == [f"tcp://{ip}:{PORT}" for _, ip in pod_network]

    ran = _monarch(workspace, "run-spmd", "--", "python", "allreduce.py")  # gloo between the pods, code synced
    assert ran.returncode == 0, ran.stderr
    assert ran.stdout.count("sum 3") == 2 and ran.stdout.count("data from the laptop") == 2, ran.stdout
    assert "synced 2 files" in ran.stderr, ran.stderr

    hs = job.hostset()  # this process's own forwards: every connection into an agent comes from its pod's localhost
    try:
        assert all(h.agent.startswith("tcp://127.0.0.1:") for h in hs.hosts), hs.hosts
        for netns, _ in pod_network:
            peers = _agent_peers(netns)
            assert peers and set(peers) == {"127.0.0.1"}, peers
    finally:
        Mailbox.discard(job.keys)

    status = _monarch(workspace, "status", "--json")
    assert status.returncode == 0, status.stderr
    shown = json.loads(status.stdout)
    assert [h["alive"] for h in shown["hosts"]] == [True, True] and shown["kubernetes"]["reach"] == "port-forward"
    assert "agents reached through a port-forward per pod over the Kubernetes API" in shown["scheduler_lines"]
    debug = _monarch(workspace, "debug", "list")
    assert debug.returncode == 0 and "Traceback" not in debug.stderr, debug.stdout + debug.stderr

    stopped = _monarch(workspace, "stop")
    assert stopped.returncode == 0, stopped.stderr
    assert not [p for p in (ran, status, stopped) if "Traceback" in p.stderr or "Exception" in p.stderr]
    assert server.store.list("pods", "default")[0] == [] and kubelet.pids() == [] and _processes_of(rid) == []
    for netns, _ in pod_network:
        assert sh("ip", "netns", "pids", netns).stdout.split() == []


def test_never_forwarding_from_outside_the_cluster_is_one_line(cluster: tuple[ApiServer, Kubelet, str, Path]) -> None:
    server, kubelet, kubeconfig, workspace = cluster
    done = _monarch(
        workspace,
        "serve",
        "-s",
        "kubernetes",
        "--hosts",
        "2",
        "--image",
        IMAGE,
        "--kubeconfig",
        kubeconfig,
        "--port-forward",
        "never",
        timeout=60,
    )
    lines = done.stderr.strip().splitlines()
    assert done.returncode != 0 and len(lines) == 1, done.stderr
    assert "is not reachable from here (No route to host)" in lines[0] and "--port-forward" in lines[0], lines[0]
    assert server.store.list("pods", "default")[0] == [] and kubelet.pids() == []
