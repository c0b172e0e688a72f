"""The manifests of `monarch serve --scheduler kubernetes`, against golden files and the official client's models.

No cluster is contacted: a dry run renders the manifests. Each one is also loaded into the
``kubernetes`` client's models and serialised back: a misspelt or misplaced field would be
dropped on the way and the round trip would differ. To accept a deliberate change of a
manifest, run with MONARCH_UPDATE_GOLDEN=1 and review the diff.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from monarch_cli import __version__
from monarch_cli.jobs import dryrun
from monarch_cli.runtime.launch import bundle
from monarch_cli.schedulers.kubernetes.manifests import REDACTED

from ..conftest import assert_golden

GOLDEN = Path(__file__).parent / "golden"
REPO = Path(__file__).resolve().parents[2]
TORCHRUN = ["torchrun", "--nproc-per-node=2", "train.py"]
MODELS = {"Secret": "V1Secret", "Service": "V1Service", "Job": "V1Job"}


def _normalize(text: str) -> str:
    return (
        re.sub(r"monarch-[0-9a-f]{8}\b", "monarch-RID", text)
        .replace(repr(__version__), "'VERSION'")
        .replace(f"=={__version__}", "==VERSION")
        .replace(f"client {__version__}", "client VERSION")
    )


def _golden(name: str, text: str) -> None:
    assert_golden(GOLDEN / name, text)


def _docs(text: str) -> list[dict[str, Any]]:
    return [d for d in yaml.safe_load_all(text) if d]


def _round_trip(doc: dict[str, Any]) -> None:
    """Load ``doc`` into the client's model and back: every field must survive (valid names and shapes)."""
    from kubernetes.client import ApiClient

    api = ApiClient()
    model = api._ApiClient__deserialize(doc, MODELS[doc["kind"]])
    assert api.sanitize_for_serialization(model) == doc


def _plan(tmp_path: Path, hosts: int = 2, **options: Any) -> Any:
    return dryrun(TORCHRUN, "kubernetes", hosts=hosts, state=tmp_path / ".monarch" / "job_state.pkl", **options)


def test_minimal_manifests(tmp_path: Path) -> None:
    plan = _plan(tmp_path, image="registry.example/train:1")
    text = plan.artifacts["manifests"]
    _golden("minimal.yaml", _normalize(text))
    secret, service, job = _docs(text)
    assert [d["kind"] for d in (secret, service, job)] == ["Secret", "Service", "Job"]
    assert secret["data"] == {"keys": REDACTED}
    spec = job["spec"]
    assert (spec["completionMode"], spec["completions"], spec["parallelism"], spec["backoffLimit"]) == (
        "Indexed",
        2,
        2,
        0,
    )
    pod = spec["template"]["spec"]
    assert pod["restartPolicy"] == "Never" and pod["subdomain"] == service["metadata"]["name"]
    assert service["spec"]["clusterIP"] == "None"
    (container,) = pod["containers"]
    assert container["command"][:2] == ["python3", "-c"] and "initContainers" not in pod  # no image check by name
    assert "--port" in container["command"] and "keys" not in " ".join(container["command"][4:]).lower()
    assert {"name": "monarch-bundle", "emptyDir": {}} in pod["volumes"]
    assert {"name": "dshm", "emptyDir": {"medium": "Memory"}} in pod["volumes"]
    for doc in (secret, service, job):
        _round_trip(doc)


def test_every_option_reaches_the_manifests(tmp_path: Path) -> None:
    template = tmp_path / "pod.yaml"
    template.write_text(
        yaml.safe_dump(
            {
                "metadata": {"labels": {"site": "east"}},
                "spec": {
                    "nodeSelector": {"cloud.google.com/gke-accelerator": "nvidia-h100-80gb"},
                    "tolerations": [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}],
                    "volumes": [{"name": "data", "persistentVolumeClaim": {"claimName": "datasets"}}],
                    "containers": [{"name": "agent", "volumeMounts": [{"name": "data", "mountPath": "/data"}]}],
                },
            }
        )
    )
    plan = _plan(
        tmp_path,
        hosts=4,
        image="registry.example/train:1",
        namespace="ml",
        gpus_per_node=8,
        cpu="32",
        memory="256Gi",
        queue="team-a",
        label=["team=ml", "run=exp-7"],
        annotation=["kueue.x-k8s.io/podset-required-topology=cloud.google.com/gce-topology-block"],
        pod_template=str(template),
        service_account="trainer",
        time="2:00:00",
        agent_port=29700,
    )
    text = plan.artifacts["manifests"]
    _golden("all_options.yaml", _normalize(text))
    secret, service, job = _docs(text)
    assert job["metadata"]["labels"]["kueue.x-k8s.io/queue-name"] == "team-a" and job["spec"]["suspend"] is True
    assert job["spec"]["activeDeadlineSeconds"] == 7200
    pod = job["spec"]["template"]
    assert pod["metadata"]["labels"]["team"] == "ml" and pod["metadata"]["labels"]["site"] == "east"
    assert "kueue.x-k8s.io/podset-required-topology" in pod["metadata"]["annotations"]
    (container,) = pod["spec"]["containers"]
    assert container["resources"]["limits"] == {"cpu": "32", "memory": "256Gi", "nvidia.com/gpu": "8"}
    assert container["resources"]["requests"] == container["resources"]["limits"]
    assert {"name": "data", "mountPath": "/data"} in container["volumeMounts"]
    assert pod["spec"]["tolerations"][0]["key"] == "nvidia.com/gpu" and pod["spec"]["serviceAccountName"] == "trainer"
    assert {v["name"] for v in pod["spec"]["volumes"]} == {"data", "monarch-keys", "dshm", "monarch-bundle"}
    for doc in (secret, service, job):
        _round_trip(doc)


def _cli(*args: str, block_client: bool = False, cwd: Path) -> subprocess.CompletedProcess:
    prelude = "import sys; sys.modules['kubernetes'] = None; " if block_client else "import sys; "
    code = prelude + "from monarch_cli.cli import main; sys.argv = ['monarch', *sys.argv[1:]]; main()"
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    return subprocess.run(
        [sys.executable, "-c", code, *args], capture_output=True, text=True, cwd=cwd, env=env, timeout=60
    )


def test_dry_run_from_the_cli_redacts_the_keys(tmp_path: Path) -> None:
    done = _cli(
        "serve",
        "-s",
        "kubernetes",
        "--hosts",
        "2",
        "--image",
        "img:1",
        "--dry-run",
        "--",
        "python",
        "x.py",
        cwd=tmp_path,
        block_client=True,
    )  # a dry run needs no client and no cluster
    assert done.returncode == 0, done.stderr
    assert "# manifests" in done.stdout and f"keys: {REDACTED}" in done.stdout
    assert not (tmp_path / ".monarch" / "job_state.pkl").exists()
    # what is shipped, and how: the code's content hash, the dependencies, no install by name, no registry
    code = bundle.code_summary()
    assert f"content {code['code_hash']}" in done.stdout and f"pyzmq=={code['dependencies']['pyzmq']}" in done.stdout
    assert "nothing is installed by name" in done.stdout and "HMAC" in done.stdout
    assert "pip install" not in done.stdout and "monarch-cli==" not in done.stdout
    done = _cli("serve", "-s", "kubernetes", "--hosts", "2", "--image", "img:1", "--dry-run", "--json", cwd=tmp_path)
    plan = json.loads(done.stdout)
    (secret,) = [m for m in plan["data"]["manifests"] if m["kind"] == "Secret"]
    assert secret["data"] == {"keys": REDACTED} and plan["scheduler"] == "kubernetes"
    assert plan["data"]["bundle"]["code_hash"] == code["code_hash"] and plan["data"]["bundle"]["files"] > 50


def test_without_the_client_one_line_says_what_to_install(tmp_path: Path) -> None:
    done = _cli("serve", "-s", "kubernetes", "--hosts", "1", "--image", "img:1", cwd=tmp_path, block_client=True)
    assert done.returncode != 0
    assert done.stderr.strip().splitlines() == [
        "monarch: error: the kubernetes scheduler needs the kubernetes client: pip install 'kubernetes>=30,<38'"
    ]


@pytest.mark.parametrize(
    "args, message",
    [
        (["--hosts", "0", "--image", "x"], "--hosts must be at least 1"),
        (["--hosts", "2", "--image", "x", "--label", "no-equals"], "--label takes key=value"),
        (["--hosts", "2", "--image", "x", "--label", "team=not ok"], "is not a valid label value"),
        (["--hosts", "2"], "needs --image IMAGE"),
        (["--hosts", "2", "--image", "x", "--time", "soon"], "--time takes"),
        (["--hosts", "2", "--image", "x", "--memory", "lots"], "--memory takes a Kubernetes quantity"),
        (["--hosts", "2", "--image", "x", "--pod-template", "/nonexistent.yaml"], "cannot read --pod-template"),
        (["--hosts", "2", "--image", "x", "--port-forward", "sometimes"], "--port-forward takes auto, always, never"),
    ],
)
def test_bad_input_is_one_line(tmp_path: Path, args: list[str], message: str) -> None:
    done = _cli("serve", "-s", "kubernetes", *args, "--dry-run", cwd=tmp_path)
    assert done.returncode != 0
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and message in lines[0] and "Traceback" not in done.stderr, done.stderr


def test_a_bad_kubeconfig_is_one_line(tmp_path: Path) -> None:
    broken = tmp_path / "broken"
    broken.write_text("clusters: [\n")
    for kubeconfig, message in [
        (tmp_path / "missing", "does not exist"),
        (broken, "cannot load the Kubernetes configuration"),
    ]:
        done = _cli(
            "serve", "-s", "kubernetes", "--hosts", "1", "--image", "x", "--kubeconfig", str(kubeconfig), cwd=tmp_path
        )
        lines = done.stderr.strip().splitlines()
        assert done.returncode == 2 and len(lines) == 1 and message in lines[0], done.stderr
