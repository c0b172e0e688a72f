"""Runtime settings, set once per process with :func:`configure`.

Settings travel to every proc a process spawns (inside the bootstrap message), so a
controller's choice of timeouts holds across the whole mesh.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any


@dataclasses.dataclass
class Settings:
    #: Default timeout (seconds) for ``Future.get()`` when none is given; ``None`` waits forever.
    call_timeout: float | None = None
    #: How long ``spawn_procs``/``spawn`` may take before they fail.
    spawn_timeout: float = 60.0
    #: Interval of the liveness heartbeat between a process and the agents it uses.
    heartbeat_interval: float = 0.5
    #: Silence after which an agent (or a client, seen from the agent) counts as gone. 4 s, so a
    #: lost host is named within 5 s of going quiet (its last answer comes up to an interval
    #: before that; thousands of hosts add reading latency). 5 s had named it at 5.0-5.9 s. The
    #: judgement guards against blaming hosts for the client's own slowness (heartbeats.py).
    heartbeat_timeout: float = 4.0
    #: ``"tcp"`` (CURVE-encrypted, works across hosts) or ``"ipc"`` (unix sockets, one host).
    transport: str = "tcp"
    #: Address other hosts use to reach this process; default: ``$MONARCH_HOST`` or this host's IP.
    host: str | None = None
    #: Grace period between SIGTERM and SIGKILL when a proc mesh stops.
    stop_grace: float = 5.0
    #: Keep every TCP port this process (and the procs it spawns) listens on within [lo, hi].
    port_range: tuple[int, int] | None = None
    #: From this many hosts, a run and a question to every host (``status``, ``stack``) go through
    #: ~√N of them (relays) instead of a connection per host (:mod:`monarch_cli.jobs.fanout`). 64:
    #: a fresh CLI's CURVE handshakes are most of its per-host CPU, and from 64 hosts the relays
    #: cost no wall time even with every agent on the client's two cores (docs/decisions/0005).
    relay_from_hosts: int = 64


_settings = Settings()
_FIELDS = {f.name for f in dataclasses.fields(Settings)}


def configure(**kwargs: Any) -> Settings:
    """Change runtime settings for this process (and the procs it spawns from now on)."""
    unknown = set(kwargs) - _FIELDS
    if unknown:
        raise TypeError(f"unknown setting(s): {', '.join(sorted(unknown))}; known: {', '.join(sorted(_FIELDS))}")
    if "transport" in kwargs and kwargs["transport"] not in ("tcp", "ipc"):
        raise ValueError(f"transport must be 'tcp' or 'ipc', not {kwargs['transport']!r}")
    if kwargs.get("port_range") is not None:
        lo, hi = kwargs["port_range"]
        if not 0 < int(lo) <= int(hi) < 65536:
            raise ValueError(f"port_range must be (lo, hi) with 0 < lo <= hi < 65536, not {kwargs['port_range']!r}")
        kwargs["port_range"] = (int(lo), int(hi))
    for name, value in kwargs.items():
        setattr(_settings, name, value)
    return _settings


def settings() -> Settings:
    return _settings


def advertised_host() -> str:
    """The address peers should use to reach sockets bound by this process."""
    if _settings.host:
        return _settings.host
    env = os.environ.get("MONARCH_HOST")
    if env:
        return env
    # _socket, not socket: the wrapper module (~2 ms to import) is not needed for these two calls,
    # which run on every `monarch run-spmd`.
    import _socket

    name = _socket.gethostname()
    try:
        # An ASCII name goes as bytes, which the C function takes as they are (typeshed says str): a
        # str is encoded with the "idna" codec, whose first use imports encodings.idna, stringprep
        # and unicodedata (1-3 ms).
        addr = _socket.gethostbyname(name.encode() if name.isascii() else name)  # type: ignore[arg-type]
    except OSError:
        return "127.0.0.1"
    return addr or "127.0.0.1"


def listen_host() -> str:
    """The address servers bind: ``$MONARCH_LISTEN_HOST`` (``0.0.0.0`` in a Kubernetes pod, where a
    port-forward connects to the pod's localhost) or else the advertised address."""
    return os.environ.get("MONARCH_LISTEN_HOST") or advertised_host()


def bind_port_candidates() -> list[int]:
    """Ports to try when binding a listening socket: [0] (any) unless a port range is set.

    The range is tried from a random starting point, so processes sharing it rarely collide.
    """
    if _settings.port_range is None:
        return [0]
    import random

    lo, hi = _settings.port_range
    ports = list(range(lo, hi + 1))
    start = random.randrange(len(ports))
    return ports[start:] + ports[:start]
