"""A partition between two hosts mid-run (iptables in the hosts' namespaces drops h1 <-> h2):
the run ends naming the pair, and `monarch diagnose` says suspect. The client reaches both
hosts all along, so every agent keeps answering: only the hosts' probe of each other shows it."""

from __future__ import annotations

import io
import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from monarch_cli.jobs import Job, serve

from .conftest import SshHosts

pytestmark = [pytest.mark.slow, pytest.mark.ssh]

REPO = str(Path(__file__).resolve().parents[2])
PYTHON = f"env PYTHONPATH={REPO} {os.path.realpath(sys.executable)}"

STEPS = """\
import time, torch, torch.distributed as dist
dist.init_process_group("gloo")
t = torch.ones(1)
for step in range(100_000):
    dist.all_reduce(t)
    print("step", step, flush=True)
    time.sleep(0.1)
"""


@pytest.fixture(scope="module")
def iptables() -> str:
    if shutil.which("iptables") is None:
        subprocess.run(["apt-get", "update"], capture_output=True)
        subprocess.run(["apt-get", "install", "-y", "iptables"], check=True, capture_output=True)
    return shutil.which("iptables") or "iptables"


@pytest.fixture(scope="module")
def ssh_job(ssh_hosts: SshHosts, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Job, Path]]:
    base = tmp_path_factory.mktemp("partition")
    config = base / "ssh_config"
    config.write_text(
        "".join(
            f"Host h{i}\n  HostName {h.address}\n  User root\n  IdentityFile {ssh_hosts.client_key}\n"
            f"  UserKnownHostsFile {ssh_hosts.known_hosts}\n  StrictHostKeyChecking yes\n"
            for i, h in enumerate(ssh_hosts.hosts, 1)
        )
    )
    ws = base / "ws"
    ws.mkdir()
    job = serve(
        None, "ssh", state=ws / ".monarch" / "job_state.pkl", hosts="h1,h2", ssh_config=str(config), python=PYTHON
    )
    yield job, ws
    job.stop()


def _rules(iptables: str, hosts: SshHosts, action: str) -> None:
    """Drop (-I) or restore (-D) all traffic between h1 and h2, inside each one's namespace."""
    h1, h2 = hosts.hosts[0], hosts.hosts[1]
    for me, other in ((h1, h2), (h2, h1)):
        for chain, flag in (("INPUT", "-s"), ("OUTPUT", "-d")):
            subprocess.run(
                ["ip", "netns", "exec", me.name, iptables, action, chain, flag, other.address, "-j", "DROP"],
                check=action == "-I",
                capture_output=True,
            )


def test_a_partition_between_hosts_ends_the_run_naming_the_pair(
    ssh_job: tuple[Job, Path], ssh_hosts: SshHosts, iptables: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    job, ws = ssh_job
    (ws / "steps.py").write_text(STEPS)
    monkeypatch.chdir(ws)
    cut = threading.Event()

    class CutWhenStepping(io.BytesIO):
        """The console: once both ranks have done a few steps, h1 <-> h2 traffic is dropped."""

        def write(self, data: bytes) -> int:  # type: ignore[override]
            n = super().write(data)
            if self.getvalue().count(b"step 3\n") >= 2 and not cut.is_set():
                cut.set()
                _rules(iptables, ssh_hosts, "-I")
            return n

    out, notices = CutWhenStepping(), []
    started = time.monotonic()
    try:
        result = job.run_spmd(
            ["torchrun", "--nproc-per-node=1", "steps.py"],
            stdout=out,
            stderr=out,
            on_event=notices.append,
            env={"GLOO_SOCKET_IFNAME": "eth0"},
        )
    finally:
        _rules(iptables, ssh_hosts, "-D")
    took = time.monotonic() - started
    assert cut.is_set(), out.getvalue()[-2000:]
    said = [n for n in notices if n.startswith("network partition: ")]
    assert said and ("h1 cannot reach h2" in said[0] or "h2 cannot reach h1" in said[0]), notices
    assert result.exit_code != 0 and "network partition" in result.ending, result
    assert took < 120, f"the partition took {took:.0f} s to end the run"
    diagnosis = job.diagnose()
    assert diagnosis.verdict == "suspect" and diagnosis.exit_code == 1 and "network partition" in diagnosis.summary


def test_one_ctrl_c_during_a_partition_stops_every_rank(
    ssh_job: tuple[Job, Path], ssh_hosts: SshHosts, iptables: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """No probe round comes on its own here (a long interval): the Ctrl-C asks at once, and the
    ranks, stuck in a collective where SIGINT does nothing, are ended within seconds."""
    job, ws = ssh_job
    (ws / "steps.py").write_text(STEPS)
    monkeypatch.chdir(ws)
    monkeypatch.setenv("MONARCH_PARTITION_PROBE_INTERVAL", "3600")
    pressed: list[float] = []

    def ctrl_c() -> None:
        pressed.append(time.monotonic())
        os.kill(os.getpid(), signal.SIGINT)

    class CutWhenStepping(io.BytesIO):
        def write(self, data: bytes) -> int:  # type: ignore[override]
            n = super().write(data)
            if self.getvalue().count(b"step 3\n") >= 2 and not pressed and not timers:
                _rules(iptables, ssh_hosts, "-I")
                timers.append(threading.Timer(3.0, ctrl_c))  # the collectives are stuck by then
                timers[0].start()
            return n

    timers: list[threading.Timer] = []
    out, notices = CutWhenStepping(), []
    try:
        result = job.run_spmd(
            ["torchrun", "--nproc-per-node=1", "steps.py"],
            stdout=out,
            stderr=out,
            on_event=notices.append,
            env={"GLOO_SOCKET_IFNAME": "eth0"},
        )
        ended = time.monotonic()
    finally:
        _rules(iptables, ssh_hosts, "-D")
        for t in timers:
            t.cancel()
    assert pressed, out.getvalue()[-2000:]
    assert any(n.startswith("network partition: ") for n in notices), notices
    assert result.exit_code != 0 and result.interrupted
    assert ended - pressed[0] < 15, f"one Ctrl-C took {ended - pressed[0]:.1f} s to stop the ranks"
    print(f"one Ctrl-C stopped the ranks in {ended - pressed[0]:.1f} s")


FEW_STEPS = STEPS.replace("range(100_000)", "range(40)")


def test_diagnose_probes_the_hosts_of_a_live_run_before_its_client_has_noticed(
    ssh_job: tuple[Job, Path], ssh_hosts: SshHosts, iptables: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The run's own client probes only every hour here: `monarch diagnose` from another terminal
    probes the hosts itself and names the partition while the run hangs."""
    from monarch_cli.jobs import job_load

    job, ws = ssh_job
    (ws / "few.py").write_text(FEW_STEPS)
    monkeypatch.chdir(ws)
    monkeypatch.setenv("MONARCH_PARTITION_PROBE_INTERVAL", "3600")
    cut = threading.Event()

    class CutWhenStepping(io.BytesIO):
        def write(self, data: bytes) -> int:  # type: ignore[override]
            n = super().write(data)
            if self.getvalue().count(b"step 3\n") >= 2 and not cut.is_set():
                _rules(iptables, ssh_hosts, "-I")
                cut.set()
            return n

    out = CutWhenStepping()
    results: list = []
    runner = threading.Thread(
        target=lambda: results.append(
            job.run_spmd(
                ["torchrun", "--nproc-per-node=1", "few.py"], stdout=out, stderr=out, env={"GLOO_SOCKET_IFNAME": "eth0"}
            )
        ),
        daemon=True,
    )
    runner.start()
    try:
        assert cut.wait(120), out.getvalue()[-2000:]
        diagnosis = job_load(job.path).diagnose()  # as from another terminal
        assert diagnosis.verdict == "suspect" and diagnosis.exit_code == 1, diagnosis
        assert diagnosis.summary.startswith("network partition: "), diagnosis.summary
        assert "h1 cannot reach h2" in diagnosis.summary or "h2 cannot reach h1" in diagnosis.summary
        # As at thousands of hosts, where h1 relays for h2 (relays from 2 hosts here): its relay
        # cannot reach h2 but the client can, so h2 is asked straight, not called gone, and
        # the same partition is named.
        relayed = subprocess.run(
            [
                sys.executable,
                "-c",
                "import json, sys; from monarch_cli.config import configure; configure(relay_from_hosts=2); "
                "from monarch_cli.jobs import job_load; j = job_load(sys.argv[1]); "
                "s = j.status(); d = j.diagnose(); "
                "print(json.dumps([[h['alive'] for h in s['hosts']], d.verdict, d.summary]))",
                str(job.path),
            ],
            capture_output=True,
            text=True,
            timeout=120,
            env={**os.environ, "PYTHONPATH": REPO},
        )
        assert relayed.returncode == 0, relayed.stderr[-2000:]
        alive, verdict, summary = json.loads(relayed.stdout.splitlines()[-1])
        assert alive == [True, True] and verdict == "suspect", relayed.stdout
        assert summary.startswith("network partition: h1 cannot reach h2"), summary
    finally:
        _rules(iptables, ssh_hosts, "-D")  # the collectives resume; the run finishes its few steps
    runner.join(timeout=180)
    assert results and results[0].exit_code == 0, out.getvalue()[-2000:]
