"""``--scheduler torchx:kubernetes`` for real: torchx's own kubernetes scheduler submits its Volcano job
to the API emulator, :mod:`.volcano` turns it into pods, :mod:`.kubelet` runs them under a stock
interpreter (torch, nothing of ours). The keys travel only in a Secret the pods mount; the bundle
reaches each pod's bootstrap from the client; a two-host gloo run; stop cancels the app through
torchx and deletes the Secret. What this cannot show (real Volcano: queues, gang scheduling, its
svc plugin; cluster DNS) is in docs/torchx.md.
"""

from __future__ import annotations

import base64
import json
import os
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest

from ..conftest import wait_until
from .apiserver import ApiServer
from .kubelet import Kubelet
from .test_kubernetes_backend import ALLREDUCE, IMAGE, REPO, _maps_of
from .volcano import VolcanoController

pytestmark = pytest.mark.slow


@pytest.fixture
def volcano_cluster(tmp_path: Path, stock: str) -> Iterator[tuple[ApiServer, Kubelet, str]]:
    server = ApiServer()
    kubelet = Kubelet(server.store, images={IMAGE: ""}, root=tmp_path / "kubelet", python=stock)
    controller = VolcanoController(server.store)
    server.dial = kubelet.dial
    yield server, kubelet, server.kubeconfig(tmp_path / "kubeconfig")
    controller.close()
    kubelet.close()
    server.close()
    assert not kubelet.errors and not controller.errors, (kubelet.errors, controller.errors)


def _free_ports(count: int) -> int:
    for _ in range(50):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            base = s.getsockname()[1]
        try:
            for i in range(count):
                with socket.socket() as s:
                    s.bind(("0.0.0.0", base + i))
            return base
        except OSError:
            continue
    raise AssertionError("no free ports")


def test_torchx_kubernetes_serve_ships_the_bundle_runs_and_stop_leaves_nothing(
    volcano_cluster: tuple[ApiServer, Kubelet, str], tmp_path: Path
) -> None:
    server, kubelet, kubeconfig = volcano_cluster
    workspace = tmp_path / "project"
    workspace.mkdir()
    (workspace / "allreduce.py").write_text(ALLREDUCE)
    env = {**os.environ, "PYTHONPATH": REPO, "KUBECONFIG": kubeconfig}

    def monarch(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run(
            [sys.executable, "-m", "monarch_cli", *args], capture_output=True, text=True, cwd=workspace, env=env,
            timeout=300,
        )  # fmt: skip

    served = monarch(
        "serve", "--scheduler", "torchx:kubernetes", "--hosts", "2", "--json", "--queue", "default",
        "-o", f"agent_image={IMAGE}", "--agent-port", str(_free_ports(2)),
        "--", "torchrun", "--nproc-per-node=1", "allreduce.py",
    )  # fmt: skip
    assert served.returncode == 0, served.stderr
    rid = json.loads(served.stdout)["reservation_id"]
    try:
        secret = server.store.get("secrets", "default", f"{rid}-keys")
        keys = base64.b64decode(secret["data"]["keys"]).decode().strip()
        (job,) = server.store.list("vcjobs", "default")[0]
        assert keys not in json.dumps(job) and keys not in served.stdout + served.stderr  # only in the Secret
        for task in job["spec"]["tasks"]:
            pod = task["template"]
            assert {"name": "monarch-keys", "secret": {"secretName": f"{rid}-keys", "defaultMode": 0o400}} in pod[
                "spec"
            ]["volumes"]
        status = json.loads(monarch("status", "--json").stdout)["torchx"]
        assert status["app_handle"].startswith("kubernetes://") and status["state"] == "RUNNING", status
        assert status["keys"] == f"Secret default/{rid}-keys"
        shipped = status["bundle"]
        assert len(shipped) == 2 and all(p and p["shipped"] > 1_000_000 for p in shipped), shipped
        agents = [
            p.pid for p in psutil.process_iter(["cmdline"]) if (p.info["cmdline"] or [""])[0].startswith("monarch agent")
            and rid in p.info["cmdline"][0]
        ]  # fmt: skip
        assert len(agents) == 2, agents
        for pid in agents:  # the stock interpreter had no zmq: it runs from the bundle the client shipped
            assert f"/volumes/monarch-bundle/bundles/{shipped[0]['deps']}/site/zmq" in _maps_of(pid), pid
        run = monarch("run-spmd", "--no-color")
        assert run.returncode == 0, run.stderr
        assert sorted(line.split("] ", 1)[1] for line in run.stdout.splitlines() if line.startswith("[rank")) == [
            "sum 3 host 0",
            "sum 3 host 1",
        ], run.stdout
    finally:
        stopped = monarch("stop")
    assert stopped.returncode == 0, stopped.stderr
    assert wait_until(lambda: not server.store.list("pods", "default")[0], 30)  # Volcano's pods, gone with the app
    (job,) = server.store.list("vcjobs", "default")[0]
    assert job["status"]["state"]["phase"] == "Aborted"  # torchx's cancel
    assert not server.store.list("secrets", "default")[0]  # the keys' Secret is deleted
    assert wait_until(lambda: not kubelet.pids(), 30)
