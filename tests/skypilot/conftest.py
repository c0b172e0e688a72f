"""Nodes for the skypilot stand-in: network namespaces ``msky-h1``, ``msky-h2`` on bridge ``msky-br0``.

The client's side of the bridge is ``10.215.0.1``; node i is ``10.215.0.(10+i)``. Needs root.
(tests/ssh uses ``mssh-*`` on 10.214.0.0/24; the two never meet.)
"""

from __future__ import annotations

import os
import signal
import subprocess
from typing import Iterator, List, Tuple

import pytest

BRIDGE = "msky-br0"
SUBNET = "10.215.0"
N_NODES = 2


def _sh(*cmd: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, capture_output=True, text=True, check=check)


def _teardown() -> None:
    for i in range(1, N_NODES + 1):
        ns = f"msky-h{i}"
        for pid in _sh("ip", "netns", "pids", ns, check=False).stdout.split():
            try:
                os.kill(int(pid), signal.SIGKILL)
            except (ProcessLookupError, ValueError):
                pass
        _sh("ip", "netns", "del", ns, check=False)
        _sh("ip", "link", "del", f"msky-v{i}", check=False)
    _sh("ip", "link", "del", BRIDGE, check=False)


@pytest.fixture(scope="session")
def sky_nodes() -> Iterator[List[Tuple[str, str]]]:
    """``[(namespace, address)]`` of the nodes."""
    if os.geteuid() != 0:
        pytest.fail("the skypilot stand-in needs root (network and mount namespaces)")
    _teardown()
    _sh("ip", "link", "add", BRIDGE, "type", "bridge")
    _sh("ip", "addr", "add", f"{SUBNET}.1/24", "dev", BRIDGE)
    _sh("ip", "link", "set", BRIDGE, "up")
    nodes = []
    try:
        for i in range(1, N_NODES + 1):
            ns, address = f"msky-h{i}", f"{SUBNET}.{10 + i}"
            _sh("ip", "netns", "add", ns)
            _sh("ip", "link", "add", f"msky-v{i}", "type", "veth", "peer", "name", "eth0", "netns", ns)
            _sh("ip", "link", "set", f"msky-v{i}", "master", BRIDGE, "up")
            for cmd in (["ip", "addr", "add", f"{address}/24", "dev", "eth0"], ["ip", "link", "set", "eth0", "up"],
                        ["ip", "link", "set", "lo", "up"], ["ip", "route", "add", "default", "via", f"{SUBNET}.1"]):
                _sh("ip", "netns", "exec", ns, *cmd)
            nodes.append((ns, address))
        yield nodes
    finally:
        _teardown()
