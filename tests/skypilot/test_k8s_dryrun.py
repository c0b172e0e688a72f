"""SkyPilot's real dry run of our task, with an emulated Kubernetes context as its infra.

``monarch serve --dry-run --json`` prints the task; SkyPilot then loads it as ``sky launch
task.yaml`` does, enables its Kubernetes cloud through ``sky check`` against the emulator
(tests/kubernetes/apiserver.py, plus the two cluster-scoped reads SkyPilot makes: ``/version``
and the node list), and runs the launch with ``dryrun=True``: its optimizer, the Kubernetes
cloud's deploy variables and its own pod-config validation, up to "Dryrun finished".

Two things stand in for what a networked machine has: SkyPilot's Kubernetes image catalog
(fetched from GitHub on first use, every 7 hours) is written to its cache first, two rows
naming SkyPilot's default images; and the launch is called as the API server calls it
(``sky.execution.launch``), in a process of its own, not through a local API server daemon
that ``sky launch`` would start.

SkyPilot 0.14 supports the ``kubernetes`` client < 36 (its ``[kubernetes]`` extra); the tests
install 37 (the kubernetes backend's tests need it with the emulator). From 36 on the client's
models name their types ``List[X]``/``Dict[K, V]`` where SkyPilot's pod validator reads
``list[X]``/``dict(K, V)`` ("No module named 'kubernetes.client.models.Dict[str, str]'"), so the
validator is shown the same models under the old names; its logic and the client are untouched.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from ..kubernetes.apiserver import ApiServer

pytestmark = [pytest.mark.slow]
REPO = str(Path(__file__).resolve().parents[2])

NODE = {
    "kind": "Node",
    "apiVersion": "v1",
    "metadata": {"name": "emu-node-1", "labels": {"kubernetes.io/hostname": "emu-node-1"}},
    "status": {
        "capacity": {"cpu": "16", "memory": "64Gi", "pods": "110"},
        "allocatable": {"cpu": "16", "memory": "64Gi", "pods": "110"},
        "addresses": [{"type": "InternalIP", "address": "10.0.0.5"}],
        "conditions": [{"type": "Ready", "status": "True"}],
    },
}

# SkyPilot's catalog of its default pod images (kubernetes/images.csv in skypilot-org/skypilot-catalog).
IMAGES = (
    "Tag,ImageId\n"
    "skypilot:custom-cpu-ubuntu-2204-v1,docker:us-docker.pkg.dev/sky-dev-465/skypilotk8s/skypilot:latest\n"
    "skypilot:custom-gpu-ubuntu-2204-v1,docker:us-docker.pkg.dev/sky-dev-465/skypilotk8s/skypilot-gpu:latest\n"
)

DRYRUN = textwrap.dedent("""\
    import sys
    import sky
    from sky import check, execution
    from sky.catalog import common
    from sky.provision.kubernetes import utils

    if int(__import__("kubernetes").__version__.split(".")[0]) >= 36:
        # SkyPilot 0.14 supports the kubernetes client < 36 (its [kubernetes] extra); 36 renamed the
        # models' type strings (list[X] -> List[X], dict(K, V) -> Dict[K, V]), which its PodValidator
        # reads. Its validator sees the models with the old names; the client itself keeps its own.
        import re, kubernetes.client.models as models

        def old(t):
            m = re.fullmatch(r"List\\[(.*)\\]", t)
            if m:
                return "list[" + old(m.group(1)) + "]"
            m = re.fullmatch(r"Dict\\[(\\w+), (.*)\\]", t)
            if m:
                return "dict(" + m.group(1) + ", " + old(m.group(2)) + ")"
            return "str" if t == "bytes" else t

        class OldNames:
            cache = {}

            def __getattr__(self, name):
                real = getattr(models, name)
                if not isinstance(getattr(real, "openapi_types", None), dict):
                    return real
                if name not in self.cache:
                    types = {k: old(v) for k, v in real.openapi_types.items()}
                    self.cache[name] = type(name, (real,), {"openapi_types": types})
                return self.cache[name]

        utils.kubernetes_models = OldNames()

    path = common.get_catalog_path("kubernetes/images.csv")
    import os
    os.makedirs(os.path.dirname(path), exist_ok=True)
    open(path, "w").write(sys.argv[2])
    task = sky.Task.from_yaml(sys.argv[1])
    task.update_secrets({"MONARCH_RESERVATION_KEYS": "not-a-real-key"})
    check.check_capability(sky.clouds.CloudCapability.COMPUTE, quiet=False, clouds=["kubernetes"])
    execution.launch(task, cluster_name=task.name, dryrun=True)
    """)


def _install_tools() -> None:
    """``sky check`` enables Kubernetes only where socat, nc and rsync are (it uses them to reach pods)."""
    if all(shutil.which(tool) for tool in ("socat", "nc", "rsync")):
        return
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    for cmd in (["apt-get", "update", "-qq"], ["apt-get", "install", "-y", "-qq", "socat", "netcat-openbsd", "rsync"]):
        done = subprocess.run(cmd, capture_output=True, text=True, env=env)
        if done.returncode != 0:
            pytest.fail(
                f"{' '.join(cmd)} failed (SkyPilot's Kubernetes cloud needs socat, nc, rsync): {done.stderr[-1000:]}"
            )


@pytest.fixture
def emulator() -> Iterator[ApiServer]:
    """The Kubernetes emulator, answering also the cluster-scoped reads SkyPilot's ``sky check`` makes."""
    server = ApiServer()
    base = server.httpd.RequestHandlerClass

    class WithNodes(base):  # type: ignore[valid-type,misc]
        def do_GET(self) -> None:
            reply = {
                "/version": {"major": "1", "minor": "30", "gitVersion": "v1.30.0"},
                "/api/v1/nodes": {
                    "kind": "NodeList",
                    "apiVersion": "v1",
                    "metadata": {"resourceVersion": "1"},
                    "items": [NODE],
                },
            }.get(self.path.split("?")[0])
            if reply is not None:
                return self._send(200, reply)
            return base.do_GET(self)

    server.httpd.RequestHandlerClass = WithNodes
    try:
        yield server
    finally:
        server.close()


def test_skypilot_dry_run_accepts_our_task_on_an_emulated_kubernetes_context(
    emulator: ApiServer, tmp_path: Path
) -> None:
    _install_tools()
    home = tmp_path / "home"
    (home / ".kube").mkdir(parents=True)
    (home / ".sky").mkdir()
    emulator.kubeconfig(home / ".kube" / "config")
    (home / ".sky" / "config.yaml").write_text("kubernetes:\n  networking: nodeport\n")
    env = {
        **os.environ,
        "HOME": str(home),
        "PYTHONPATH": os.pathsep.join([p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p] + [REPO]),
    }
    planned = subprocess.run(
        [
            sys.executable,
            "-m",
            "monarch_cli",
            "serve",
            "--scheduler",
            "skypilot",
            "--hosts",
            "2",
            "--cloud",
            "kubernetes",
            "--dry-run",
            "--json",
            "--",
            "python",
            "train.py",
        ],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert planned.returncode == 0, planned.stderr
    plan: Any = json.loads(planned.stdout)
    task = tmp_path / "task.yaml"
    task.write_text(plan["artifacts"]["task.yaml (secrets redacted)"])
    done = subprocess.run(
        [sys.executable, "-c", DRYRUN, str(task), IMAGES],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=240,
    )
    out = done.stdout + done.stderr
    assert done.returncode == 0, out[-3000:]
    assert "Dryrun finished." in out, out[-3000:]
    assert "Kubernetes (emulator)" in out and "2 nodes" in out, out[-3000:]  # the optimizer chose the context
    assert "not-a-real-key" not in out
