"""The ssh backend on real sshd hosts: serve, sync, a 2-host gloo run, stop, and refusals."""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import paramiko
import pytest

from monarch_cli.errors import MonarchError, SchedulerError
from monarch_cli.jobs import Job, JobError, dryrun, job_load, serve
from monarch_cli.runtime.launch.command import is_agent_command

from .conftest import SshHosts

pytestmark = [pytest.mark.slow, pytest.mark.ssh]
REPO = str(Path(__file__).resolve().parents[2])
# The hosts see this checkout (only /root and /tmp are private there): run this code, not an installed copy.
PYTHON = f"env PYTHONPATH={REPO} {os.path.realpath(sys.executable)}"

ALLREDUCE = """\
import os, torch, torch.distributed as dist
dist.init_process_group("gloo")
t = torch.ones(1) * (dist.get_rank() + 1)
dist.all_reduce(t)
print("sum", int(t.item()), "cwd", os.getcwd(), "data", open("data.txt").read(), "gone", os.path.exists("old.py"))
dist.destroy_process_group()
"""


def _ssh_config(hosts: SshHosts, path: Path, known_hosts: Path) -> Path:
    path.write_text(
        "".join(
            f"Host h{i}\n  HostName {h.address}\n  User root\n  IdentityFile {hosts.client_key}\n"
            f"  UserKnownHostsFile {known_hosts}\n  StrictHostKeyChecking yes\n"
            for i, h in enumerate(hosts.hosts, 1)
        )
    )
    return path


def _on_host(hosts: SshHosts, i: int, command: str) -> tuple[int, str]:
    client = paramiko.SSHClient()
    client.load_host_keys(str(hosts.known_hosts))
    client.connect(
        hosts.hosts[i].address,
        username="root",
        key_filename=str(hosts.client_key),
        look_for_keys=False,
        allow_agent=False,
        timeout=10,
    )
    try:
        _, out, err = client.exec_command(command, timeout=30)
        text = out.read().decode() + err.read().decode()
        return out.channel.recv_exit_status(), text
    finally:
        client.close()


def _is_agent(text: str) -> bool:
    """Whether ``text`` (one "<namespace> <pid>: <command line>", or every process's command lines, one
    per line) shows a host agent, not only its fork server."""
    lines = [line.partition(": ")[2] if ": " in line.split(" -")[0] else line for line in text.splitlines()]
    return any(is_agent_command(line) or "monarch agent " in line for line in lines)


def _netns_processes(hosts: SshHosts) -> list[str]:
    """Every process in the hosts' namespaces but their sshd listeners."""
    left = []
    for h in hosts.hosts:
        for pid in subprocess.run(["ip", "netns", "pids", h.name], capture_output=True, text=True).stdout.split():
            try:
                cmd = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
            except OSError:
                continue
            if "sshd" not in cmd:
                left.append(f"{h.name} {pid}: {cmd}")
    return left


@pytest.fixture(scope="module")
def ssh_job(ssh_hosts: SshHosts, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Job, Path, Path]]:
    base = tmp_path_factory.mktemp("sshjob")
    config = _ssh_config(ssh_hosts, base / "ssh_config", ssh_hosts.known_hosts)
    ws = base / "ws"
    ws.mkdir()
    job = serve(
        None, "ssh", state=ws / ".monarch" / "job_state.pkl", hosts="h1,h2", ssh_config=str(config), python=PYTHON
    )
    yield job, ws, config
    job.stop()


def test_dry_run_shows_targets_and_redacts_keys(ssh_hosts: SshHosts, tmp_path: Path) -> None:
    config = _ssh_config(ssh_hosts, tmp_path / "ssh_config", ssh_hosts.known_hosts)
    plan = dryrun(None, "ssh", hosts="h1,h2", ssh_config=str(config), python=PYTHON)
    text = plan.render()
    for h in ssh_hosts.hosts:
        assert f"root@{h.address}:22" in text
    assert "<redacted>" in text and "PRIVATE" not in text and "MONARCH_KEYS" not in text
    assert text.count("upload over SFTP:") == 2 and text.count("nohup setsid") == 2, text
    with pytest.raises(MonarchError, match="takes a number of hosts, not names"):
        dryrun(None, "local", hosts="h1,h2")


def test_serve_keys_sync_and_a_two_host_gloo_run(
    ssh_job: tuple[Job, Path, Path], ssh_hosts: SshHosts, monkeypatch: pytest.MonkeyPatch
) -> None:
    job, ws, _ = ssh_job
    secret = job.state.keys.split()[-1] if " " in job.state.keys else job.state.keys
    for i, rec in enumerate(job.state.scheduler_data["ssh_hosts"]):
        code, text = _on_host(ssh_hosts, i, f"stat -c '%a' {rec['directory']} {rec['directory']}/keys")
        assert text.split() == ["700", "600"], text
        code, text = _on_host(
            ssh_hosts,
            i,
            f"cat /proc/[0-9]*/cmdline 2>/dev/null | tr '\\0' ' '; cat /proc/{rec['pid']}/environ | tr '\\0' '\\n'",
        )
        assert code == 0 and _is_agent(text) and secret not in text
    (ws / "train.py").write_text(ALLREDUCE)
    (ws / "data.txt").write_text("v1")
    (ws / "old.py").write_text("")
    monkeypatch.chdir(ws)
    out = io.BytesIO()
    notices: list[str] = []
    # the hosts share this machine's hostname, which resolves to a loopback address: name gloo's interface
    gloo = {"GLOO_SOCKET_IFNAME": "eth0"}
    result = job.run_spmd(
        ["torchrun", "--nproc-per-node=1", "train.py"], stdout=out, stderr=out, on_event=notices.append, env=gloo
    )
    text = out.getvalue().decode()
    assert result.exit_code == 0, text
    assert any(n.startswith("synced 3 files") and "to 2 hosts" in n for n in notices), notices
    lines = [line for line in text.splitlines() if " sum " in line]
    assert len(lines) == 2 and all("sum 3 " in line and "data v1 gone True" in line for line in lines), text
    assert str(ws) not in text  # the ranks ran in the hosts' mirrors, not at the client's path
    (ws / "data.txt").write_text("v2")  # an edit and a deletion reach both hosts before the next run
    (ws / "old.py").unlink()
    out = io.BytesIO()
    result = job.run_spmd(["torchrun", "--nproc-per-node=1", "train.py"], stdout=out, stderr=out, env=gloo)
    text = out.getvalue().decode()
    assert result.exit_code == 0 and text.count("data v2 gone False") == 2, text
    out = io.BytesIO()
    result = job.exec("cat data.txt; echo; hostname -I", stdout=out, stderr=out)  # in each host's mirror
    text = out.getvalue().decode()
    assert result.exit_code == 0 and text.count("v2") == 2, text
    assert all(h.address in text for h in ssh_hosts.hosts), text


class _SshConnections:
    """Counts new TCP connections to the hosts' sshd (port 22), with an iptables rule in this
    namespace's OUTPUT chain: what the client really opens, not what the code says it does."""

    def __init__(self, hosts: SshHosts) -> None:
        self.rules = [
            [
                "OUTPUT",
                "-p",
                "tcp",
                "-d",
                h.address,
                "--dport",
                "22",
                "--syn",
                "-m",
                "comment",
                "--comment",
                "mssh-count",
            ]
            for h in hosts.hosts
        ]

    def __enter__(self) -> _SshConnections:
        for rule in self.rules:
            subprocess.run(["iptables", "-I", *rule, "-j", "ACCEPT"], check=True)
        return self

    def count(self) -> int:
        listing = subprocess.run(
            ["iptables", "-L", "OUTPUT", "-v", "-x", "-n"], capture_output=True, text=True, check=True
        )
        return sum(int(line.split()[0]) for line in listing.stdout.splitlines() if "mssh-count" in line)

    def __exit__(self, *_: object) -> None:
        for rule in self.rules:
            subprocess.run(["iptables", "-D", *rule, "-j", "ACCEPT"], check=False)


def test_a_warm_re_run_opens_no_ssh_connection(ssh_job: tuple[Job, Path, Path], ssh_hosts: SshHosts) -> None:
    """A re-run asks the agents first; the hosts' sshd is asked only when an agent does not answer
    (before, every run probed every host over a new SSH connection)."""
    job, ws, _ = ssh_job
    (ws / "hello.py").write_text("print('hello', flush=True)\n")
    run = ["run-spmd", "--state", str(job.path), "--", "torchrun", "--nproc-per-node=1", "hello.py"]
    first = _monarch(*run, cwd=ws)
    assert first.returncode == 0, first.stderr
    with _SshConnections(ssh_hosts) as ssh:
        again = _monarch(*run, cwd=ws)
        assert again.returncode == 0, again.stderr
        assert again.stdout.count("hello") == 2, again.stdout
        assert ssh.count() == 0, f"a healthy re-run opened {ssh.count()} SSH connection(s)"


def _monarch(*args: str, cwd: Path | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "monarch_cli", *args],
        capture_output=True,
        text=True,
        timeout=180,
        env={**os.environ, "PYTHONPATH": REPO},
        cwd=cwd,
    )


def _ppid(pid: int) -> int:
    try:
        with open(f"/proc/{pid}/status") as f:
            return next(int(line.split()[1]) for line in f if line.startswith("PPid:"))
    except (OSError, StopIteration, ValueError):
        return 0


def _outside(lines: list[str], agents: set[int]) -> set[str]:
    """``lines`` (from :func:`_netns_processes`) but those of processes under one of ``agents``:
    another reservation's agent keeps forking and retiring its warm processes meanwhile."""

    def under(pid: int) -> bool:
        while pid > 1:
            if pid in agents:
                return True
            pid = _ppid(pid)
        return False

    return {line for line in lines if not under(int(line.split()[1].rstrip(":")))}


def test_reserve_from_a_printed_plan_and_stop_leaves_nothing(ssh_hosts: SshHosts, tmp_path: Path) -> None:
    config = _ssh_config(ssh_hosts, tmp_path / "ssh_config", ssh_hosts.known_hosts)
    state = str(tmp_path / ".monarch" / "job_state.pkl")
    listed = _netns_processes(ssh_hosts)
    others = {int(line.split()[1].rstrip(":")) for line in listed if _is_agent(line)}  # the module's reservation
    before = _outside(listed, others)
    printed = _monarch(
        "serve",
        "--scheduler",
        "ssh",
        "--hosts",
        "h1,h2",
        "--ssh-config",
        str(config),
        "-o",
        f"python={PYTHON}",
        "--remote-dir",
        "/root/stoptest",
        "--state",
        state,
        "--dry-run",
        "--json",
    )
    assert printed.returncode == 0, printed.stderr
    plan = json.loads(printed.stdout)
    assert [h["target"]["alias"] for h in plan["data"]["hosts"]] == ["h1", "h2"]
    assert not _outside(_netns_processes(ssh_hosts), others) - before  # a dry run starts nothing
    (tmp_path / "plan.json").write_text(printed.stdout)
    served = _monarch("serve", "--plan", str(tmp_path / "plan.json"), "--state", state, "--json")
    assert served.returncode == 0, served.stderr
    job = job_load(state)
    assert job.state.reservation_id == plan["reservation_id"]
    for i, rec in enumerate(job.state.scheduler_data["ssh_hosts"]):  # exactly the plan's command ran there
        assert rec["directory"] == f"/root/stoptest/{plan['reservation_id']}"
        assert _on_host(ssh_hosts, i, f"cat /proc/{rec['pid']}/cmdline | tr '\\0' ' '")[1].startswith(
            f"monarch agent {plan['reservation_id']} host h{i + 1}"
        )
    status = _monarch("status", "--state", state)
    assert status.returncode == 0 and "h2: root@" in status.stdout + status.stderr, status.stdout + status.stderr
    started = _outside(_netns_processes(ssh_hosts), others) - before
    assert sum(_is_agent(p) for p in started) == 2, started
    assert len(started) > 2, started  # and what they started (their warm processes)
    stopped = _monarch("stop", "--state", state)
    assert stopped.returncode == 0, stopped.stderr
    assert not _outside(_netns_processes(ssh_hosts), others) - before  # the agents and everything they started
    for i in range(2):
        # only the shipped code and wheels stay, content-addressed, for the next serve to reuse
        assert _on_host(ssh_hosts, i, "ls -A /root/stoptest")[1].split() == ["bundles"]


def test_unknown_and_changed_host_keys_are_refused(ssh_hosts: SshHosts, tmp_path: Path) -> None:
    empty = tmp_path / "known_empty"
    config = _ssh_config(ssh_hosts, tmp_path / "cfg_unknown", empty)
    with pytest.raises(SchedulerError, match=r"host h1 .*unknown host key.*--accept-new-host-keys"):
        serve(None, "ssh", hosts="h1", state=tmp_path / "a" / "s.pkl", ssh_config=str(config), python=PYTHON)
    # a changed key: h2's recorded key is h1's
    lines = ssh_hosts.known_hosts.read_text().splitlines()
    forged = tmp_path / "known_forged"
    forged.write_text(lines[0] + "\n" + lines[1].split()[0] + " " + " ".join(lines[0].split()[1:]) + "\n")
    config = _ssh_config(ssh_hosts, tmp_path / "cfg_forged", forged)
    before = set(_netns_processes(ssh_hosts))
    with pytest.raises(SchedulerError, match=r"host h2 .*CHANGED") as e:
        serve(
            None,
            "ssh",
            hosts="h1,h2",
            state=tmp_path / "b" / "s.pkl",
            ssh_config=str(config),
            python=PYTHON,
            accept_new_host_keys=True,
        )  # never accepts a changed key
    assert "\n" not in str(e.value)
    assert not set(_netns_processes(ssh_hosts)) - before  # h1's agent was undone
    # accept-new records an unknown key
    config = _ssh_config(ssh_hosts, tmp_path / "cfg_new", empty)
    from monarch_cli.schedulers.ssh import connect, resolve

    connect(resolve("h1", {"ssh_config": str(config)}), accept_new=True).close()
    assert ssh_hosts.hosts[0].host_key_line.split()[2] in empty.read_text()


def test_wrong_python_is_one_line_naming_the_host(ssh_hosts: SshHosts, tmp_path: Path) -> None:
    config = _ssh_config(ssh_hosts, tmp_path / "ssh_config", ssh_hosts.known_hosts)
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "monarch_cli",
            "serve",
            "--scheduler",
            "ssh",
            "--hosts",
            "h1",
            "--ssh-config",
            str(config),
            "--python",
            "/usr/bin/python3-nope",
            "--state",
            str(tmp_path / "s.pkl"),
        ],
        capture_output=True,
        text=True,
    )
    assert proc.returncode != 0
    assert "host h1 (10.214.0.11:22): --python /usr/bin/python3-nope does not run there" in proc.stderr
    assert "pip install" not in proc.stderr
    assert "Traceback" not in proc.stderr


def test_a_host_whose_link_goes_down_is_reported_by_name_and_stop_still_works(
    ssh_job: tuple[Job, Path, Path], ssh_hosts: SshHosts, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Runs last in this module: it breaks the module's reservation."""
    job, ws, _ = ssh_job
    monkeypatch.chdir(ws)
    (ws / "sleepy.py").write_text("import time\nprint('up', flush=True)\ntime.sleep(60)\n")
    link = f"mssh-v{2}"
    cut = threading.Event()

    class CutWhenUp(io.BytesIO):
        """The console: once every rank is up (the run is under way), h2's link goes down."""

        def write(self, data: bytes) -> int:  # type: ignore[override]
            n = super().write(data)
            if self.getvalue().count(b"up") >= 2 and not cut.is_set():
                cut.set()
                subprocess.run(["ip", "link", "set", link, "down"], check=True)
            return n

    out = CutWhenUp()
    try:
        result = job.run_spmd(["torchrun", "--nproc-per-node=1", "sleepy.py"], stdout=out, stderr=out, grace=1.0)
    finally:
        subprocess.run(["ip", "link", "set", link, "master", "mssh-br0", "up"])
    assert cut.is_set(), out.getvalue()
    lost = [r for r in result.ranks if r.lost]
    assert result.exit_code != 0 and result.duration < 30, out.getvalue()
    assert [r.host for r in lost] == ["h2"] and "host h2 stopped answering" in lost[0].how
    rec = job.state.scheduler_data["ssh_hosts"][1]
    assert _on_host(ssh_hosts, 1, f"kill -KILL {rec['pid']}")[0] == 0  # now the agent itself dies
    with pytest.raises(JobError, match="gone .*the agent process on h2 is not running"):  # the probe, over SSH
        job.run_spmd(["torchrun", "--nproc-per-node=1", "sleepy.py"])


def test_proxy_jump_and_unreachable_host(ssh_hosts: SshHosts, tmp_path: Path) -> None:
    from monarch_cli.schedulers.ssh import connect, resolve

    config = _ssh_config(ssh_hosts, tmp_path / "ssh_config", ssh_hosts.known_hosts)
    h2 = ssh_hosts.hosts[1]
    config.write_text(
        config.read_text() + f"Host via1\n  HostName {h2.address}\n  ProxyJump h1\n  User root\n"
        f"  IdentityFile {ssh_hosts.client_key}\n  UserKnownHostsFile {ssh_hosts.known_hosts}\n"
        "Host nowhere\n  HostName 10.214.0.99\n  ConnectTimeout 1\n"
    )
    target = resolve("via1", {"ssh_config": str(config)})
    assert (target.hostname, target.proxy_jump) == (h2.address, "h1")
    client = connect(target, accept_new=False)
    try:
        _, out, _ = client.exec_command("ip -4 -o addr show dev eth0")
        assert h2.address in out.read().decode()
        # the jump host opened the connection: h2 saw it come from h1's address
        _, out, _ = client.exec_command("echo $SSH_CONNECTION")
        assert out.read().decode().split()[0] == ssh_hosts.hosts[0].address
    finally:
        client.close()
    with pytest.raises(SchedulerError, match=r"^host nowhere \(10\.214\.0\.99:22\) is unreachable"):
        connect(resolve("nowhere", {"ssh_config": str(config)}), accept_new=False, timeout=2)
