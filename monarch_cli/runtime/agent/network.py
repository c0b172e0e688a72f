"""Which network interface a multi-host rank's collectives use, found on the host itself.

gloo (and NCCL's bootstrap) pick an interface from what the host's own name resolves to; on
Debian and Ubuntu that is ``127.0.1.1``, and peers then get "connection refused". The agent
knows the rendezvous address (``MASTER_ADDR``, an address the client reached rank 0's host at),
so it sets ``GLOO_SOCKET_IFNAME`` and ``NCCL_SOCKET_IFNAME`` to the interface that routes
there, unless the user set them.
"""

from __future__ import annotations

import functools

from ...sysutil import source_address_towards

SOCKET_IFNAME_VARIABLES = ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME")


@functools.lru_cache(maxsize=64)
def interface_towards(address: str) -> str | None:
    """The name of the interface holding this host's address on the route to ``address``."""
    source = source_address_towards(address)
    if source is None:
        return None
    import psutil

    for name, addrs in psutil.net_if_addrs().items():
        if any(a.address == source for a in addrs):
            return name
    return None


def set_socket_ifname(env: dict[str, str]) -> None:
    """Fill the unset ``*_SOCKET_IFNAME`` variables of a rank of a multi-host run."""
    master = env.get("MASTER_ADDR")
    if not master or env.get("GROUP_WORLD_SIZE", "1") == "1":
        return
    if all(env.get(v) for v in SOCKET_IFNAME_VARIABLES):
        return
    name = interface_towards(master)
    if name is None:
        return
    for variable in SOCKET_IFNAME_VARIABLES:
        env.setdefault(variable, name)


__all__ = ["interface_towards", "set_socket_ifname", "SOCKET_IFNAME_VARIABLES"]
