"""SkyPilot's Python SDK as the skypilot backend's provisioner; the only place SkyPilot is imported.

SDK >= 0.10: calls return request ids, resolved with ``sky.get`` (or ``sky.stream_and_get``,
which also streams SkyPilot's log: into serve's progress here).
"""

from __future__ import annotations

import io
import os
import re
from pathlib import Path
from typing import Any

from ...errors import SchedulerError
from ..base import Progress
from .provisioner import INSTALL_HINT, Cluster, ClusterStatus
from .ssh_access import SshAccess


def _first_line(error: BaseException) -> str:
    text = str(error).strip()
    return text.splitlines()[0] if text else type(error).__name__


def _sky() -> Any:
    try:
        import sky
    except ImportError:
        raise SchedulerError(f"the skypilot scheduler needs SkyPilot, which is not installed: {INSTALL_HINT}") from None
    return sky


class SkyProvisioner:
    """SkyPilot's Python SDK (>= 0.10: calls return request ids, resolved with ``sky.get``)."""

    def launch(self, cluster: str, task: dict[str, Any], secrets: dict[str, str], progress: Progress) -> Cluster:
        sky = _sky()
        # The secret's value goes in here, in memory: a null value would mean a managed secret to SkyPilot.
        sky_task = sky.Task.from_yaml_config({**task, "secrets": dict(secrets)})
        progress(f"sky launch -c {cluster} ({task['num_nodes']} node(s))")
        try:
            # With _include_credentials (as `sky launch` asks), a new API server adds the SSH credentials.
            result = sky.stream_and_get(
                sky.launch(sky_task, cluster_name=cluster, _include_credentials=True),
                output_stream=_ProgressStream(progress),
            )
        except Exception as e:  # noqa: BLE001 - SkyPilot raises many kinds; the message is what users need
            raise SchedulerError(f"sky launch -c {cluster} failed: {_first_line(e)}") from None
        handle, credentials = result[1], (result[2] if len(result) > 2 else None)
        ips = (handle.cached_external_ips or handle.external_ips()) if handle is not None else None
        if not ips:
            raise SchedulerError(f"SkyPilot launched {cluster} but reports no node addresses")
        if credentials is None:
            credentials = self._credentials(cluster)
        internal = list(getattr(handle, "cached_internal_ips", None) or ips)
        return Cluster(list(ips), internal, _ssh_access(cluster, handle, credentials, progress))

    @staticmethod
    def _credentials(cluster: str) -> dict[str, Any] | None:
        sky = _sky()
        try:
            records = sky.get(sky.status([cluster], _include_credentials=True))
        except Exception:  # noqa: BLE001 - no SSH access then; the agents may still be reachable directly
            return None
        record = records[0] if records else None
        return _field(record, "credentials") if record is not None else None

    def _records(self, cluster: str) -> list[Any]:
        sky = _sky()
        return list(sky.get(sky.status([cluster], refresh=sky.StatusRefreshMode.AUTO)) or [])

    def existing(self, cluster: str) -> ClusterStatus | None:
        try:
            records = self._records(cluster)
        except SchedulerError:
            raise
        except Exception as e:  # noqa: BLE001
            raise SchedulerError(f"SkyPilot cannot tell whether cluster {cluster} exists: {_first_line(e)}") from None
        if not records:
            return None
        handle = _field(records[0], "handle")
        resources = getattr(handle, "launched_resources", None)
        accelerators = getattr(resources, "accelerators", None) or {}
        cloud = getattr(resources, "cloud", None)
        return ClusterStatus(
            _status_name(records[0]),
            int(getattr(handle, "launched_nodes", 0) or 0),
            ",".join(f"{k}:{v}" for k, v in accelerators.items()) or None,
            str(cloud).lower() if cloud is not None else None,
        )

    def state(self, cluster: str) -> tuple[str, str]:
        try:
            records = self._records(cluster)
        except SchedulerError:
            raise
        except Exception as e:  # noqa: BLE001 - the API server is down, credentials expired...
            return "UNKNOWN", f"SkyPilot cannot tell: {_first_line(e)}"
        if not records:
            return "GONE", f"SkyPilot has no cluster {cluster} (torn down, autodowned or preempted)"
        name = _status_name(records[0])
        return name, f"SkyPilot reports cluster {cluster} as {name}"

    def keep(self, cluster: str, idle_minutes: int, down: bool) -> None:
        sky = _sky()
        try:  # the agents are the cluster's job: cancelling it ends them, as `sky cancel` does
            sky.get(sky.cancel(cluster, all=True))
            sky.get(sky.autostop(cluster, idle_minutes, down=down))
        except Exception as e:  # noqa: BLE001
            raise SchedulerError(f"cannot leave cluster {cluster} up with autostop: {_first_line(e)}") from None

    def down(self, cluster: str) -> None:
        sky = _sky()
        try:
            sky.get(sky.down(cluster))
        except Exception as e:  # noqa: BLE001
            if "does not exist" not in str(e):
                raise SchedulerError(f"sky down {cluster} failed: {_first_line(e)}") from None
        _key_file(cluster).unlink(missing_ok=True)  # the SSH key a remote API server sent for it


def _field(record: Any, name: str) -> Any:
    return record.get(name) if isinstance(record, dict) else getattr(record, name, None)


def _status_name(record: Any) -> str:
    status = _field(record, "status")
    return str(getattr(status, "value", status) or "UNKNOWN")


def _key_file(cluster: str) -> Path:
    return Path.home() / ".monarch-cli" / "skypilot" / f"{cluster}.key"


def _ssh_access(cluster: str, handle: Any, credentials: dict[str, Any] | None, progress: Progress) -> SshAccess | None:
    """The head's SSH access from the handle and SkyPilot's credentials; None where we cannot use it."""
    if not credentials or not credentials.get("ssh_user"):
        return None
    if credentials.get("ssh_proxy_command"):  # Kubernetes pods, jump hosts: SkyPilot's own proxy, not ours
        progress(f"cluster {cluster} is reached by SSH through a proxy command; only direct connections are used")
        return None
    key_file = credentials.get("ssh_private_key") or ""
    if credentials.get("ssh_private_key_content"):  # a remote API server sends the key: keep it as SkyPilot does
        path = _key_file(cluster)
        path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(credentials["ssh_private_key_content"])
        key_file = str(path)
    ports = getattr(handle, "cached_external_ssh_ports", None) or [22]
    return SshAccess(
        handle.cached_external_ips[0], int(ports[0]), str(credentials["ssh_user"]), os.path.expanduser(key_file)
    )


class _ProgressStream(io.TextIOBase):
    """SkyPilot's launch log, line by line, into serve's progress display."""

    def __init__(self, progress: Progress) -> None:
        self.progress, self.pending = progress, ""

    def writable(self) -> bool:
        return True

    def write(self, text: str) -> int:
        self.pending += text
        *lines, self.pending = re.split(r"[\r\n]", self.pending)
        for line in lines:
            line = re.sub(r"\x1b\[[0-9;]*[A-Za-z]", "", line).strip()
            if line:
                self.progress(f"sky: {line}")
        return len(text)


__all__ = ["SkyProvisioner"]
