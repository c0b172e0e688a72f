"""The Kubernetes objects of one reservation, as plain dicts: built by ``plan()``, printed by ``--dry-run``.

Pure data (no ``kubernetes`` client needed): a Secret with the reservation keys (filled in
only by ``reserve``; the plan holds a placeholder), a headless Service naming the pods, and
an Indexed ``batch/v1`` Job whose pods each run one host agent on a fixed port.
"""

from __future__ import annotations

import base64
import copy
import json
import re
from pathlib import Path
from typing import Any

from ...config import KEY_FILE_ENV, EnvSettings
from ...errors import OptionError
from ...runtime.launch.command import AgentCommand
from .. import bootstrap, yaml_text

#: Label on every object of a reservation (the selector ``stop`` and the pod watch use).
RESERVATION_LABEL = "monarch-cli/reservation"
MANAGED_BY = {"app.kubernetes.io/managed-by": "monarch-cli"}
QUEUE_LABEL = "kueue.x-k8s.io/queue-name"
INDEX_LABEL = "batch.kubernetes.io/job-completion-index"
KEYS_DIR = "/etc/monarch/keys"
KEYS_FILE = "keys"
REDACTED = "<redacted>"
DEFAULT_AGENT_PORT = 29600
CONTAINER = "agent"

_LABEL_NAME = re.compile(
    r"^([a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*/)?"
    r"[A-Za-z0-9]([-A-Za-z0-9_.]{0,61}[A-Za-z0-9])?$"
)
_LABEL_VALUE = re.compile(r"^([A-Za-z0-9]([-A-Za-z0-9_.]{0,61}[A-Za-z0-9])?)?$")
_DNS_LABEL = re.compile(r"^[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?$")
_QUANTITY = re.compile(r"^[0-9]+(\.[0-9]+)?(m|k|M|G|T|P|E|Ki|Mi|Gi|Ti|Pi|Ei)?$")


def parse_pairs(items: list[str], flag: str, *, label_values: bool) -> dict[str, str]:
    """``k=v`` words (``--label``/``--annotation``) as a dict; a malformed one is a one-line error."""
    pairs: dict[str, str] = {}
    for item in items:
        key, eq, value = str(item).partition("=")
        if not eq or not _LABEL_NAME.match(key) or len(key.rpartition("/")[2]) > 63:
            raise OptionError(f"{flag} takes key=value with a Kubernetes key (e.g. team=ml), not {item!r}")
        if label_values and not _LABEL_VALUE.match(value):
            raise OptionError(
                f"{flag} {key}: {value!r} is not a valid label value (63 characters at most: "
                "letters, digits, '-', '_', '.')"
            )
        pairs[key] = value
    return pairs


def parse_duration(text: str) -> int:
    """``--time`` as seconds: Slurm's ``MM``, ``HH:MM:SS``, ``D-HH:MM:SS``, or ``90s``/``30m``/``2h``/``1d``."""
    t = str(text).strip()
    m = re.fullmatch(r"(\d+)([smhd])", t)
    if m:
        return int(m.group(1)) * {"s": 1, "m": 60, "h": 3600, "d": 86400}[m.group(2)]
    days, dash, rest = t.partition("-")
    if not dash:
        days, rest = "0", t
    parts = rest.split(":")
    if days.isdigit() and 1 <= len(parts) <= 3 and all(p.isdigit() for p in parts):
        nums = [int(p) for p in parts]
        if dash:  # D-HH[:MM[:SS]]
            secs = sum(n * f for n, f in zip(nums, (3600, 60, 1))) + int(days) * 86400
        else:  # MM, MM:SS, HH:MM:SS
            secs = sum(n * f for n, f in zip(nums, {1: (60,), 2: (60, 1), 3: (3600, 60, 1)}[len(nums)]))
        if secs > 0:
            return secs
    raise OptionError(f"--time takes MM, HH:MM:SS, D-HH:MM:SS or e.g. 90m, 2h (above zero), not {text!r}")


def _quantity(value: Any, flag: str) -> str:
    text = str(value).strip()
    if not _QUANTITY.match(text):
        raise OptionError(f"{flag} takes a Kubernetes quantity (e.g. 8, 500m, 64Gi), not {value!r}")
    return text


def load_pod_template(path: str) -> dict[str, Any]:
    """The user's pod template (YAML or JSON): a Pod, a PodTemplate, or ``{metadata, spec}``."""
    try:
        text = Path(path).expanduser().read_text()
    except OSError as e:
        raise OptionError(f"cannot read --pod-template {path}: {e.strerror or e}") from None
    try:
        data = json.loads(text)
    except ValueError:
        import yaml

        try:
            data = yaml.safe_load(text)
        except yaml.YAMLError as e:
            raise OptionError(f"--pod-template {path} is not valid YAML: {str(e).splitlines()[0]}") from None
    if isinstance(data, dict) and data.get("kind") == "PodTemplate":
        data = data.get("template")
    if not isinstance(data, dict) or not isinstance(data.get("spec", {}), dict):
        raise OptionError(f"--pod-template {path} must hold a pod template: a mapping with metadata and spec")
    return {"metadata": dict(data.get("metadata") or {}), "spec": dict(data.get("spec") or {})}


def _merge(base: Any, ours: Any) -> Any:
    """``ours`` over the user's ``base``: mappings merge, lists of named items merge by name, other lists add up."""
    if isinstance(base, dict) and isinstance(ours, dict):
        out = dict(base)
        for key, value in ours.items():
            out[key] = _merge(base[key], value) if key in base else value
        return out
    if isinstance(base, list) and isinstance(ours, list):
        if all(isinstance(x, dict) and "name" in x for x in base + ours):
            names = {x["name"]: i for i, x in enumerate(base)}
            merged = list(base)
            for item in ours:
                if item["name"] in names:
                    merged[names[item["name"]]] = _merge(base[names[item["name"]]], item)
                else:
                    merged.append(item)
            return merged
        return base + [x for x in ours if x not in base]
    return ours


def build(
    rid: str,
    hosts: int,
    opts: dict[str, Any],
    agent: AgentCommand,
) -> dict[str, Any]:
    """The reservation's manifests (Secret data is a placeholder) and the facts ``reserve`` needs; every pod
    runs the bootstrap that receives our bundle from the client, then ``agent`` (its port fixed: the
    Service and the client find the agents there)."""
    if not opts.get("image"):
        raise OptionError("the kubernetes scheduler needs --image IMAGE (an image with python3 and torch)")
    namespace = opts.get("namespace") or "default"
    if not _DNS_LABEL.match(namespace):
        raise OptionError(f"--namespace {namespace!r} is not a valid namespace name")
    port = agent.port or DEFAULT_AGENT_PORT
    user_labels = parse_pairs(opts.get("label") or [], "--label", label_values=True)
    annotations = parse_pairs(opts.get("annotation") or [], "--annotation", label_values=False)
    labels = {**user_labels, **MANAGED_BY, RESERVATION_LABEL: rid}
    job_labels = dict(labels)
    if opts.get("queue"):
        job_labels[QUEUE_LABEL] = parse_pairs([f"q={opts['queue']}"], "--queue", label_values=True)["q"]
    secret_name, service = f"{rid}-keys", rid
    meta = {"namespace": namespace, "labels": labels}

    resources: dict[str, str] = {}
    if opts.get("cpu") is not None:
        resources["cpu"] = _quantity(opts["cpu"], "--cpu")
    if opts.get("memory") is not None:
        resources["memory"] = _quantity(opts["memory"], "--memory")
    if opts.get("gpus_per_node"):
        if int(opts["gpus_per_node"]) < 0:
            raise OptionError("--gpus-per-node must be at least 0")
        resources["nvidia.com/gpu"] = str(int(opts["gpus_per_node"]))
    container: dict[str, Any] = {
        "name": CONTAINER,
        "image": opts["image"],
        "command": bootstrap.command(agent.python, port, agent.argv()),
        "env": [
            {"name": EnvSettings.host.var, "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}},
            # also on the pod's localhost, where a port-forward (the out-of-cluster path) connects
            {"name": EnvSettings.listen_host.var, "value": "0.0.0.0"},
            {"name": KEY_FILE_ENV, "value": f"{KEYS_DIR}/{KEYS_FILE}"},
        ],
        "ports": [{"name": "agent", "containerPort": port, "protocol": "TCP"}],
        "volumeMounts": [
            {"name": "monarch-keys", "mountPath": KEYS_DIR, "readOnly": True},
            {"name": "dshm", "mountPath": "/dev/shm"},
            {"name": bootstrap.VOLUME, "mountPath": bootstrap.MOUNT},
        ],
    }
    if resources:
        container["resources"] = {"requests": dict(resources), "limits": dict(resources)}
    container["terminationMessagePolicy"] = "FallbackToLogsOnError"  # a failed start-up says why in the pod status
    pod_spec: dict[str, Any] = {
        "restartPolicy": "Never",
        "subdomain": service,
        "containers": [container],
        "volumes": [
            {"name": "monarch-keys", "secret": {"secretName": secret_name, "defaultMode": 0o400}},
            {"name": "dshm", "emptyDir": {"medium": "Memory"}},
            {"name": bootstrap.VOLUME, "emptyDir": {}},  # the shipped bundle, unzipped; gone with the pod
        ],
    }
    if opts.get("service_account"):
        pod_spec["serviceAccountName"] = opts["service_account"]
    template: dict[str, Any] = {"metadata": {"labels": dict(labels)}, "spec": pod_spec}
    if annotations:
        template["metadata"]["annotations"] = annotations
    if opts.get("pod_template"):
        user = load_pod_template(opts["pod_template"])
        template = _merge(user, template)
    job_spec: dict[str, Any] = {
        "completionMode": "Indexed",
        "completions": hosts,
        "parallelism": hosts,
        "backoffLimit": 0,
        "template": template,
    }
    if opts.get("time"):
        job_spec["activeDeadlineSeconds"] = parse_duration(opts["time"])
    if opts.get("queue"):
        job_spec["suspend"] = True  # Kueue admits it by unsuspending
    secret = {
        "apiVersion": "v1",
        "kind": "Secret",
        "metadata": {"name": secret_name, **copy.deepcopy(meta)},
        "type": "Opaque",
        "immutable": True,
        "data": {KEYS_FILE: REDACTED},
    }
    svc = {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": {"name": service, **copy.deepcopy(meta)},
        "spec": {
            "clusterIP": "None",
            "publishNotReadyAddresses": True,
            "selector": {RESERVATION_LABEL: rid},
            "ports": [{"name": "agent", "port": port, "targetPort": port, "protocol": "TCP"}],
        },
    }
    job = {
        "apiVersion": "batch/v1",
        "kind": "Job",
        "metadata": {"name": rid, "namespace": namespace, "labels": job_labels},
        "spec": job_spec,
    }
    return {
        "namespace": namespace,
        "job": rid,
        "secret": secret_name,
        "service": service,
        "agent_port": port,
        "manifests": [secret, svc, job],
    }


def with_keys(secret: dict[str, Any], encoded_keys: str) -> dict[str, Any]:
    """The plan's Secret with the real keys in (only ``reserve`` calls this; never printed)."""
    filled = copy.deepcopy(secret)
    filled["data"] = {KEYS_FILE: base64.b64encode(encoded_keys.encode() + b"\n").decode()}
    return filled


def to_yaml(value: Any) -> str:
    """One object as YAML (PyYAML's safe dumper)."""
    return yaml_text.dump(value)


def render(manifests: list[dict[str, Any]]) -> str:
    """The manifests as one multi-document YAML stream, as ``kubectl apply -f`` takes it."""
    return yaml_text.dump_all(manifests)


__all__ = [
    "build",
    "render",
    "to_yaml",
    "with_keys",
    "parse_pairs",
    "parse_duration",
    "RESERVATION_LABEL",
    "INDEX_LABEL",
    "REDACTED",
    "DEFAULT_AGENT_PORT",
]
