"""The ssh backend against another user on the host and a client killed mid-serve: real sshd hosts
(tests/ssh/conftest.py), a real second Unix user, real processes.

- A ``--remote-dir`` another user made first in a directory everyone can write is refused, and a
  code part they planted is never imported, even where the directory is ours.
- A ``serve`` SIGKILLed before it saved the reservation leaves no agent: each exits when its lease
  runs out, with its directory; a saved reservation lives on past the lease.
"""

from __future__ import annotations

import os
import shlex
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import paramiko
import pytest

from monarch_cli.errors import SchedulerError
from monarch_cli.jobs import Job, serve
from monarch_cli.runtime.launch import bundle

from ..conftest import wait_until
from .conftest import SshHosts
from .test_ssh_backend import PYTHON, REPO, _netns_processes, _on_host, _ssh_config

pytestmark = [pytest.mark.slow, pytest.mark.ssh]
OTHER = "monarch-planter"  # a second real user (as tests/jobs/test_planted_files.py makes it)
SYSTEM_PYTHON = "/usr/bin/python3"  # the other user cannot reach our interpreter under /root
PWNED = "/tmp/shared/pwned"
# What the other user appends to the code part's monarch_cli/__init__.py: it runs as whoever imports it.
PAYLOAD = f"\nimport os as _os\nopen({PWNED!r}, 'a').write('imported by uid %d\\n' % _os.getuid())\n"
PLANT = """
import sys, zipfile
zipfile.ZipFile(sys.argv[1]).extractall(sys.argv[2])
with open(sys.argv[2] + "/monarch_cli/__init__.py", "a") as f:
    f.write(sys.argv[3])
"""


@pytest.fixture(scope="module")
def other_user() -> str:
    if subprocess.run(["id", "-u", OTHER], capture_output=True).returncode != 0:
        subprocess.run(["useradd", "--system", "--no-create-home", "--shell", "/usr/sbin/nologin", OTHER], check=True)
    return OTHER


def _put(hosts: SshHosts, i: int, local: Path, remote: str) -> None:
    client = paramiko.SSHClient()
    client.load_host_keys(str(hosts.known_hosts))
    client.connect(hosts.hosts[i].address, username="root", key_filename=str(hosts.client_key), look_for_keys=False)
    try:
        sftp = client.open_sftp()
        sftp.put(str(local), remote)
        sftp.chmod(remote, 0o644)
        sftp.close()
    finally:
        client.close()


def _plant_code_part(hosts: SshHosts, bundles: str) -> str:
    """As the other user: our real code part, unzipped into ``bundles`` under its own name, with a
    payload added (the name is predictable: it is the hash of our code). Returns the part's name."""
    code = bundle.build(bundle.HostPlatform.this_machine()).code  # the hosts run this interpreter
    _put(hosts, 0, code.path, "/tmp/code.zip")
    argv = [
        "runuser",
        "-u",
        OTHER,
        "--",
        SYSTEM_PYTHON,
        "-I",
        "-c",
        PLANT,
        "/tmp/code.zip",
        f"{bundles}/{code.name}",
        PAYLOAD,
    ]
    status, text = _on_host(hosts, 0, shlex.join(argv) + " && rm /tmp/code.zip")
    assert status == 0, text
    return code.name


@pytest.fixture
def shared(ssh_hosts: SshHosts, other_user: str) -> Iterator[str]:
    """``/tmp/shared`` on host h1: everyone may write it, sticky, as /tmp is."""
    assert _on_host(ssh_hosts, 0, "rm -rf /tmp/shared && mkdir -m 1777 /tmp/shared")[0] == 0
    yield "/tmp/shared"
    _on_host(ssh_hosts, 0, "rm -rf /tmp/shared /root/planted")


def _serve_h1(ssh_hosts: SshHosts, tmp_path: Path, remote_dir: str) -> Job:
    config = _ssh_config(ssh_hosts, tmp_path / "ssh_config", ssh_hosts.known_hosts)
    # the bare interpreter: the agent imports our code from the shipped part, as on a user's host
    return serve(
        None,
        "ssh",
        state=tmp_path / ".monarch" / "job_state.pkl",
        hosts="h1",
        ssh_config=str(config),
        python=ssh_hosts.python,
        remote_dir=remote_dir,
    )


def test_a_remote_dir_another_user_made_is_refused_and_their_code_part_never_imported(
    ssh_hosts: SshHosts, shared: str, tmp_path: Path
) -> None:
    mdir = f"{shared}/mdir"  # --remote-dir in a directory everyone can write; the other user came first
    status, text = _on_host(ssh_hosts, 0, f"runuser -u {OTHER} -- mkdir -m 777 {mdir} {mdir}/bundles")
    assert status == 0, text
    _plant_code_part(ssh_hosts, f"{mdir}/bundles")
    with pytest.raises(SchedulerError) as e:
        job = _serve_h1(ssh_hosts, tmp_path, mdir)
        job.stop()  # (the old code served, from their code)
    assert _on_host(ssh_hosts, 0, f"cat {PWNED}")[0] != 0, "the planted code part was imported"
    message = str(e.value)
    assert message.startswith(f"host h1 ({ssh_hosts.hosts[0].address}:22): refusing {mdir}: {OTHER}")
    assert "\n" not in message
    assert _on_host(ssh_hosts, 0, f"ls -A {mdir}")[1].split() == ["bundles"]  # nothing of ours went in there


def test_a_code_part_not_ours_in_our_own_remote_dir_is_replaced_before_it_is_imported(
    ssh_hosts: SshHosts, shared: str, tmp_path: Path
) -> None:
    # Our private remote dir holding a part another user planted (while it was open, or restored from
    # a copy): its name is right, its owner and content are not.
    mine = "/root/planted"
    assert _on_host(ssh_hosts, 0, f"rm -rf {mine} && mkdir -m 700 {mine}")[0] == 0
    assert _on_host(ssh_hosts, 0, f"runuser -u {OTHER} -- mkdir -m 777 {shared}/stage")[0] == 0
    name = _plant_code_part(ssh_hosts, f"{shared}/stage")
    assert _on_host(ssh_hosts, 0, f"mkdir -m 700 {mine}/bundles && mv {shared}/stage/{name} {mine}/bundles/")[0] == 0
    job = _serve_h1(ssh_hosts, tmp_path, mine)
    try:
        assert _on_host(ssh_hosts, 0, f"cat {PWNED}")[0] != 0, "the planted code part was imported"
        status, owner = _on_host(ssh_hosts, 0, f"stat -c %U {mine}/bundles/{name} {mine}/bundles/{name}/monarch_cli")
        assert status == 0 and owner.split() == ["root", "root"], owner  # replaced by ours
        assert job.state.scheduler_data["ssh_hosts"][0]["bundle"]["shipped"] > 0
    finally:
        job.stop()


# ---------------------------------------------------------------- leases
GATE = "/root/lease-gate"  # a FIFO: host h2's agent starts only once the test writes to it
WRAPPER = "/root/lease-python"


def _agents_of(hosts: SshHosts, rid: str) -> list[str]:
    """Processes of reservation ``rid`` in the hosts' network namespaces (their titles name it)."""
    return [line for line in _netns_processes(hosts) if f" {rid} " in f" {line.partition(': ')[2]} "]


@pytest.fixture
def gated_python(ssh_hosts: SshHosts) -> Iterator[str]:
    """An interpreter command that runs at once on h1 and, for the agent (``-m``), waits on h2 until
    the gate opens: the client is surely still waiting for h2 when h1's agent is up."""
    real = ssh_hosts.python
    h1 = f'#!/bin/sh\nexec env PYTHONPATH={REPO} {real} "$@"\n'
    h2 = f'#!/bin/sh\nif [ "$1" = -m ]; then cat {GATE} > /dev/null; fi\nexec env PYTHONPATH={REPO} {real} "$@"\n'
    for i, text in enumerate((h1, h2)):
        cmd = f"rm -rf {GATE} /root/leasetest && mkfifo {GATE} && printf %s {shlex.quote(text)} > {WRAPPER} && chmod 755 {WRAPPER}"
        assert _on_host(ssh_hosts, i, cmd)[0] == 0
    yield WRAPPER
    for i in range(2):
        _on_host(ssh_hosts, i, f"rm -f {GATE} {WRAPPER}; rm -rf /root/leasetest")


def _addr_on_h1(hosts: SshHosts) -> str:
    """The reservation id of h1's agent once it listens, else ""."""
    status, text = _on_host(hosts, 0, "grep -l READY /root/leasetest/ssh-*/agent.addr 2>/dev/null")
    return text.strip().split("/")[3] if status == 0 and text.strip() else ""


def test_an_agent_whose_serve_was_killed_before_saving_exits_when_its_lease_runs_out(
    ssh_hosts: SshHosts, gated_python: str, tmp_path: Path
) -> None:
    config = _ssh_config(ssh_hosts, tmp_path / "ssh_config", ssh_hosts.known_hosts)
    state = tmp_path / ".monarch" / "job_state.pkl"
    argv = [sys.executable, "-m", "monarch_cli", "serve", "--scheduler", "ssh", "--hosts", "h1,h2"]
    argv += ["--ssh-config", str(config), "-o", f"python={gated_python}", "--remote-dir", "/root/leasetest"]
    env = {**os.environ, "PYTHONPATH": REPO, "MONARCH_SSH_AGENT_LEASE": "8"}
    client = subprocess.Popen([*argv, "--state", str(state)], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    rid = ""
    try:
        assert wait_until(lambda: client.poll() is not None or bool(_addr_on_h1(ssh_hosts)), 120, 0.2)
        assert client.poll() is None, client.stdout.read().decode()  # type: ignore[union-attr]
        rid = _addr_on_h1(ssh_hosts)
        client.send_signal(signal.SIGKILL)  # the client dies while it waits for h2: nothing saved
        client.wait(30)
        assert not state.exists()
        assert _on_host(ssh_hosts, 1, f"echo > {GATE}")[0] == 0  # h2's agent starts now, its client gone
        assert wait_until(lambda: len(_agents_of(ssh_hosts, rid)) >= 2, 60, 0.2), _agents_of(ssh_hosts, rid)
        # each exits by itself when its lease runs out, with its warm process and its directory
        assert wait_until(lambda: not _agents_of(ssh_hosts, rid), 8 + 60, 0.2), _agents_of(ssh_hosts, rid)
        for i in range(2):
            assert _on_host(ssh_hosts, i, "ls -A /root/leasetest")[1].split() == ["bundles"]
    finally:
        client.kill()
        client.wait(30)
        for line in _agents_of(ssh_hosts, rid) if rid else []:  # (the old code's agents: never left running)
            os.kill(int(line.split()[1].rstrip(":")), signal.SIGKILL)


def test_a_saved_reservation_outlives_its_lease(
    ssh_hosts: SshHosts, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    config = _ssh_config(ssh_hosts, tmp_path / "ssh_config", ssh_hosts.known_hosts)
    monkeypatch.setenv("MONARCH_SSH_AGENT_LEASE", "3")
    started = time.monotonic()
    state = tmp_path / ".monarch" / "job_state.pkl"
    job = serve(None, "ssh", state=state, hosts="h1,h2", ssh_config=str(config), python=PYTHON)
    try:
        for i, rec in enumerate(job.state.scheduler_data["ssh_hosts"]):
            log = _on_host(ssh_hosts, i, f"cat {rec['directory']}/agent.log")[1]
            assert "a client confirmed this reservation" in log, log
        # What is tested is time itself: the lease's end must pass. Then a new client process
        # still finds every agent.
        time.sleep(max(0.0, started + 3 + 1 - time.monotonic()))
        done = subprocess.run(
            [sys.executable, "-m", "monarch_cli", "exec", "--state", str(state), "--", "echo", "still-here"],
            capture_output=True,
            text=True,
            timeout=120,
            env={**os.environ, "PYTHONPATH": REPO},
        )
        assert done.returncode == 0 and done.stdout.count("still-here") == 2, done.stdout + done.stderr
    finally:
        job.stop()
