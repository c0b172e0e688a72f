"""SSH faults a user meets outside the happy path: keys held only by ssh-agent, and a host
whose disk fills up. Real sshd hosts in network namespaces (tests/ssh/conftest.py)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from monarch_cli.errors import MonarchError
from monarch_cli.jobs import serve

from .conftest import SshHosts
from .test_ssh_backend import PYTHON, _on_host, _ssh_config

pytestmark = [pytest.mark.slow, pytest.mark.ssh]


def test_keys_held_only_by_ssh_agent_are_used(
    ssh_hosts: SshHosts, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from monarch_cli.schedulers.ssh import connect, resolve

    sock = tmp_path / "agent.sock"
    agent = subprocess.Popen(["ssh-agent", "-D", "-a", str(sock)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        for _ in range(100):
            if sock.exists():
                break
            subprocess.run(["sleep", "0.05"])
        env = {**os.environ, "SSH_AUTH_SOCK": str(sock)}
        subprocess.run(["ssh-add", "-q", str(ssh_hosts.client_key)], env=env, check=True, capture_output=True)
        monkeypatch.setenv("SSH_AUTH_SOCK", str(sock))
        monkeypatch.setenv("HOME", str(tmp_path))  # no ~/.ssh/id_* to fall back on
        h1 = ssh_hosts.hosts[0]
        config = tmp_path / "ssh_config"  # no IdentityFile: only the agent has the key
        config.write_text(
            f"Host viaagent\n  HostName {h1.address}\n  User root\n"
            f"  UserKnownHostsFile {ssh_hosts.known_hosts}\n  StrictHostKeyChecking yes\n"
        )
        client = connect(resolve("viaagent", {"ssh_config": str(config)}), accept_new=False)
        try:
            _, out, _ = client.exec_command("echo reached-by-agent-key")
            assert out.read().decode().strip() == "reached-by-agent-key"
        finally:
            client.close()
    finally:
        agent.kill()
        agent.wait(5)


def test_a_full_remote_disk_is_one_line_naming_the_host(ssh_hosts: SshHosts, tmp_path: Path) -> None:
    small = "/root/monarch-small"
    assert _on_host(ssh_hosts, 1, f"mkdir -p {small} && mount -t tmpfs -o size=256k tmpfs {small}")[0] == 0
    config = _ssh_config(ssh_hosts, tmp_path / "ssh_config", ssh_hosts.known_hosts)
    ws = tmp_path / "ws"
    ws.mkdir()
    # too small for our code and wheels: serve says so, naming the host, before uploading anything
    with pytest.raises(MonarchError, match=r"host h2 \(10\.214\.0\.12:22\): not enough space for our code and wheels"):
        serve(None, "ssh", state=ws / "s.pkl", hosts="h1,h2", ssh_config=str(config), python=PYTHON, remote_dir=small)
    # room for the bundle, then only 256 KiB left for the workspace
    _on_host(ssh_hosts, 1, f"umount {small} && mount -t tmpfs -o size=128m tmpfs {small}")
    job = serve(
        None,
        "ssh",
        state=ws / ".monarch" / "job_state.pkl",
        hosts="h1,h2",
        ssh_config=str(config),
        python=PYTHON,
        remote_dir=small,
    )
    fill = f"head -c $(( $(df --output=avail -B1 {small} | tail -1) - 262144 )) /dev/zero > {small}/filler"
    assert _on_host(ssh_hosts, 1, fill)[0] == 0
    try:
        (ws / "data.bin").write_bytes(os.urandom(1 << 20))  # 1 MiB: more than h2's 256 KiB
        (ws / "run.py").write_text("print('ran')\n")
        done = subprocess.run(
            [sys.executable, "-m", "monarch_cli", "run-spmd", "--", "torchrun", "--nproc-per-node=1", "run.py"],
            cwd=ws,
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert done.returncode != 0 and "Traceback" not in done.stderr, done.stderr
        errors = [line for line in done.stderr.splitlines() if line.startswith("monarch: error:")]
        assert len(errors) == 1 and "h2" in errors[0] and "space" in errors[0].lower(), done.stderr
        assert "ran" not in done.stdout
    finally:
        job.stop()
        _on_host(ssh_hosts, 1, f"umount {small}; rmdir {small}")


def _cut_ssh_sessions(hosts: SshHosts, i: int) -> int:
    """Kill host ``i``'s sshd session processes (every connection into it drops, as when sshd dies);
    its listener stays, so later tests still reach the host."""
    killed = 0
    for pid in subprocess.run(
        ["ip", "netns", "pids", hosts.hosts[i].name], capture_output=True, text=True
    ).stdout.split():
        try:
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
            if "sshd" in cmd and " -D " not in cmd:
                os.kill(int(pid), signal.SIGKILL)
                killed += 1
        except (OSError, ValueError):
            continue
    return killed


def test_sshd_dying_during_serve_is_one_line_naming_the_host(ssh_hosts: SshHosts, tmp_path: Path) -> None:
    config = _ssh_config(ssh_hosts, tmp_path / "ssh_config", ssh_hosts.known_hosts)
    cut: list[int] = []

    def progress(message: str) -> None:
        if message.startswith("h2: starting the agent") and not cut:
            cut.append(_cut_ssh_sessions(ssh_hosts, 1))

    with pytest.raises(MonarchError) as failed:
        serve(
            None,
            "ssh",
            state=tmp_path / ".monarch" / "s.pkl",
            hosts="h1,h2",
            ssh_config=str(config),
            python=PYTHON,
            progress=progress,
        )
    assert cut and cut[0] > 0
    message = str(failed.value)
    assert message.startswith(f"host h2 ({ssh_hosts.hosts[1].address}:22): the SSH connection was lost"), message
    assert "\n" not in message
