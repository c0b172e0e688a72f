"""The SSH test hosts themselves: real sshd, own addresses, private homes, no shared workspace."""

from __future__ import annotations

from pathlib import Path

import paramiko
import pytest

from .conftest import SshHost, SshHosts

pytestmark = [pytest.mark.slow, pytest.mark.ssh]


def _connect(hosts: SshHosts, host: SshHost) -> paramiko.SSHClient:
    client = paramiko.SSHClient()
    client.load_host_keys(str(hosts.known_hosts))
    client.set_missing_host_key_policy(paramiko.RejectPolicy())
    client.connect(
        host.address,
        username="root",
        key_filename=str(hosts.client_key),
        look_for_keys=False,
        allow_agent=False,
        timeout=10,
    )
    return client


def _run(client: paramiko.SSHClient, command: str) -> tuple[int, str]:
    _, out, err = client.exec_command(command, timeout=30)
    text = out.read().decode() + err.read().decode()
    return out.channel.recv_exit_status(), text


def test_hosts_have_own_addresses_private_homes_and_no_shared_workspace(ssh_hosts: SshHosts, tmp_path: Path) -> None:
    workspace_file = tmp_path / "train.py"
    workspace_file.write_text("print('client only')\n")
    clients = [_connect(ssh_hosts, h) for h in ssh_hosts.hosts]
    try:
        for _i, (host, client) in enumerate(zip(ssh_hosts.hosts, clients)):
            code, text = _run(client, "ip -4 -o addr show dev eth0")
            assert code == 0 and f"inet {host.address}/" in text
            assert _run(client, f"test -e {workspace_file}")[0] != 0  # the client's files are not there
            assert _run(client, f"echo {host.name} > ~/marker && cat ~/marker") == (0, f"{host.name}\n")
            code, text = _run(
                client, f"{ssh_hosts.python} -c 'import monarch_cli, paramiko; print(monarch_cli.__version__)'"
            )
            assert code == 0, text
        # each home is its own: host 1's marker is not on host 2, nor in the client's home
        assert _run(clients[1], "cat ~/marker")[1] == f"{ssh_hosts.hosts[1].name}\n"
        assert not (Path.home() / "marker").exists()
    finally:
        for c in clients:
            c.close()


def test_unknown_host_key_is_refused(ssh_hosts: SshHosts) -> None:
    client = paramiko.SSHClient()
    client.set_missing_host_key_policy(paramiko.RejectPolicy())  # empty known hosts
    with pytest.raises(paramiko.SSHException, match="not found in known_hosts"):
        client.connect(
            ssh_hosts.hosts[0].address,
            username="root",
            key_filename=str(ssh_hosts.client_key),
            look_for_keys=False,
            allow_agent=False,
            timeout=10,
        )
    client.close()
