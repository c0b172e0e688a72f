"""Test hosts as Linux network namespaces on a bridge, for the tests that need machines with
addresses of their own (tests/ssh, tests/skypilot). Needs root and iproute2.

Hosts ``<prefix>-h1..n`` on bridge ``<prefix>-br0``; the client's side of the bridge is
``<subnet>.1`` (every host's default route) and host i is ``<subnet>.(10+i)``.
"""

from __future__ import annotations

import signal
import subprocess

from monarch_cli.sysutil import signal_if_alive


def sh(*cmd: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, capture_output=True, text=True, check=check)


def add_hosts(prefix: str, subnet: str, n: int) -> list[tuple[str, str]]:
    """The bridge and ``n`` hosts, each ``(namespace, address)``; the caller tears them down."""
    bridge = f"{prefix}-br0"
    sh("ip", "link", "add", bridge, "type", "bridge")
    sh("ip", "addr", "add", f"{subnet}.1/24", "dev", bridge)
    sh("ip", "link", "set", bridge, "up")
    hosts = []
    for i in range(1, n + 1):
        ns, address, veth = f"{prefix}-h{i}", f"{subnet}.{10 + i}", f"{prefix}-v{i}"
        sh("ip", "netns", "add", ns)
        sh("ip", "link", "add", veth, "type", "veth", "peer", "name", "eth0", "netns", ns)
        sh("ip", "link", "set", veth, "master", bridge, "up")
        for cmd in (
            ["ip", "addr", "add", f"{address}/24", "dev", "eth0"],
            ["ip", "link", "set", "eth0", "up"],
            ["ip", "link", "set", "lo", "up"],
            ["ip", "route", "add", "default", "via", f"{subnet}.1"],
        ):
            sh("ip", "netns", "exec", ns, *cmd)
        hosts.append((ns, address))
    return hosts


def remove_hosts(prefix: str, n: int) -> None:
    """Kill every process in the hosts, then remove them and the bridge (whatever of it exists)."""
    for i in range(1, n + 1):
        ns = f"{prefix}-h{i}"
        for pid in sh("ip", "netns", "pids", ns, check=False).stdout.split():
            signal_if_alive(int(pid), signal.SIGKILL)  # sshd and every session and agent it started there
        sh("ip", "netns", "del", ns, check=False)
        sh("ip", "link", "del", f"{prefix}-v{i}", check=False)
    sh("ip", "link", "del", f"{prefix}-br0", check=False)
