"""A test-side Job controller and kubelet over :mod:`.apiserver`: Indexed Jobs become pods, pods become processes.

For each unsuspended Job it creates one pod per completion index (labels and annotations
of the template plus ``batch.kubernetes.io/job-completion-index``, ``JOB_COMPLETION_INDEX``
in the container env, hostname ``<job>-<index>``, the template's subdomain), as the Job
controller does. Each pod is then "scheduled" (a pod asking for more ``nvidia.com/gpu``
than the node has stays Pending, Unschedulable) and "pulled" (an image not in
:attr:`Kubelet.images` waits in ErrImagePull), then its init containers run to completion
(one that fails fails the pod, its output in the termination message) and its container command runs as a real
local process: ``$(VAR)`` references expanded, the env of the pod spec (``status.podIP``
and other field refs resolved), its Secret volumes written as files (the volume's
``defaultMode``) in a private 0700 directory that stands for the mount path. Each pod gets
its own loopback IP (in a random 127.x.y.0/24) as its pod IP. Exits become pod phases and container
statuses; a failed pod fails the Job (backoffLimit 0) and ends the others; a Job past
``activeDeadlineSeconds`` fails with DeadlineExceeded; a deleted Job's processes are killed
and its pods removed before the Job itself (foreground deletion).

With ``hide``, each pod's agent runs in a mount namespace of its own where those directories
(the client's workspace) are empty, and every pod has its own ``$HOME``. With ``nodes``
(network namespaces with an address each, tests/netns.py), each pod runs in a namespace of its
own with that address as pod IP, as behind a CNI, and its own hostname, ``/etc/hosts`` (the
hostname is the pod IP) and ``/etc/resolv.conf`` (no cluster DNS). Without, pods share this machine's network namespace
and differ by loopback IP only (so ``MONARCH_LISTEN_HOST``, a wildcard, is dropped: one pod's
0.0.0.0 would be every pod's). :meth:`dial` connects a port-forward to a pod's port as the
kubelet does: to localhost inside the pod's network namespace (else to its loopback IP).
Not real: the Secret is not mounted at its mount
path (that path is rewritten in env values), no images (an "image" is this machine's Python,
optionally with a directory first on ``PYTHONPATH``; with ``python``, an interpreter that has
torch but nothing of ours, as a stock image's: :func:`stock_python`), no resource limits.
emptyDir volumes (but ``/dev/shm``) are private directories, their mount paths rewritten in env
values and command words.
"""

from __future__ import annotations

import base64
import copy
import ctypes
import os
import random
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from .apiserver import ControlLoop, Store, now

INDEX = "batch.kubernetes.io/job-completion-index"
_PASS_ENV = ("PYTHONPATH", "HOME", "LANG", "MONARCH_CACHE_DIR", "TMPDIR")


class _Container:
    def __init__(self, proc: subprocess.Popen, root: Path) -> None:
        self.proc, self.root = proc, root


class Kubelet(ControlLoop):
    """Runs in a thread beside the emulator; :meth:`close` kills every process it started."""

    def __init__(
        self,
        store: Store,
        images: dict[str, str],
        gpus: int = 0,
        root: Path | None = None,
        hide: Sequence[Path] = (),
        nodes: Sequence[tuple[str, str]] = (),
        python: str | None = None,
    ) -> None:
        """``images``: image name -> a directory put first on PYTHONPATH ("" for none): what the image holds.
        ``hide``: directories the pods must not see (an empty tmpfs over each, in a mount namespace of the
        pod's own: needs root), as the client's files are not in a real pod's filesystem.
        ``nodes``: (network namespace, address) pairs, one pod each (needs root).
        ``python``: the images' ``python3``/``python`` (e.g. :func:`stock_python`), first on the pods'
        ``PATH``; this process's ``PYTHONPATH`` is then not passed on. Default: this interpreter."""
        self.store, self.images, self.gpus, self.hide = store, dict(images), gpus, [str(h) for h in hide]
        self.python = python
        self.root = Path(root or tempfile.mkdtemp(prefix="kubelet-"))
        self.root.mkdir(parents=True, exist_ok=True)
        self.running: dict[str, _Container] = {}  # pod key "ns/name" -> process
        self.ips: dict[str, str] = {}
        self.nodes = list(nodes)
        #: A ResourceQuota on the number of pods: the Job controller's creations past it fail (an Event).
        self.pod_quota: int | None = None
        self.node_of: dict[str, tuple[str, str]] = {}  # pod key -> its network namespace and address
        self.job_started: dict[str, float] = {}
        self._next_ip = 1
        #: A loopback /24 of its own, so kubelets of concurrent test runs never share a pod IP.
        self._ip_prefix = f"127.{random.randrange(10, 250)}.{random.randrange(1, 250)}"
        self.start_loop("kubelet")

    # ------------------------------------------------------------------ loop
    def _sync(self) -> None:
        jobs, _ = self.store.list("jobs", None)
        pods, _ = self.store.list("pods", None)
        by_job: dict[str, list[dict[str, Any]]] = {}
        for pod in pods:
            by_job.setdefault(f"{pod['metadata']['namespace']}/{pod['metadata']['labels'].get('job-name')}", []).append(
                pod
            )
        names = set()
        for job in jobs:
            key = f"{job['metadata']['namespace']}/{job['metadata']['name']}"
            names.add(key)
            self._sync_job(job, by_job.get(key, []))
        for key, owned in by_job.items():  # garbage collection of pods whose owner, their Job, is gone
            if key not in names:
                for pod in owned:
                    if pod["metadata"].get("ownerReferences"):
                        self._delete_pod(pod)
        for pod in pods:
            if pod["metadata"].get("deletionTimestamp"):
                self._delete_pod(pod)
            else:
                self._sync_pod(pod)

    def _sync_job(self, job: dict[str, Any], pods: list[dict[str, Any]]) -> None:
        meta, spec, st = job["metadata"], job["spec"], job.get("status") or {}
        ns, name = meta["namespace"], meta["name"]
        if meta.get("deletionTimestamp"):
            for pod in pods:
                self._delete_pod(pod)
            if not self.store.list("pods", ns, f"job-name={name}")[0]:
                self.store.remove("jobs", ns, name)
            return
        if spec.get("suspend") or _finished(st):
            return
        if not st.get("startTime"):
            for index in range(int(spec.get("completions") or 1)):
                if self.pod_quota is not None and len(self.store.list("pods", ns)[0]) >= self.pod_quota:
                    self._failed_create(job, index)
                    continue
                self._create_pod(job, index)
            self.job_started[f"{ns}/{name}"] = time.monotonic()
            self.store.update(
                "jobs",
                ns,
                name,
                lambda o: o["status"].update(startTime=now(), active=int(spec.get("completions") or 1)),
            )
            return
        phases = [p["status"].get("phase") for p in pods]
        deadline = spec.get("activeDeadlineSeconds")
        if deadline and time.monotonic() - self.job_started.get(f"{ns}/{name}", time.monotonic()) > int(deadline):
            self._fail(job, pods, "DeadlineExceeded", "Job was active longer than specified deadline")
        elif "Failed" in phases:
            self._fail(job, pods, "BackoffLimitExceeded", "Job has reached the specified backoff limit")
        elif phases and all(p == "Succeeded" for p in phases):
            self.store.update(
                "jobs",
                ns,
                name,
                lambda o: o["status"].update(
                    active=0, succeeded=len(phases), conditions=[_condition("Complete", "", "")]
                ),
            )

    def _fail(self, job: dict[str, Any], pods: list[dict[str, Any]], reason: str, message: str) -> None:
        for pod in pods:
            if pod["status"].get("phase") not in ("Failed", "Succeeded"):
                self._delete_pod(pod)
        failed = sum(p["status"].get("phase") == "Failed" for p in pods)
        self.store.update(
            "jobs",
            job["metadata"]["namespace"],
            job["metadata"]["name"],
            lambda o: o["status"].update(
                active=0, failed=max(failed, 1), conditions=[_condition("Failed", reason, message)]
            ),
        )

    def _create_pod(self, job: dict[str, Any], index: int) -> None:
        template = copy.deepcopy(job["spec"]["template"])
        meta = template.get("metadata") or {}
        job_name = job["metadata"]["name"]
        labels = {
            **(meta.get("labels") or {}),
            "job-name": job_name,
            INDEX: str(index),
            "controller-uid": job["metadata"]["uid"],
        }
        annotations = {**(meta.get("annotations") or {}), INDEX: str(index)}
        spec = template["spec"]
        spec["hostname"] = f"{job_name}-{index}"
        for c in spec["containers"]:
            c.setdefault("env", []).append(
                {
                    "name": "JOB_COMPLETION_INDEX",
                    "valueFrom": {"fieldRef": {"fieldPath": f"metadata.annotations['{INDEX}']"}},
                }
            )
        pod = {
            "apiVersion": "v1",
            "kind": "Pod",
            "spec": spec,
            "metadata": {
                "name": f"{job_name}-{index}-{uuid.uuid4().hex[:5]}",
                "labels": labels,
                "annotations": annotations,
                "ownerReferences": [
                    {
                        "apiVersion": "batch/v1",
                        "kind": "Job",
                        "name": job_name,
                        "uid": job["metadata"]["uid"],
                        "controller": True,
                    }
                ],
            },
            "status": {"phase": "Pending"},
        }
        self.store.create("pods", job["metadata"]["namespace"], pod)

    def _failed_create(self, job: dict[str, Any], index: int) -> None:
        """The Job controller's Warning event for a pod the quota refused."""
        meta = job["metadata"]
        used = len(self.store.list("pods", meta["namespace"])[0])
        self.store.create(
            "events",
            meta["namespace"],
            {
                "apiVersion": "v1",
                "kind": "Event",
                "metadata": {"name": f"{meta['name']}.{uuid.uuid4().hex[:12]}"},
                "involvedObject": {
                    "apiVersion": "batch/v1",
                    "kind": "Job",
                    "namespace": meta["namespace"],
                    "name": meta["name"],
                    "uid": meta["uid"],
                },
                "reason": "FailedCreate",
                "type": "Warning",
                "count": 1,
                "source": {"component": "job-controller"},
                "firstTimestamp": now(),
                "lastTimestamp": now(),
                "message": f'Error creating: pods "{meta["name"]}-{index}-x" is forbidden: exceeded quota: pods, '
                f"requested: pods=1, used: pods={used}, limited: pods={self.pod_quota}",
            },
        )

    # ------------------------------------------------------------------ pods
    def _sync_pod(self, pod: dict[str, Any]) -> None:
        meta, st = pod["metadata"], pod["status"]
        key = f"{meta['namespace']}/{meta['name']}"
        if st.get("phase") == "Pending" and key not in self.running:
            self._start(pod)
        elif st.get("phase") == "Running" and key in self.running:
            code = self.running[key].proc.poll()
            if code is not None:
                log = (self.running[key].root / "log").read_text(errors="replace")[-300:]
                self.store.update(
                    "pods",
                    meta["namespace"],
                    meta["name"],
                    lambda o: o["status"].update(
                        phase="Succeeded" if code == 0 else "Failed",
                        containerStatuses=[
                            _container_status(
                                o,
                                {
                                    "terminated": {
                                        "exitCode": code if code >= 0 else 128 - code,
                                        "reason": "Completed" if code == 0 else "Error",
                                        "message": log,
                                    }
                                },
                            )
                        ],
                    ),
                )

    def _start(self, pod: dict[str, Any]) -> None:
        meta, spec = pod["metadata"], pod["spec"]
        ns, name = meta["namespace"], meta["name"]
        (container,) = spec["containers"]
        gpus = int(((container.get("resources") or {}).get("requests") or {}).get("nvidia.com/gpu", 0))
        if gpus > self.gpus:
            cond = _condition(
                "PodScheduled",
                "Unschedulable",
                "0/1 nodes are available: 1 Insufficient nvidia.com/gpu.",
                status="False",
            )
            if not any(c.get("reason") == "Unschedulable" for c in pod["status"].get("conditions") or []):
                self.store.update("pods", ns, name, lambda o: o["status"].update(conditions=[cond]))
            return
        if any(c["image"] not in self.images for c in [container, *(spec.get("initContainers") or [])]):
            if not pod["status"].get("containerStatuses"):
                self.store.update(
                    "pods",
                    ns,
                    name,
                    lambda o: o["status"].update(
                        conditions=[_condition("PodScheduled", "", "")],
                        containerStatuses=[
                            _container_status(
                                o,
                                {
                                    "waiting": {
                                        "reason": "ErrImagePull",
                                        "message": f'failed to pull image "{container["image"]}": not found',
                                    }
                                },
                            )
                        ],
                    ),
                )
            return
        key = f"{ns}/{name}"
        if self.nodes:
            free = [n for n in self.nodes if n not in self.node_of.values()]
            if not free:
                return  # stays Pending until a pod ends
            self.node_of[key] = free[0]
            ip = self.ips[key] = free[0][1]
        else:
            ip = self.ips.setdefault(key, f"{self._ip_prefix}.{self._next_ip}")
            self._next_ip += 1
        enter = ["nsenter", f"--net=/run/netns/{self.node_of[key][0]}"] if key in self.node_of else []
        root = self.root / name
        root.mkdir(mode=0o700)
        mounts = self._materialise_volumes(pod, container, root)
        fields = {"status.podIP": ip, "metadata.name": name, "metadata.namespace": ns, "spec.nodeName": "node-0"}
        fields.update({f"metadata.annotations['{k}']": v for k, v in (meta.get("annotations") or {}).items()})
        fields.update({f"metadata.labels['{k}']": v for k, v in (meta.get("labels") or {}).items()})
        env = {k: os.environ[k] for k in _PASS_ENV if k in os.environ and not (self.python and k == "PYTHONPATH")}
        env["PATH"] = (
            os.path.dirname(self.python or sys.executable) + os.pathsep + os.environ.get("PATH", "/usr/bin:/bin")
        )
        env["HOSTNAME"] = spec.get("hostname") or name
        env["HOME"] = str(root / "home")  # the container's own home (where the workspace mirror goes)
        os.mkdir(env["HOME"], 0o700)
        for item in container.get("env") or []:
            ref = (item.get("valueFrom") or {}).get("fieldRef")
            value = fields[ref["fieldPath"]] if ref else _expand(item.get("value", ""), env)
            env[item["name"]] = _at_mounts(value, mounts)
        if key not in self.node_of:
            env.pop("MONARCH_LISTEN_HOST", None)
        if self.images[container["image"]]:
            env["PYTHONPATH"] = os.pathsep.join(filter(None, [self.images[container["image"]], env.get("PYTHONPATH")]))
        for init in spec.get("initContainers") or []:  # in order, each to completion, before the container
            argv = enter + [
                _at_mounts(_expand(a, env), mounts) for a in (init.get("command") or []) + (init.get("args") or [])
            ]
            done = subprocess.run(argv, env=env, cwd=root, capture_output=True, timeout=120)
            if done.returncode != 0:
                message = (done.stdout + done.stderr).decode(errors="replace")[-300:]
                self.store.update(
                    "pods",
                    ns,
                    name,
                    lambda o: o["status"].update(
                        phase="Failed",
                        podIP=ip,
                        initContainerStatuses=[
                            {
                                "name": init["name"],
                                "image": init["image"],
                                "imageID": "",
                                "ready": False,
                                "restartCount": 0,
                                "state": {
                                    "terminated": {"exitCode": done.returncode, "reason": "Error", "message": message}
                                },
                            }
                        ],
                    ),
                )
                shutil.rmtree(root, ignore_errors=True)
                self.node_of.pop(key, None)
                return
        argv = [
            _at_mounts(_expand(a, env), mounts)
            for a in (container.get("command") or []) + (container.get("args") or [])
        ]
        setup, words = [], []  # shell commands (run in the pod's own mount namespace) and their "$N" words
        if key in self.node_of:  # the pod's hostname, /etc/hosts and /etc/resolv.conf, as the kubelet writes them
            hostname = spec.get("hostname") or name
            (root / "hosts").write_text(
                f"127.0.0.1 localhost\n{ip} {hostname}.{spec.get('subdomain')}.{ns}.svc {hostname}\n"
            )
            (root / "resolv.conf").write_text("nameserver 127.0.0.1\n")  # no cluster DNS: a quick refusal
            setup += ['hostname "$1"', 'mount --bind "$2" /etc/hosts', 'mount --bind "$3" /etc/resolv.conf']
            words += [hostname, str(root / "hosts"), str(root / "resolv.conf")]
        for hidden in self.hide:  # the hidden directories covered by empty tmpfs
            setup.append(f'mount -t tmpfs pod-private "${len(words) + 1}"')
            words.append(hidden)
        if setup:
            argv = [
                "unshare",
                "--mount",
                "--propagation",
                "private",
                *(["--uts"] if key in self.node_of else []),
                "sh",
                "-c",
                f'{" && ".join(setup)} && shift {len(words)} && exec "$@"',
                "sh",
                *words,
                *argv,
            ]
        with open(root / "log", "wb") as log:
            proc = subprocess.Popen(
                enter + argv,
                env=env,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=log,
                cwd=root,
                start_new_session=True,
            )
        self.running[key] = _Container(proc, root)
        self.store.update(
            "pods",
            ns,
            name,
            lambda o: (
                o["spec"].update(nodeName="node-0"),
                o["status"].update(
                    phase="Running",
                    podIP=ip,
                    podIPs=[{"ip": ip}],
                    hostIP="127.0.0.1",
                    startTime=now(),
                    conditions=[_condition("PodScheduled", "", ""), _condition("Ready", "", "")],
                    containerStatuses=[_container_status(o, {"running": {"startedAt": now()}}, ready=True)],
                ),
            ),
        )

    def _materialise_volumes(self, pod: dict[str, Any], container: dict[str, Any], root: Path) -> dict[str, Path]:
        """Secret volumes as files with the volume's mode in a private directory, emptyDirs (but /dev/shm) as
        empty directories; {mount path: directory}."""
        volumes = {v["name"]: v for v in pod["spec"].get("volumes") or []}
        out = {}
        for mount in container.get("volumeMounts") or []:
            volume = volumes[mount["name"]]
            if "emptyDir" in volume and mount["mountPath"] != "/dev/shm":
                local = root / "volumes" / mount["name"]
                local.mkdir(parents=True)
                local.chmod(0o777)  # as a real emptyDir
                out[mount["mountPath"]] = local
            if "secret" not in volume:
                continue
            secret = self.store.get("secrets", pod["metadata"]["namespace"], volume["secret"]["secretName"])
            local = root / "volumes" / mount["name"]
            local.mkdir(parents=True, mode=0o700)
            for fname, data in (secret.get("data") or {}).items():
                path = local / fname
                fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, volume["secret"].get("defaultMode", 0o644))
                with os.fdopen(fd, "wb") as f:
                    f.write(base64.b64decode(data))
            out[mount["mountPath"]] = local
        return out

    def _delete_pod(self, pod: dict[str, Any]) -> None:
        meta = pod["metadata"]
        key = f"{meta['namespace']}/{meta['name']}"
        container = self.running.pop(key, None)
        if container is not None:
            _kill(container.proc)
            shutil.rmtree(container.root, ignore_errors=True)
        self.node_of.pop(key, None)
        self.store.remove("pods", meta["namespace"], meta["name"])

    def dial(self, namespace: str, pod: str, port: int) -> socket.socket:
        """A connection to ``port`` of the pod, made as a port-forward's: to localhost in the pod's network
        namespace (from a thread that enters it; the socket stays there), or to its loopback IP."""
        key = f"{namespace}/{pod}"
        if key not in self.node_of:
            if key not in self.ips:
                raise OSError(f"pod {key} has no IP")
            return socket.create_connection((self.ips[key], port), timeout=2)
        made: list[Any] = []

        def connect() -> None:
            try:
                with open(f"/run/netns/{self.node_of[key][0]}") as netns:
                    if _libc.setns(netns.fileno(), _CLONE_NEWNET) != 0:
                        raise OSError(ctypes.get_errno(), "setns")
                made.append(socket.create_connection(("127.0.0.1", port), timeout=2))
            except (OSError, KeyError) as e:
                made.append(e)

        thread = threading.Thread(target=connect, name=f"kubelet-dial-{pod}")  # only this thread changes namespace
        thread.start()
        thread.join()
        if isinstance(made[0], Exception):
            raise made[0] if isinstance(made[0], OSError) else OSError(f"pod {key} ended")
        made[0].settimeout(None)
        return made[0]

    def pids(self) -> list[int]:
        return [c.proc.pid for c in self.running.values()]

    def close(self) -> None:
        self.stop_loop()
        for container in self.running.values():
            _kill(container.proc)
        shutil.rmtree(self.root, ignore_errors=True)


_libc = ctypes.CDLL(None, use_errno=True)
_CLONE_NEWNET = 0x40000000


def _expand(text: str, env: dict[str, str]) -> str:
    """Kubernetes' ``$(VAR)`` expansion (``$$`` escapes; unknown references stay as they are)."""
    return re.sub(
        r"\$\$|\$\(([A-Za-z_][A-Za-z0-9_]*)\)",
        lambda m: "$" if m.group(0) == "$$" else env.get(m.group(1), m.group(0)),
        text,
    )


def _at_mounts(value: str, mounts: dict[str, Path]) -> str:
    """A path under a volume's mount path, at the private directory that stands for it here; inside a
    shell line too (a word that starts with it: torchx's ``sh -c`` roles name their paths that way)."""
    for mount_path, local in mounts.items():
        if value == mount_path or value.startswith(mount_path + "/"):
            return str(local) + value[len(mount_path) :]
        value = value.replace(f" {mount_path}/", f" {local}/")
    return value


def stock_python(directory: Path) -> str:
    """An interpreter like a stock PyTorch image's: a venv of this machine's Python (no pip) that sees
    torch and numpy and what they need, through a directory of links, and nothing of ours (no zmq,
    psutil, cloudpickle, monarch_cli). Returns its ``bin/python3``."""
    from importlib import metadata

    python = directory / "bin" / "python3"
    if python.exists():
        return str(python)
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(directory)], check=True)
    links = directory / "torch-only"
    links.mkdir()
    wanted, seen = ["torch", "numpy"], set()
    while wanted:
        name = re.split(r"[ ;<>=!~\[]", wanted.pop())[0].lower().replace("_", "-")
        if name in seen:
            continue
        seen.add(name)
        try:
            dist = metadata.distribution(name)
        except metadata.PackageNotFoundError:
            continue
        wanted += [r for r in dist.requires or [] if "extra ==" not in r]
        for file in dist.files or []:
            top = file.parts[0]
            source = Path(str(dist.locate_file(top)))
            if top not in ("..", "bin") and source.exists() and not (links / top).exists():
                (links / top).symlink_to(source)
    (site,) = (directory / "lib").glob("python3*/site-packages")
    (site / "torch-only.pth").write_text(f"{links}\n")
    return str(python)


def _kill(proc: subprocess.Popen, grace: float = 5.0) -> None:
    """SIGTERM the container's process group, SIGKILL after ``grace`` (terminationGracePeriodSeconds)."""
    for sig, wait in ((signal.SIGTERM, grace), (signal.SIGKILL, 5.0)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            pass
        try:
            proc.wait(timeout=wait)
            break
        except subprocess.TimeoutExpired:
            continue
    try:  # what the group left behind (a rank that ignored TERM)
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def _finished(st: dict[str, Any]) -> bool:
    return any(
        c.get("type") in ("Complete", "Failed") and c.get("status") == "True" for c in st.get("conditions") or []
    )


def _condition(kind: str, reason: str, message: str, status: str = "True") -> dict[str, Any]:
    cond = {"type": kind, "status": status, "lastTransitionTime": now()}
    if reason:
        cond.update(reason=reason, message=message)
    return cond


def _container_status(pod: dict[str, Any], state: dict[str, Any], ready: bool = False) -> dict[str, Any]:
    container = pod["spec"]["containers"][0]
    return {
        "name": container["name"],
        "image": container["image"],
        "imageID": "",
        "ready": ready,
        "restartCount": 0,
        "started": "running" in state,
        "state": state,
    }


__all__ = ["Kubelet", "stock_python"]
