"""The skypilot backend's SSH path: the agents reached over the cluster's SSH access when their port is closed.

SkyPilot gives every cluster SSH access (the head's address and port, a user, a private key).
When the agents' fixed port is not open to the client (a cloud firewall, nodes without public
addresses), the client keeps one paramiko connection to the head and forwards one loopback
port per node over it (:mod:`..ssh.forward`, as the ssh backend's ``--tunnel``) to the node's
internal address, where its agent listens; each agent answers on the connection made to it.
The head's host key is recorded when the reservation is made and required afterwards.
"""

from __future__ import annotations

import base64
import dataclasses
import threading
from typing import Any

from ...errors import SchedulerError


@dataclasses.dataclass
class SshAccess:
    """How SkyPilot says to reach the cluster's head by SSH (``host_key``: pinned once seen)."""

    host: str
    port: int
    user: str
    key_file: str
    host_key: str = ""  # "ssh-ed25519 AAAA..."

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> SshAccess:
        return cls(**{f.name: data[f.name] for f in dataclasses.fields(cls) if f.name in data})


def connect(access: SshAccess, timeout: float = 10.0) -> Any:
    """A paramiko client to the head; records its host key in ``access`` on first use, requires it after."""
    import paramiko

    client = paramiko.SSHClient()
    name = access.host if access.port == 22 else f"[{access.host}]:{access.port}"
    if access.host_key:
        kind, _, data = access.host_key.partition(" ")
        client.get_host_keys().add(name, kind, paramiko.PKey.from_type_string(kind, base64.b64decode(data)))
        client.set_missing_host_key_policy(paramiko.RejectPolicy())
    else:  # a node SkyPilot just made: nobody can have recorded its key (SkyPilot does not check it either)
        client.set_missing_host_key_policy(paramiko.AutoAddPolicy())
    where = f"the cluster's head {access.user}@{access.host}:{access.port}"
    try:
        client.connect(
            access.host,
            port=access.port,
            username=access.user,
            key_filename=access.key_file or None,
            allow_agent=False,
            look_for_keys=False,
            timeout=timeout,
            banner_timeout=timeout,
            auth_timeout=timeout,
        )
    except paramiko.BadHostKeyException:
        raise SchedulerError(f"{where}: its host key has CHANGED since the reservation was made; refusing") from None
    except paramiko.SSHException as e:
        if "not found in known_hosts" in str(e):
            raise SchedulerError(
                f"{where}: its host key has CHANGED since the reservation was made; refusing"
            ) from None
        raise SchedulerError(f"{where}: {e or type(e).__name__}") from None
    except (OSError, EOFError) as e:
        raise SchedulerError(f"{where} is unreachable: {e or type(e).__name__}") from None
    if not access.host_key:
        transport = client.get_transport()
        assert transport is not None, "connect() returned, so its transport is up"
        key = transport.get_remote_server_key()
        access.host_key = f"{key.get_name()} {key.get_base64()}"
    return client


def listening(client: Any, names: list[str], ips: list[str], port: int) -> dict[str, str]:
    """The agents whose port accepts a connection from the head (a ``direct-tcpip`` channel opens)."""
    found = {}
    for name, ip in zip(names, ips):
        try:
            client.get_transport().open_channel("direct-tcpip", (ip, port), ("127.0.0.1", 0), timeout=2.0).close()
        except Exception:  # noqa: BLE001 - ChannelException (refused), SSHException (connection gone)
            continue
        found[name] = f"tcp://{ip}:{port}"
    return found


_CLIENTS: dict[str, Any] = {}
_LOCK = threading.Lock()


def shared_client(key: str, access: SshAccess) -> Any:
    """One connection to the head per reservation and process, made again when it dropped."""
    with _LOCK:
        client = _CLIENTS.get(key)
        transport = client.get_transport() if client is not None else None
        if transport is None or not transport.is_active():
            client = _CLIENTS[key] = connect(access)
        return client


def forwards(key: str, access: SshAccess, targets: list[tuple[str, int]]) -> list[str]:
    """A loopback address per target, forwarded over the head's connection."""
    from ..ssh.forward import forward

    return [forward((key, f"{ip}:{port}"), lambda: shared_client(key, access), (ip, port)) for ip, port in targets]


__all__ = ["SshAccess", "connect", "listening", "shared_client", "forwards"]
