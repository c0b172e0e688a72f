"""Real SSH hosts for the ssh backend and workspace sync: sshd in network namespaces.

Each host is a network namespace (``mssh-h1``, ``mssh-h2``) with its own address on a bridge
in the root namespace (``10.214.0.1`` is the client's side), running Debian's real
``/usr/sbin/sshd`` with its own host key. Each sshd runs in its own mount namespace too,
where ``/root`` is a private tmpfs (the interpreter under ``/root/.pyenv`` is bound back) and
``/tmp`` is an empty tmpfs: the host's home is its own and it cannot see the client's files
(pytest's directories live in /tmp), so the workspace is not shared. Only the client's
freshly generated key is authorized. Needs root; openssh-server is installed if missing.
"""

from __future__ import annotations

import dataclasses
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from ..conftest import REPO
from ..netns import add_hosts, remove_hosts

PREFIX = "mssh"  # hosts mssh-h1.., bridge mssh-br0 (tests/netns.py)
BRIDGE = f"{PREFIX}-br0"
SUBNET = "10.214.0"
CLIENT_ADDRESS = f"{SUBNET}.1"
KEEP = "/run/mssh-keep"  # where the interpreter's tree is bound while /root is replaced
KEEP_CHECKOUT = "/run/mssh-keep-checkout"  # the same for this checkout, when /root or /tmp would hide it

_SSHD_CONFIG = """\
Port 22
ListenAddress {address}
HostKey /root/.sshd/host_key
PidFile /root/.sshd/sshd.pid
PermitRootLogin prohibit-password
PasswordAuthentication no
KbdInteractiveAuthentication no
UsePAM no
AuthorizedKeysFile .ssh/authorized_keys
Subsystem sftp internal-sftp
PrintMotd no
LogLevel ERROR
"""

# Runs inside `ip netns exec NS unshare --mount --propagation private`: private /root, hidden /tmp.
_HOST_SCRIPT = """\
set -e
INFRA="$0"
mkdir -p {keep} /run/sshd
mount --rbind "{pyroot}" {keep}
mount -t tmpfs -o mode=700 tmpfs /root
mkdir -p "{pyroot}" /root/.ssh /root/.sshd
mount --rbind {keep} "{pyroot}"
cp "$INFRA/sshd_config" "$INFRA/host_key" /root/.sshd/
cp "$INFRA/authorized_keys" /root/.ssh/authorized_keys
chmod 700 /root/.ssh /root/.sshd
chmod 600 /root/.sshd/host_key /root/.ssh/authorized_keys
mount -t tmpfs tmpfs /tmp
exec /usr/sbin/sshd -D -e -f /root/.sshd/sshd_config
"""


@dataclasses.dataclass
class SshHost:
    name: str  # the network namespace
    address: str
    host_key_line: str  # "ADDRESS ssh-ed25519 AAAA..." as known_hosts holds it
    sshd: subprocess.Popen


@dataclasses.dataclass
class SshHosts:
    hosts: list[SshHost]
    client_key: Path  # private key, 0600, authorized on every host
    known_hosts: Path  # the hosts' keys, for StrictHostKeyChecking
    python: str  # the interpreter path, the same on every host


def _sh(*cmd: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, capture_output=True, text=True, check=check)


def _install_sshd() -> None:
    if os.path.exists("/usr/sbin/sshd") and shutil.which("ip") and shutil.which("ssh-keygen"):
        return
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    for cmd in (["apt-get", "update", "-qq"], ["apt-get", "install", "-y", "-qq", "openssh-server", "iproute2"]):
        proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
        if proc.returncode != 0:
            pytest.fail(f"{' '.join(cmd)} failed: {proc.stderr[-2000:]}")


def _teardown_network(n: int) -> None:
    remove_hosts(PREFIX, n)


def _pyroot() -> str:
    """The top directory of this interpreter's installation under /root (bound back in the hosts)."""
    exe = os.path.realpath(sys.executable)
    if not exe.startswith("/root/"):
        return ""
    return "/root/" + exe.split("/")[2]


def _hidden_checkout() -> str:
    """This checkout, when it lies under /root or /tmp (a fresh clone in a temporary folder): the
    shared interpreter's editable install imports monarch_cli from it, so the hosts get it bound
    back, as a site-packages on a shared file system would be. The tests' workspaces (pytest's
    directories in /tmp) stay hidden."""
    checkout = str(REPO.resolve())
    return checkout if checkout.startswith(("/root/", "/tmp/")) else ""


def _bind_checkout_back(script: str, checkout: str) -> str:
    """``_HOST_SCRIPT`` with ``checkout`` bound aside before /root and /tmp are replaced, and back after."""
    aside = f'mkdir -p {KEEP_CHECKOUT}\nmount --rbind "{checkout}" {KEEP_CHECKOUT}\n'
    back = f'mkdir -p "{checkout}"\nmount --rbind {KEEP_CHECKOUT} "{checkout}"\n'
    return script.replace("set -e\n", "set -e\n" + aside, 1).replace(
        "exec /usr/sbin/sshd", back + "exec /usr/sbin/sshd", 1
    )


@pytest.fixture(scope="session")
def ssh_hosts(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SshHosts]:
    if os.geteuid() != 0:
        pytest.fail("the ssh tests need root (network namespaces, sshd); run them as root or deselect -m 'not ssh'")
    _install_sshd()
    n = 2
    _teardown_network(n)  # left over from an interrupted run
    base = tmp_path_factory.mktemp("ssh")
    key = base / "client_key"
    _sh("ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", "monarch-test-client", "-f", str(key))
    hosts: list[SshHost] = []
    pyroot = _pyroot()
    try:
        for ns, address in add_hosts(PREFIX, SUBNET, n):
            infra = base / ns
            infra.mkdir()
            _sh("ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", ns, "-f", str(infra / "host_key"))
            (infra / "sshd_config").write_text(_SSHD_CONFIG.format(address=address))
            shutil.copy(f"{key}.pub", infra / "authorized_keys")
            script = _HOST_SCRIPT.format(keep=KEEP, pyroot=pyroot or "/nonexistent-pyroot")
            if not pyroot:  # the interpreter is not under /root: nothing to bind back
                script = (
                    script.replace(f'mount --rbind "/nonexistent-pyroot" {KEEP}\n', "")
                    .replace('mkdir -p "/nonexistent-pyroot" ', "mkdir -p ")
                    .replace(f'mount --rbind {KEEP} "/nonexistent-pyroot"\n', "")
                )
            if _hidden_checkout():
                script = _bind_checkout_back(script, _hidden_checkout())
            log = open(base / f"{ns}.sshd.log", "wb")
            sshd = subprocess.Popen(
                [
                    "ip",
                    "netns",
                    "exec",
                    ns,
                    "unshare",
                    "--mount",
                    "--propagation",
                    "private",
                    "sh",
                    "-c",
                    script,
                    str(infra),
                ],
                stdout=log,
                stderr=log,
                stdin=subprocess.DEVNULL,
            )
            pub = (infra / "host_key.pub").read_text().split()
            hosts.append(SshHost(ns, address, f"{address} {pub[0]} {pub[1]}", sshd))
        known = base / "known_hosts"
        known.write_text("".join(h.host_key_line + "\n" for h in hosts))
        for h in hosts:
            _wait_for_port(h, base)
        yield SshHosts(hosts, key, known, os.path.realpath(sys.executable))
    finally:
        _teardown_network(n)


def _wait_for_port(host: SshHost, base: Path) -> None:
    import socket

    deadline = time.monotonic() + 20
    while True:
        if host.sshd.poll() is not None:
            pytest.fail(f"sshd in {host.name} exited: {(base / f'{host.name}.sshd.log').read_text()[-2000:]}")
        try:
            with socket.create_connection((host.address, 22), timeout=1) as s:
                if s.recv(4).startswith(b"SSH-"):
                    return
        except OSError:
            pass
        if time.monotonic() > deadline:
            pytest.fail(f"sshd in {host.name} is not answering on {host.address}:22")
        time.sleep(0.1)


# ---------------------------------------------------------------- bare hosts
# A second set of hosts that have nothing of ours: what a user's cluster looks like. Each is a
# network namespace with no route beyond its bridge (no package index), its own UTS namespace
# whose hostname /etc/hosts maps to 127.0.1.1 (Debian's default), a private /root and /tmp, and
# one interpreter: a venv made from Debian's /usr/bin/python3 holding torch and numpy only
# (BARE_VENV, outside the client's environment; built once, then reused across runs).
BARE_PREFIX = "mbare"
BARE_SUBNET = "10.218.0"  # apart from ssh (10.214), skypilot (10.215, 10.216) and kubernetes (10.216)
BARE_VENV = "/var/cache/monarch-tests/bare-venv"

_BARE_HOST_SCRIPT = """\
set -e
INFRA="$0"
hostname {hostname}
mkdir -p /run/sshd
mount --bind "$INFRA/hosts" /etc/hosts
mount -t tmpfs -o mode=700 tmpfs /root
mkdir -p /root/.ssh /root/.sshd
cp "$INFRA/sshd_config" "$INFRA/host_key" /root/.sshd/
cp "$INFRA/authorized_keys" /root/.ssh/authorized_keys
chmod 700 /root/.ssh /root/.sshd
chmod 600 /root/.sshd/host_key /root/.ssh/authorized_keys
mount -t tmpfs tmpfs /tmp
exec /usr/sbin/sshd -D -e -f /root/.sshd/sshd_config
"""


def _bare_venv() -> str:
    """Debian's Python 3 with torch and numpy only (torch pinned: the CPU build this machine has)."""
    python = f"{BARE_VENV}/bin/python"
    if os.path.exists(f"{BARE_VENV}/.complete"):
        return python
    if not os.path.exists("/usr/bin/python3"):
        _apt_install("python3", "python3-venv")
    tmp = f"{BARE_VENV}.building"
    shutil.rmtree(tmp, ignore_errors=True)
    os.makedirs(os.path.dirname(BARE_VENV), exist_ok=True)
    proc = subprocess.run(["/usr/bin/python3", "-m", "venv", tmp], capture_output=True, text=True)
    if proc.returncode != 0:
        _apt_install("python3-venv")
        _sh("/usr/bin/python3", "-m", "venv", tmp)
    proc = subprocess.run([f"{tmp}/bin/pip", "install", "-q", "torch==2.13.0", "numpy"], capture_output=True, text=True)
    if proc.returncode != 0:
        pytest.fail(f"cannot make the bare hosts' venv: {proc.stderr[-2000:]}")
    shutil.rmtree(BARE_VENV, ignore_errors=True)
    os.rename(tmp, BARE_VENV)  # venv scripts name their directory: fixed up below
    for script in Path(BARE_VENV, "bin").iterdir():
        if script.is_file() and not script.is_symlink():
            try:
                text = script.read_text()
            except UnicodeDecodeError:
                continue
            script.write_text(text.replace(tmp, BARE_VENV))
    Path(BARE_VENV, "pyvenv.cfg").write_text(Path(BARE_VENV, "pyvenv.cfg").read_text().replace(tmp, BARE_VENV))
    Path(BARE_VENV, ".complete").write_text("")
    return python


def _apt_install(*packages: str) -> None:
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    for cmd in (["apt-get", "update", "-qq"], ["apt-get", "install", "-y", "-qq", *packages]):
        proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
        if proc.returncode != 0:
            pytest.fail(f"{' '.join(cmd)} failed: {proc.stderr[-2000:]}")


@pytest.fixture(scope="session")
def bare_hosts(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SshHosts]:
    """Two hosts with nothing of ours (see above); ``python`` is their venv's interpreter."""
    if os.geteuid() != 0:
        pytest.fail("the ssh tests need root (network namespaces, sshd); run them as root or deselect -m 'not ssh'")
    _install_sshd()
    python = _bare_venv()
    n = 2
    remove_hosts(BARE_PREFIX, n)
    base = tmp_path_factory.mktemp("bare")
    key = base / "client_key"
    _sh("ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", "monarch-test-client", "-f", str(key))
    hosts: list[SshHost] = []
    try:
        for ns, address in add_hosts(BARE_PREFIX, BARE_SUBNET, n):
            _sh("ip", "netns", "exec", ns, "ip", "route", "del", "default")  # the bridge's subnet only
            infra = base / ns
            infra.mkdir()
            _sh("ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", ns, "-f", str(infra / "host_key"))
            (infra / "sshd_config").write_text(_SSHD_CONFIG.format(address=address))
            (infra / "hosts").write_text(f"127.0.0.1 localhost\n127.0.1.1 {ns}\n")
            shutil.copy(f"{key}.pub", infra / "authorized_keys")
            log = open(base / f"{ns}.sshd.log", "wb")
            sshd = subprocess.Popen(
                ["ip", "netns", "exec", ns, "unshare", "--mount", "--uts", "--propagation", "private"]
                + ["sh", "-c", _BARE_HOST_SCRIPT.format(hostname=ns), str(infra)],
                stdout=log,
                stderr=log,
                stdin=subprocess.DEVNULL,
            )
            pub = (infra / "host_key.pub").read_text().split()
            hosts.append(SshHost(ns, address, f"{address} {pub[0]} {pub[1]}", sshd))
        known = base / "known_hosts"
        known.write_text("".join(h.host_key_line + "\n" for h in hosts))
        for h in hosts:
            _wait_for_port(h, base)
        yield SshHosts(hosts, key, known, python)
    finally:
        remove_hosts(BARE_PREFIX, n)
