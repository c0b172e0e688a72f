"""Hosts that have nothing of ours: the client ships its code and dependencies, networks find their way.

The bare hosts (tests/ssh/conftest.py) have only a venv of Debian's Python with torch and numpy,
no package index, and a hostname that resolves to 127.0.1.1. Serve, a two-host gloo all-reduce
with no ``-e``, a re-run, ``exec``, ``stop``, and a second serve that ships nothing; the
interpreter's packages are the same before and after.
"""

from __future__ import annotations

import io
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from monarch_cli.jobs import serve

from .conftest import SshHosts
from .test_ssh_backend import _on_host

pytestmark = [pytest.mark.slow, pytest.mark.ssh]
REPO = str(Path(__file__).resolve().parents[2])

ALLREDUCE = """\
import os, sys, torch, torch.distributed as dist
dist.init_process_group("gloo")
t = torch.ones(1) * (dist.get_rank() + 1)
dist.all_reduce(t)
print("sum", int(t.item()), "torch from venv", torch.__file__.startswith(sys.prefix),
      "ifname", os.environ.get("GLOO_SOCKET_IFNAME"))
dist.destroy_process_group()
"""


def _config(hosts: SshHosts, path: Path, extra: str = "") -> Path:
    path.write_text(
        "".join(
            f"Host b{i}\n  HostName {h.address}\n  User root\n  IdentityFile {hosts.client_key}\n"
            f"  UserKnownHostsFile {hosts.known_hosts}\n  StrictHostKeyChecking yes\n"
            for i, h in enumerate(hosts.hosts, 1)
        )
        + extra
    )
    return path


def _freeze(hosts: SshHosts, i: int) -> str:
    code, text = _on_host(hosts, i, f"{hosts.python} -m pip freeze --all")
    assert code == 0, text
    return text


def test_serve_run_exec_stop_and_serve_again_on_hosts_with_nothing_of_ours(
    bare_hosts: SshHosts, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    config = _config(bare_hosts, tmp_path / "ssh_config")
    before = [_freeze(bare_hosts, i) for i in range(2)]
    for i in range(2):  # what the issue is about: nothing of ours, and the name resolves to loopback
        code, text = _on_host(bare_hosts, i, f"{bare_hosts.python} -c 'import zmq' ; getent hosts $(hostname)")
        assert "No module named 'zmq'" in text and "127.0.1.1" in text, text
    ws = tmp_path / "ws"
    ws.mkdir()
    (ws / "train.py").write_text(ALLREDUCE)
    monkeypatch.chdir(ws)
    state = ws / ".monarch" / "job_state.pkl"
    progress: list[str] = []
    started = time.monotonic()
    job = serve(
        None,
        "ssh",
        state=state,
        hosts="b1,b2",
        ssh_config=str(config),
        python=bare_hosts.python,
        progress=progress.append,
    )
    first_seconds = time.monotonic() - started
    first = [rec["bundle"]["shipped"] for rec in job.state.scheduler_data["ssh_hosts"]]
    assert all(n > 1_000_000 for n in first), first  # code and wheels went to both hosts
    assert sum("shipping deps-" in p for p in progress) == 2, progress
    try:
        for _ in range(2):  # a run, then a re-run
            out = io.BytesIO()
            result = job.run_spmd(["torchrun", "--nproc-per-node=1", "train.py"], stdout=out, stderr=out)
            text = out.getvalue().decode()
            assert result.exit_code == 0, text
            lines = [line for line in text.splitlines() if " sum " in line]
            assert len(lines) == 2 and all("sum 3 torch from venv True ifname eth0" in x for x in lines), text
        out = io.BytesIO()
        result = job.exec("hostname; cat train.py | wc -l", stdout=out, stderr=out)
        text = out.getvalue().decode()
        assert result.exit_code == 0 and "mbare-h1" in text and "mbare-h2" in text, text
    finally:
        job.stop()
    for i in range(2):
        code, text = _on_host(bare_hosts, i, "ls ~/.monarch-cli/bundles")
        assert sorted(n.split("-")[0] for n in text.split()) == ["code", "deps"], text
    started = time.monotonic()
    progress.clear()
    job = serve(
        None,
        "ssh",
        state=state,
        hosts="b1,b2",
        ssh_config=str(config),
        python=bare_hosts.python,
        progress=progress.append,
    )
    second_seconds = time.monotonic() - started
    try:
        assert [rec["bundle"]["shipped"] for rec in job.state.scheduler_data["ssh_hosts"]] == [0, 0]
        assert not any("shipping" in p for p in progress), progress
        out = io.BytesIO()
        result = job.run_spmd(["torchrun", "--nproc-per-node=1", "train.py"], stdout=out, stderr=out)
        assert result.exit_code == 0 and out.getvalue().decode().count("sum 3") == 2, out.getvalue()
    finally:
        job.stop()
    assert [_freeze(bare_hosts, i) for i in range(2)] == before
    print(f"\nbare hosts: first serve {first_seconds:.1f} s, {first} bytes shipped; second {second_seconds:.1f} s")


def _monarch(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "monarch_cli", *args],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=cwd,
        env={**os.environ, "PYTHONPATH": REPO},
    )


@pytest.mark.parametrize(
    ("host", "python", "expected"),
    [
        ("b1", "/nope/python3", "host b1 (10.218.0.11:22): --python /nope/python3 does not run there"),
        ("gone", None, "host gone (10.218.0.99:22) is unreachable"),
        ("refused", None, "host refused (10.218.0.11:2222) is unreachable"),
    ],
)
def test_bad_python_and_unreachable_hosts_are_one_short_line(
    bare_hosts: SshHosts, tmp_path: Path, host: str, python: str | None, expected: str
) -> None:
    extra = (
        f"Host gone\n  HostName {bare_hosts.hosts[0].address.rpartition('.')[0]}.99\n  User root\n"
        f"Host refused\n  HostName {bare_hosts.hosts[0].address}\n  Port 2222\n  User root\n"
    )
    config = _config(bare_hosts, tmp_path / "ssh_config", extra)
    args = ["serve", "--scheduler", "ssh", "--hosts", host, "--ssh-config", str(config)]
    proc = _monarch(*args, "--python", python or bare_hosts.python, "--state", str(tmp_path / "s.pkl"), cwd=tmp_path)
    assert proc.returncode != 0
    errors = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(errors) == 1 and expected in errors[0] and len(errors[0]) < 300, proc.stderr
    assert "Traceback" not in proc.stderr and "paramiko" not in proc.stderr.lower()


def test_hosts_that_cannot_reach_each_other_are_named_at_serve(bare_hosts: SshHosts, tmp_path: Path) -> None:
    """The client reaches both hosts, but b1 has no route to b2: serve says so in one line, before any run."""
    config = _config(bare_hosts, tmp_path / "ssh_config")
    b1, b2 = bare_hosts.hosts
    route = ["ip", "netns", "exec", b1.name, "ip", "route", "add", "unreachable", f"{b2.address}/32"]
    subprocess.run(route, check=True)
    try:
        args = ["serve", "--scheduler", "ssh", "--hosts", "b1,b2", "--ssh-config", str(config)]
        proc = _monarch(*args, "--python", bare_hosts.python, "--state", str(tmp_path / "s.pkl"), cwd=tmp_path)
    finally:
        subprocess.run([*route[:6], "del", *route[7:]], check=True)
    assert proc.returncode != 0
    errors = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(errors) == 1 and f"host b1 cannot reach host b2 at {b2.address}:" in errors[0], proc.stderr
    assert "Traceback" not in proc.stderr
    for h in bare_hosts.hosts:  # nothing is left running on either host (sshd aside)
        pids = subprocess.run(["ip", "netns", "pids", h.name], capture_output=True, text=True).stdout.split()
        left = [Path(f"/proc/{pid}/cmdline").read_bytes() for pid in pids if Path(f"/proc/{pid}").exists()]
        assert not [c for c in left if b"sshd" not in c], left


def test_a_port_that_never_sends_an_ssh_banner_is_one_line(bare_hosts: SshHosts, tmp_path: Path) -> None:
    """A TCP port that accepts but never speaks SSH (a wrong port, a hung sshd): paramiko's banner
    timeout and its logged traceback stay out of the terminal."""
    import socket

    client_side = bare_hosts.hosts[0].address.rpartition(".")[0] + ".1"
    silent = socket.create_server((client_side, 0))
    port = silent.getsockname()[1]
    config = _config(bare_hosts, tmp_path / "ssh_config", f"Host mute\n  HostName {client_side}\n  Port {port}\n")
    try:
        args = ["serve", "--scheduler", "ssh", "--hosts", "mute", "--ssh-config", str(config)]
        proc = _monarch(*args, "--state", str(tmp_path / "s.pkl"), cwd=tmp_path)
    finally:
        silent.close()
    errors = [line for line in proc.stderr.splitlines() if line.strip()]
    assert proc.returncode != 0 and len(errors) == 1, proc.stderr
    assert f"host mute ({client_side}:{port}) is unreachable" in errors[0] and "no SSH server answered" in errors[0], (
        proc.stderr
    )
    assert "Traceback" not in proc.stderr and "paramiko" not in proc.stderr.lower()
