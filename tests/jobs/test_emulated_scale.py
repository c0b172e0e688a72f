"""Hundreds of hosts, as the client sees them: 256 emulated agents (real sockets, real CURVE keys,
the real wire protocol; tests/emulated_cluster.py) driven by the unchanged client.

Correctness, not speed (benchmarks/scale.py times it): every rank's exit is collected, the
console groups what ranks print alike, the exit report groups ranks by outcome, a host that
goes silent is named, and the other ranks are stopped.
"""

from __future__ import annotations

import io
import json
import os
import re
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from monarch_cli.jobs import Job
from monarch_cli.jobs.errors import JobError
from monarch_cli.jobs.output_groups import outcome_summary
from monarch_cli.jobs.run_log import rank_log
from monarch_cli.jobs.spmd import SpmdRunner
from monarch_cli.runtime import protocol
from monarch_cli.runtime.errors import CallTimeout
from tests.emulated_cluster import EmulatedCluster, emulated_job

from ..conftest import wait_until

HOSTS = 256
NPROC = 2
WORLD = HOSTS * NPROC
GROUP = re.compile(rb"^\[rank ([0-9,-]+)\] (.*)$")
REPO = Path(__file__).resolve().parents[2]


def _ranks(spec: bytes) -> set[int]:
    out: set[int] = set()
    for part in spec.decode().split(","):
        a, _, b = part.partition("-")
        out.update(range(int(a), int(b or a) + 1))
    return out


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Job, EmulatedCluster, Path]]:
    state = tmp_path_factory.mktemp("emulated") / ".monarch" / "job_state.pkl"
    job, cl = emulated_job(HOSTS, state)
    yield job, cl, state
    cl.close()


def _run(job: Job, env: dict[str, str], **kw) -> tuple[object, bytes, bytes]:
    out, err = io.BytesIO(), io.BytesIO()
    result = job.run_spmd(
        ["torchrun", f"--nproc-per-node={NPROC}", "train.py"], env=env, stdout=out, stderr=err, sync=False, **kw
    )
    return result, out.getvalue(), err.getvalue()


def _hung_run(job: Job, **kw: Any) -> tuple[threading.Thread, dict[str, Any]]:
    """A run whose ranks all hang, on a thread (its result in ``box["run"]`` once it ends), once
    every rank is running."""
    box: dict[str, Any] = {}
    runner = threading.Thread(target=lambda: box.setdefault("run", _run(job, {"EMULATED_HANG": "1"}, **kw)))
    runner.start()
    deadline = time.monotonic() + 120
    while sum(h["ranks_running"] or 0 for h in job.status()["hosts"]) < WORLD:
        assert time.monotonic() < deadline, "the ranks never all started"
    return runner, box


def test_every_exit_is_collected_and_output_grouped(cluster: tuple[Job, EmulatedCluster, Path]) -> None:
    job, _, _ = cluster
    result, out, _ = _run(
        job, {"EMULATED_OUTPUT": "epoch 3 loss 2.31\nrank {rank} done\n", "EMULATED_EXIT": "17=SIGSEGV,302=SIGSEGV"}
    )
    assert sorted(r.rank for r in result.ranks) == list(range(WORLD))
    assert result.exit_code == 128 + 11
    assert result.first_failure is not None and result.first_failure.rank in (17, 302)
    assert outcome_summary(result.ranks) == f"{WORLD - 2:,} exited 0; ranks 17, 302: killed by SIGSEGV"
    shared: set[int] = set()
    own: dict[int, list[bytes]] = {}
    for line in out.splitlines():
        m = GROUP.match(line)
        if m and m.group(2) == b"epoch 3 loss 2.31":
            assert not shared & _ranks(m.group(1)), "a rank's line printed twice"
            shared |= _ranks(m.group(1))
        else:
            label, _, text = line.partition(b"]")
            own.setdefault(int(label.lstrip(b"[rank")), []).append(text.strip())
    assert shared == set(range(WORLD)), "every rank's shared line is accounted for"
    assert out.count(b"epoch 3 loss 2.31") < WORLD // 8, "the shared line is grouped, not printed per rank"
    assert own == {r: [f"rank {r} done".encode()] for r in range(WORLD)}  # distinct lines: each rank's own
    for r in (0, 17, WORLD - 1):  # and the logs keep everything, in order
        assert rank_log(result.log_dir, r).read_bytes() == f"epoch 3 loss 2.31\nrank {r} done\n".encode()


def test_grouping_off_and_ranks_filter(cluster: tuple[Job, EmulatedCluster, Path]) -> None:
    job, _, _ = cluster
    _, out, _ = _run(job, {"EMULATED_OUTPUT": "hello\n"}, group=False)
    assert out.count(b"hello") == WORLD and not any(GROUP.match(line) for line in out.splitlines())
    _, out, _ = _run(job, {"EMULATED_OUTPUT": "hello\n"}, ranks={0, 1, 2, 3})
    assert sorted(out.splitlines()) == sorted(f"[rank{r}]".encode().ljust(9) + b" hello" for r in range(4))


def test_the_cli_reports_outcomes_grouped_and_json_lists_every_rank(
    cluster: tuple[Job, EmulatedCluster, Path],
) -> None:
    _, _, state = cluster
    env = {**os.environ, "PYTHONPATH": str(REPO), "NO_COLOR": "1", "COLUMNS": "200"}
    base = [sys.executable, "-m", "monarch_cli", "run-spmd", "--state", str(state), "--no-sync"]
    flags = ["-e", "EMULATED_OUTPUT=step\n", "-e", "EMULATED_EXIT=5=3,9=3,400=SIGKILL"]
    command = ["--", "torchrun", f"--nproc-per-node={NPROC}", "train.py"]
    done = subprocess.run([*base, *flags, *command], capture_output=True, text=True, env=env, timeout=300)
    assert done.returncode in (3, 128 + 9), done.stderr  # whichever failure came first
    assert f"{WORLD - 3:,} exited 0; ranks 5, 9: exit 3; rank 400: killed by SIGKILL" in done.stderr
    assert done.stdout.count("step") < WORLD // 8
    rows = [line for line in done.stderr.splitlines() if re.match(r"^\W*(5|9|400)\W", line)]
    assert len(rows) == 2, done.stderr  # one row per distinct failure: rank 9 ended as rank 5 did
    done = subprocess.run([*base, "--json", *flags, *command], capture_output=True, text=True, env=env, timeout=300)
    report = json.loads(done.stdout)
    assert done.returncode in (3, 128 + 9) and len(report["ranks"]) == WORLD
    assert {r["rank"] for r in report["ranks"] if r["status"] != 0} == {5, 9, 400}


def test_a_silent_host_is_named_and_the_others_are_stopped(cluster: tuple[Job, EmulatedCluster, Path]) -> None:
    job, cl, _ = cluster
    cl.mute("emu100")  # answers requests, not heartbeats: as a host whose network went
    started = time.monotonic()
    try:
        result, _, _ = _run(job, {"EMULATED_HANG": "1"}, grace=1.0)
    finally:
        cl.mute("emu100", "unmute")
    assert time.monotonic() - started < 120
    lost = [r for r in result.ranks if r.lost]
    assert {r.rank for r in lost} == {200, 201}
    assert all("host emu100 stopped answering" in r.lost for r in lost)
    others = [r for r in result.ranks if not r.lost]
    assert len(others) == WORLD - 2 and all(r.how == "killed by SIGTERM" for r in others)


def test_questions_to_every_host_go_through_relays_and_come_back_to_the_right_host(
    cluster: tuple[Job, EmulatedCluster, Path],
) -> None:
    """256 hosts: `status` links 16 relays, each asks 15 others; every answer is its own host's."""
    job, _, state = cluster
    hs = job.hostset(require_all=False, questions_only=True)
    assert hs.through_relays
    assert [info["host"] for info in hs.infos] == [h.name for h in job.state.hosts]
    # A fresh client holds 16 connections, to the relays, not 256.
    probe = (
        "import sys, psutil; from monarch_cli.jobs import job_load; "
        "hs = job_load(sys.argv[1]).hostset(require_all=False, questions_only=True); "
        "ports = {c.raddr.port for c in psutil.Process().net_connections('tcp') if c.status == 'ESTABLISHED'}; "
        "print(len(ports), sum(i is not None for i in hs.infos))"
    )
    relays = {int(h.agent.rpartition(":")[2]) for h in job.state.hosts[::16]}
    assert _fresh_client(probe, state) == [str(len(relays)), str(HOSTS)] and len(relays) == 16
    done = subprocess.run(
        [sys.executable, "-m", "monarch_cli", "status", "--state", str(state), "--json"],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=REPO,
    )
    assert done.returncode == 0, done.stderr
    hosts = json.loads(done.stdout)["hosts"]
    assert [h["name"] for h in hosts if h["alive"]] == [f"emu{i}" for i in range(HOSTS)]


def test_a_run_reaches_every_host_through_the_relays(cluster: tuple[Job, EmulatedCluster, Path]) -> None:
    """A run of 256 hosts links the 16 relays, each forwarding its group's requests, heartbeats
    and events both ways (runtime/agent/forwarding.py): a fresh client holds 16 connections,
    and every rank's output and exit comes back."""
    _, _, state = cluster
    probe = (
        "import io, sys, psutil; from monarch_cli.jobs import job_load; job = job_load(sys.argv[1]); out = io.BytesIO(); "
        "r = job.run_spmd(['torchrun', '--nproc-per-node=2', 'train.py'], env={'EMULATED_OUTPUT': 'rank {rank} here\\n', "
        "'EMULATED_EXIT': '77=3'}, stdout=out, stderr=io.BytesIO(), sync=False); "
        "ports = {c.raddr.port for c in psutil.Process().net_connections('tcp') if c.status == 'ESTABLISHED'}; "
        "print(len(ports), len(r.ranks), r.exit_code, [x.rank for x in r.ranks if x.status], out.getvalue().count(b' here'))"
    )
    assert _fresh_client(probe, state) == ["16", str(WORLD), "3", "[77]", str(WORLD)]


def test_stop_tells_every_hosts_run_who_stopped_it_through_the_relays(
    cluster: tuple[Job, EmulatedCluster, Path],
) -> None:
    """Before the reservation goes, ``monarch stop`` tells each host's runs who stopped them, so
    they end saying so. From the relay threshold it goes as a run does: a connection per host
    (4,096 handshakes) had taken it past its 2 s at 4,096 hosts, and runs were left untold."""
    job, _, state = cluster
    runner, box = _hung_run(job)
    assert _fresh_client_connections("len(job._announce_stop('a test'))", state) == ["16", "1"]
    runner.join(120)  # (a run left hanging ends when the module's cluster closes)
    assert not runner.is_alive(), "the run did not end: a host was not told"
    result = box["run"][0]
    assert result.stopped_by.startswith("a test (pid ")
    assert len(result.ranks) == WORLD and {r.how for r in result.ranks} == {"reservation stopped"}
    # A real reservation goes next, its agents and ranks with it; these emulated ranks are ended
    # here, for the tests after this one.
    hs = job.hostset()
    ends = [
        hs.mb.request(h.agent, lambda cid: protocol.SignalRanks(cid, hs.mb.address, result.run_id, 9)) for h in hs.hosts
    ]
    for e in ends:
        e.get(timeout=60)
    assert sum(h["ranks_running"] or 0 for h in job.status()["hosts"]) == 0


def _fresh_client(code: str, state: Path) -> list[str]:
    """The words ``code`` prints, run as a fresh client process (``sys.argv[1]``: the state file)."""
    done = subprocess.run(
        [sys.executable, "-c", code, str(state)], capture_output=True, text=True, timeout=300, cwd=REPO
    )
    assert done.returncode == 0, done.stderr
    return done.stdout.split()


def _fresh_client_connections(expression: str, state: Path) -> list[str]:
    """In a fresh client (``job``: the reservation loaded there): the TCP connections it holds
    once ``expression`` is evaluated, then the words of what it evaluated to (a tuple's items)."""
    code = (
        "import sys, psutil; from monarch_cli.jobs import job_load; job = job_load(sys.argv[1]); "
        f"said = {expression}; "
        "ports = {c.raddr.port for c in psutil.Process().net_connections('tcp') if c.status == 'ESTABLISHED'}; "
        "print(len(ports), *(said if isinstance(said, tuple) else (said,)))"
    )
    return _fresh_client(code, state)


def test_a_relay_lost_in_a_run_is_named_and_its_hosts_are_stopped_directly(
    cluster: tuple[Job, EmulatedCluster, Path],
) -> None:
    """emu16 relays for emu17-emu31; frozen mid-run, it is the host named lost (not the hosts it
    carried), and the ranks of every other host, those it carried included, are stopped."""
    job, cl, _ = cluster
    runner, box = _hung_run(job, grace=1.0)
    try:
        cl.mute("emu16", "freeze")
        runner.join(120)
        assert not runner.is_alive(), "the run did not end"
    finally:
        cl.mute("emu16", "unmute")
    result = box["run"][0]
    lost = [r for r in result.ranks if r.lost]
    assert {r.rank for r in lost} == {32, 33} and all("host emu16 stopped answering" in r.lost for r in lost)
    others = [r for r in result.ranks if not r.lost]
    assert len(others) == WORLD - 2 and all(r.how == "killed by SIGTERM" for r in others)


def test_a_relay_lost_as_the_run_starts_fails_the_start_naming_it(
    cluster: tuple[Job, EmulatedCluster, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    """emu16 answers the run's ping and goes silent before the ranks are sent: the requests it
    was to carry (emu17-emu31's ranks) fail once it is named lost, and the run says which host
    it was at once, not after the 30 s a start may take."""
    job, cl, _ = cluster
    start = SpmdRunner._start

    def frozen_then_start(self: SpmdRunner, *args: Any) -> Any:
        cl.mute("emu16", "freeze")
        relay = self.hs.hosts[16].agent
        # (the emulator reads the line on its own time: wait until emu16 stops answering)
        assert wait_until(lambda: _silent(self.mb, relay), 60), "emu16 did not freeze"
        return start(self, *args)

    monkeypatch.setattr(SpmdRunner, "_start", frozen_then_start)
    started = time.monotonic()
    try:
        with pytest.raises(JobError, match="host emu16, which relayed the others' requests, stopped answering"):
            _run(job, {})
    finally:
        cl.mute("emu16", "unmute")
    assert time.monotonic() - started < 25


def _silent(mb: Any, agent: str) -> bool:
    try:
        mb.request(agent, lambda cid: protocol.Ping(cid, mb.address)).get(timeout=0.5)
    except CallTimeout:
        return True
    return False


@pytest.mark.parametrize("frozen", ["emu16", "emu17"])  # a relay; a host a relay asks
def test_a_host_that_answers_nothing_is_the_only_one_missing(
    cluster: tuple[Job, EmulatedCluster, Path], frozen: str
) -> None:
    job, cl, state = cluster
    cl.mute(frozen, "freeze")
    try:
        deadline = time.monotonic() + 120
        while True:
            dead = [h["name"] for h in job.status()["hosts"] if not h["alive"]]
            if dead:
                break
            assert time.monotonic() < deadline, f"{frozen} kept answering"
        # A frozen relay's hosts were asked directly: only the frozen host is missing.
        assert dead == [frozen]
        if frozen == "emu17":
            # 256 rows are a screen nobody reads: the first hosts, every one that does not answer,
            # then a line for the rest.
            text = _cli("status", "--state", str(state))
            rows = [w[0] for w in map(str.split, text.splitlines()) if w and re.fullmatch(r"emu\d+", w[0])]
            assert rows == [f"emu{i}" for i in range(16)] + [frozen], text
            assert f"… and {HOSTS - 17:,} more hosts, all answering" in text
            every = _cli("status", "--state", str(state), "--all")
            assert sum(bool(re.match(r"\s*emu\d+\s", line)) for line in every.splitlines()) == HOSTS
    finally:
        cl.mute(frozen, "unmute")
    deadline = time.monotonic() + 120
    while not all(h["alive"] for h in job.status()["hosts"]):
        assert time.monotonic() < deadline, f"{frozen} did not answer again"


def _cli(*args: str) -> str:
    """A `monarch` command's output (its exit status says whether every host answered: not checked)."""
    done = subprocess.run(
        [sys.executable, "-m", "monarch_cli", *args],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=REPO,
        env={**os.environ, "NO_COLOR": "1", "COLUMNS": "200"},
    )
    assert "Traceback" not in done.stderr, done.stderr
    return done.stdout


def test_stack_and_diagnose_on_every_host_group_what_is_the_same(cluster: tuple[Job, EmulatedCluster, Path]) -> None:
    """Both from a fresh client, through the relays: `diagnose`'s probe of the hosts' network
    (a question that differs from host to host) too, so the client holds 16 connections, not 256."""
    job, _, state = cluster
    runner, box = _hung_run(job)
    report = job.stacks()
    assert len(report.stacks) == WORLD and len(report.groups) == 1
    said = _fresh_client_connections(
        "(d := job.diagnose()).exit_code, d.summary.split(' rank(s) alive, all at ')[0]", state
    )
    assert said == ["16", "0", str(WORLD)]  # healthy: every rank at one stack
    job.stop()  # the running run ends saying so
    runner.join(120)
    result = box["run"][0]
    assert result.exit_code == 254 and len(result.ranks) == WORLD


def test_partition_probes_stay_few_per_host_and_still_cross_every_split() -> None:
    """At thousands of hosts each agent probes ~log2(N) peers, not all N-1 (16.7 M connections
    every few seconds at 4,096), and a split of the hosts into two sides is still probed across."""
    import random

    from monarch_cli.jobs.partition import ALL_PAIRS_UP_TO, probe_targets

    small = ALL_PAIRS_UP_TO
    assert all(sorted(probe_targets(i, small)) == [j for j in range(small) if j != i] for i in range(small))
    n = 4096
    targets = [probe_targets(i, n) for i in range(n)]
    assert max(len(t) for t in targets) == 12 and all(i not in t for i, t in enumerate(targets))
    rng = random.Random(23)
    for size in (1, 2, 7, 100, 2048):  # a lone host cut off, a rack, half the cluster
        side = set(rng.sample(range(n), size))
        assert any((i in side) != (j in side) for i in range(n) for j in targets[i])
