"""Nodes for the skypilot stand-in: network namespaces ``msky-h1``, ``msky-h2`` on bridge
``msky-br0``, made by tests/netns.py.

The client's side of the bridge is ``10.215.0.1``; node i is ``10.215.0.(10+i)``. Needs root.
(tests/ssh uses ``mssh-*`` on 10.214.0.0/24; the two never meet.)

Each node also has ``eth1`` on a second bridge, ``msky-ibr0`` (node i: ``10.216.0.(10+i)``), to
which the client has no address and no route: a cloud's internal network, for the tests where
the agents' port is closed to the client (they listen only there). ``sky_ssh`` runs Debian's
real sshd on the head (``msky-h1``, on its external address) with a fresh key pair.
"""

from __future__ import annotations

import dataclasses
import os
import shutil
import socket
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from ..netns import add_hosts, remove_hosts, sh

SUBNET = "10.215.0"
INTERNAL_SUBNET = "10.216.0"
INTERNAL_BRIDGE = "msky-ibr0"
N_NODES = 2

_SSHD_CONFIG = """\
Port 22
ListenAddress {address}
HostKey {base}/host_key
PidFile none
PermitRootLogin prohibit-password
PasswordAuthentication no
KbdInteractiveAuthentication no
UsePAM no
StrictModes no
AuthorizedKeysFile {base}/authorized_keys
AllowTcpForwarding yes
LogLevel ERROR
"""


def _teardown() -> None:
    remove_hosts("msky", N_NODES)
    sh("ip", "link", "del", INTERNAL_BRIDGE, check=False)


@pytest.fixture(scope="session")
def sky_nodes() -> Iterator[list[tuple[str, str]]]:
    """``[(namespace, address)]`` of the nodes."""
    if os.geteuid() != 0:
        pytest.fail("the skypilot stand-in needs root (network and mount namespaces)")
    _teardown()
    try:
        nodes = add_hosts("msky", SUBNET, N_NODES)
        sh("ip", "link", "add", INTERNAL_BRIDGE, "type", "bridge")
        sh("ip", "link", "set", INTERNAL_BRIDGE, "up")
        for i, (ns, _) in enumerate(nodes, 1):
            sh("ip", "link", "add", f"msky-i{i}", "type", "veth", "peer", "name", "eth1", "netns", ns)
            sh("ip", "link", "set", f"msky-i{i}", "master", INTERNAL_BRIDGE, "up")
            sh("ip", "netns", "exec", ns, "ip", "addr", "add", f"{INTERNAL_SUBNET}.{10 + i}/24", "dev", "eth1")
            sh("ip", "netns", "exec", ns, "ip", "link", "set", "eth1", "up")
        yield nodes
    finally:
        _teardown()


@pytest.fixture
def sky_internal(sky_nodes: list[tuple[str, str]]) -> list[tuple[str, str]]:
    """``[(namespace, internal address)]`` of the nodes."""
    return [(ns, f"{INTERNAL_SUBNET}.{10 + i}") for i, (ns, _) in enumerate(sky_nodes, 1)]


@dataclasses.dataclass
class SkySsh:
    user: str
    key_file: Path  # the client's private key, authorized on the head
    address: str  # where sshd listens (the head's external address)


@pytest.fixture
def sky_ssh(sky_nodes: list[tuple[str, str]], tmp_path: Path) -> Iterator[SkySsh]:
    """Real sshd on the head node, as a cloud VM's; the key pair SkyPilot would have made."""
    if not os.path.exists("/usr/sbin/sshd"):
        env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
        for cmd in (["apt-get", "update", "-qq"], ["apt-get", "install", "-y", "-qq", "openssh-server"]):
            subprocess.run(cmd, capture_output=True, env=env, check=True)
    base = tmp_path / "sshd"
    base.mkdir(mode=0o700)
    ns, address = sky_nodes[0]
    sh("ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(base / "host_key"))
    sh("ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", "sky-key", "-f", str(base / "sky-key"))
    shutil.copy(base / "sky-key.pub", base / "authorized_keys")
    (base / "sshd_config").write_text(_SSHD_CONFIG.format(address=address, base=base))
    os.makedirs("/run/sshd", exist_ok=True)
    log = open(base / "sshd.log", "wb")
    sshd = subprocess.Popen(
        ["ip", "netns", "exec", ns, "/usr/sbin/sshd", "-D", "-e", "-f", str(base / "sshd_config")],
        stdout=log,
        stderr=log,
        stdin=subprocess.DEVNULL,
    )
    try:
        deadline = time.monotonic() + 20
        while True:
            try:
                with socket.create_connection((address, 22), timeout=1) as s:
                    if s.recv(4).startswith(b"SSH-"):
                        break
            except OSError:
                pass
            if sshd.poll() is not None or time.monotonic() > deadline:
                pytest.fail(f"sshd on {ns} did not start: {(base / 'sshd.log').read_text()[-2000:]}")
            time.sleep(0.1)
        yield SkySsh("root", base / "sky-key", address)
    finally:
        sshd.kill()
        sshd.wait()
        log.close()
