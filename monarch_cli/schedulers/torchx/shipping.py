"""Replicas that do not see the client's filesystem: how the keys reach them, and our code.

Code: each replica runs the stdlib-only bootstrap (:mod:`..bootstrap`) under a stock
interpreter on its agent port; the client, once torchx's describe places the replica, connects,
ships the bundle signed with a key derived from the reservation's keys, and the bootstrap execs
the agent from it on the same port (as the kubernetes backend's pods do).

Keys: never in the AppDef's env or args, the dry run, or a world-readable file. What carries
them depends on the torchx scheduler (:data:`KEY_CHANNELS`): a 0600 file on a filesystem the
replicas share (``local_cwd``, ``slurm``), a Kubernetes Secret the Volcano job's pods mount
(``kubernetes``: the dry-run request is edited before ``schedule``, as torchx allows), or a
read-only bind mount of the 0600 file (``local_docker``: the daemon runs on this machine).
Another scheduler has no channel we trust: reserving there is refused in one line.
"""

from __future__ import annotations

import base64
import errno
import socket
import threading
from typing import Any

from ...errors import SchedulerError
from .. import bootstrap
from ..base import Progress

#: Where the keys are inside a container (the Secret's or the bind mount's target).
KEYS_DIR = "/etc/monarch/keys"
KEY_FILE_IN_CONTAINER = f"{KEYS_DIR}/keys"
#: Where local_docker's replicas unzip the bundle: the container's own layer, gone with it.
DOCKER_BUNDLES_DIR = "/tmp/monarch-cli/bundles"
#: torchx's kubernetes scheduler turns an env value with this prefix into a ``fieldRef`` (its
#: ``PLACEHOLDER_FIELD_PATH``): each agent learns its own pod IP, as the native backend's pods do.
POD_IP = "[FIELD_PATH]status.podIP"
#: torchx scheduler -> how the keys reach its replicas when they do not share our filesystem.
KEY_CHANNELS = {"kubernetes": "secret", "local_docker": "bind mount"}
_SECRET_VOLUME = "monarch-keys"
_UNREACHABLE = (errno.EHOSTUNREACH, errno.ENETUNREACH)
_NO_CHANNEL = (
    "torchx {sched}: its replicas do not share this machine's filesystem and monarch has no secure way to hand "
    "them the reservation keys there (a Kubernetes Secret on torchx:kubernetes, a bind-mounted 0600 file on "
    "torchx:local_docker); use a native backend (ssh, slurm, kubernetes, skypilot), or -o agent_shared_fs=true "
    "if they do share it"
)


def no_channel(sched: str) -> str:
    return _NO_CHANNEL.format(sched=sched)


def secret_name(app_name: str) -> str:
    return f"{app_name}-keys"


def mount_secret(request: Any, name: str) -> None:
    """Edit torchx's Volcano dry-run request in place: every task's pod mounts the Secret read-only at
    :data:`KEYS_DIR`, and an emptyDir at the bootstrap's bundle directory (plain dicts: the kubernetes
    client serialises them as they are)."""
    resource = getattr(request, "resource", None)
    tasks = (resource or {}).get("spec", {}).get("tasks") if isinstance(resource, dict) else None
    if not tasks:
        raise SchedulerError("torchx kubernetes: its request is not the Volcano job monarch knows how to edit")
    for task in tasks:
        pod = task["template"]
        pod.spec.volumes = [
            *(pod.spec.volumes or []),
            {"name": _SECRET_VOLUME, "secret": {"secretName": name, "defaultMode": 0o400}},
            {"name": bootstrap.VOLUME, "emptyDir": {}},
        ]
        for container in pod.spec.containers:
            container.volume_mounts = [
                *(container.volume_mounts or []),
                {"name": _SECRET_VOLUME, "mountPath": KEYS_DIR, "readOnly": True},
                {"name": bootstrap.VOLUME, "mountPath": bootstrap.MOUNT},
            ]


def create_secret(namespace: str, name: str, app_name: str, encoded_keys: str) -> None:
    from ..kubernetes.api import api_error, apis

    core, _ = apis({})  # the kubeconfig and context torchx's kubernetes scheduler uses too
    body = {
        "apiVersion": "v1",
        "kind": "Secret",
        "metadata": {"name": name, "namespace": namespace, "labels": {"monarch-cli/reservation": app_name}},
        "type": "Opaque",
        "immutable": True,
        "data": {"keys": base64.b64encode(encoded_keys.encode() + b"\n").decode()},
    }
    try:
        core.create_namespaced_secret(namespace, body)
    except Exception as e:  # noqa: BLE001 - ApiException or a connection error: one line
        raise api_error(e, f"cannot create Secret {namespace}/{name}") from None


def delete_secret(namespace: str, name: str) -> None:
    from ..kubernetes.api import api_error, apis

    try:
        core, _ = apis({})
        core.delete_namespaced_secret(name, namespace)
    except SchedulerError:
        raise
    except Exception as e:  # noqa: BLE001
        if getattr(e, "status", None) != 404:
            raise api_error(e, f"cannot delete Secret {namespace}/{name}") from None


class BundleShipper:
    """While serve waits: which replicas' agents answer, shipping the bundle to each bootstrap on the way
    (one thread per replica; a broken connection is tried again, anything else ends serve)."""

    def __init__(self, key: bytes, wheelhouse: str | None, where: str, progress: Progress) -> None:
        self.key, self.wheelhouse, self.where, self.progress = key, wheelhouse, where, progress
        self.threads: dict[int, threading.Thread] = {}
        #: replica id -> {"code", "deps", "shipped"}: the parts it runs and the bytes sent to it.
        self.shipped: dict[int, dict[str, Any]] = {}
        self.errors: list[str] = []
        self.unreachable: set[int] = set()

    def answers(self, index: int, host: str, port: int) -> bool:
        """Whether replica ``index``'s agent answers at ``host:port`` (ZeroMQ's greeting)."""
        thread = self.threads.get(index)
        if thread is not None and thread.is_alive():
            return False
        try:
            sock = socket.create_connection((host, port), timeout=1.0)
        except OSError as e:
            if index not in self.unreachable and (isinstance(e, TimeoutError) or e.errno in _UNREACHABLE):
                self.unreachable.add(index)  # said once: a pod IP this client has no route to
                self.progress(
                    f"replica {index}: {host}:{port} does not answer from here ({e.strerror or 'timed out'}); "
                    "its address must be routable from this client (torchx:kubernetes: run serve in the cluster)"
                )
            return False
        kind, hello = bootstrap.greeting(sock)
        if kind != "bootstrap" or hello is None:
            sock.close()
            return kind == "agent"
        thread = threading.Thread(target=self._ship, args=(sock, index, host, hello), daemon=True)
        thread.name = f"monarch-torchx-ship-{index}"
        self.threads[index] = thread
        thread.start()
        return False

    def _ship(self, sock: socket.socket, index: int, host: str, hello: dict[str, Any]) -> None:
        who = f"replica {index} ({host})"
        try:
            self.shipped[index] = bootstrap.ship(
                sock,
                hello,
                self.key,
                self.wheelhouse,
                lambda m: self.progress(f"{who}: {m}"),
                where=self.where.replace("${replica_id}", str(index)),
                who=who,
            )
        except ConnectionError as e:
            self.progress(f"{who}: {e}; trying again")
        except SchedulerError as e:
            self.errors.append(str(e) if str(e).startswith(who) else f"{who}: {e}")
        except Exception as e:  # noqa: BLE001 - a bug or a bad greeting: one line, not a dead thread
            self.errors.append(f"{who}: cannot ship the bundle: {type(e).__name__}: {e}")
        finally:
            sock.close()

    def check(self) -> None:
        if self.errors:
            raise SchedulerError(self.errors[0])


__all__ = [
    "BundleShipper",
    "DOCKER_BUNDLES_DIR",
    "KEY_CHANNELS",
    "KEY_FILE_IN_CONTAINER",
    "KEYS_DIR",
    "POD_IP",
    "create_secret",
    "delete_secret",
    "mount_secret",
    "no_channel",
    "secret_name",
]
