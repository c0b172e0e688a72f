"""Questions and runs through relays, on real agents (jobs/fanout.py, runtime/agent/relay.py and forwarding.py).

The threshold is lowered to 2 hosts so that three local agents relay as thousands would: host 0
asks host 1 for the client, host 2 answers for itself. tests/jobs/test_emulated_scale.py covers
256 emulated hosts, a relay that answers nothing and the connections a client holds.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from monarch_cli.config import configure, settings
from monarch_cli.jobs import Job, serve
from monarch_cli.jobs.fanout import relay_groups
from monarch_cli.runtime import protocol
from monarch_cli.runtime.errors import ActorError

from ..conftest import wait_until, write_script
from .conftest import spmd


@pytest.fixture(scope="module")
def relayed(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Job, list[str]]]:
    before = settings().relay_from_hosts
    configure(relay_from_hosts=2)
    said: list[str] = []
    root = tmp_path_factory.mktemp("relays")
    cache = os.environ.get("MONARCH_CACHE_DIR")
    os.environ["MONARCH_CACHE_DIR"] = str(root / "cache")  # the agents learn nothing from other tests' runs
    job = serve(None, hosts=3, state=root / ".monarch" / "job_state.pkl", preload="", progress=said.append)
    try:
        yield job, said
    finally:
        job.stop()
        configure(relay_from_hosts=before)
        if cache is None:
            os.environ.pop("MONARCH_CACHE_DIR", None)
        else:
            os.environ["MONARCH_CACHE_DIR"] = cache


def test_groups_cover_every_host_once() -> None:
    for n in (1, 2, 3, 10, 256, 1000, 4096):
        groups = relay_groups(n)
        seen = [i for relay, members in groups for i in (relay, *members)]
        assert seen == list(range(n))
        assert len(groups) <= int(n**0.5) + 1 and all(len(m) < len(groups) + 1 for _, m in groups)


def test_status_goes_through_a_relay_and_each_answer_is_its_own_hosts(relayed: tuple[Job, list[str]]) -> None:
    job, said = relayed
    assert "checking 3 hosts through their relays" in said  # serve warmed the relays' connections
    hs = job.hostset(require_all=False, questions_only=True)
    assert hs.through_relays
    assert [(info["host"], info["pid"]) for info in hs.infos] == [(h.name, h.pid) for h in job.state.hosts]
    status = job.status()
    assert status["alive"] and [h["name"] for h in status["hosts"] if h["alive"]] == ["local0", "local1", "local2"]
    assert status["relays"] == 2  # (3 hosts, ⌈√3⌉ = 2 to a group: local0 and local2 pass it on)
    forgotten = job.forget_preload()  # each host answers for itself, through the relay or not
    assert sorted(forgotten) == ["local0", "local1", "local2"] and all(isinstance(n, int) for n in forgotten.values())
    assert job.forget_preload() == {"local0": 0, "local1": 0, "local2": 0}  # nothing left to forget


def test_stacks_of_every_rank_come_through_the_relay(relayed: tuple[Job, list[str]], tmp_path: Path) -> None:
    job, _ = relayed
    flag = tmp_path / "go"
    script = write_script(
        tmp_path,
        "waits.py",
        f"import os, time\ndef waiting_for_the_flag():\n    while not os.path.exists({str(flag)!r}):\n"
        "        time.sleep(0.02)\nwaiting_for_the_flag()\n",
    )
    box: dict[str, object] = {}
    runner = threading.Thread(target=lambda: box.setdefault("run", spmd(job, script, nproc=1)), daemon=True)
    runner.start()
    try:
        assert wait_until(lambda: sum(h["ranks_running"] or 0 for h in job.status()["hosts"]) == 3, 60)
        report = job.stacks()
    finally:
        flag.touch()
        runner.join(60)
    assert sorted((s.rank, s.host) for s in report.stacks) == [(0, "local0"), (1, "local1"), (2, "local2")]
    for s in report.stacks:
        assert any(f["function"] == "waiting_for_the_flag" for t in s.threads for f in t["frames"]), s
    assert len(report.groups) == 1  # the same stack on every host: one group
    assert box["run"].result.exit_code == 0  # type: ignore[attr-defined]


def test_a_run_reaches_the_host_behind_a_relay_through_it(relayed: tuple[Job, list[str]], tmp_path: Path) -> None:
    """On real agents: a fresh client's run links local0 and local2 only; local1's requests,
    heartbeats, output and exit go through local0 (runtime/agent/forwarding.py)."""
    import subprocess
    import sys

    job, _ = relayed
    script = write_script(tmp_path, "hello.py", "import os\nprint('hello from', os.environ['RANK'])\n")
    probe = (
        "import io, sys, psutil; from monarch_cli.config import configure; configure(relay_from_hosts=2); "
        "from monarch_cli.jobs import job_load; job = job_load(sys.argv[1]); out = io.BytesIO(); "
        "r = job.run_spmd(['torchrun', '--nproc-per-node=1', sys.argv[2]], stdout=out, stderr=io.BytesIO(), sync=False); "
        "ports = {c.raddr.port for c in psutil.Process().net_connections('tcp') if c.status == 'ESTABLISHED'}; "
        "print(sorted(ports), r.exit_code, sorted(out.getvalue().decode().split('\\n')))"
    )
    done = subprocess.run(
        [sys.executable, "-c", probe, str(job.path), str(script)], capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr
    relays = sorted(int(h.agent.rpartition(":")[2]) for h in (job.state.hosts[0], job.state.hosts[2]))
    lines = ["", "[rank0] hello from 0", "[rank1] hello from 1", "[rank2] hello from 2"]
    assert done.stdout.strip() == f"{relays} 0 {lines}", done.stdout


def test_a_relay_refuses_to_forward_to_what_is_not_an_agent(relayed: tuple[Job, list[str]]) -> None:
    """A request forwarded to a target that is not an agent address is answered with an error
    at once, not left to time out; the relay keeps forwarding to real hosts."""
    job, _ = relayed
    mb = job.hostset().mb
    relay = job.state.hosts[0].agent
    mb.link("not-an-agent", via=relay)
    with pytest.raises(ActorError, match="does not forward to 'not-an-agent'"):
        mb.request("not-an-agent", lambda cid: protocol.Ping(cid, mb.address)).get(timeout=30)
    behind = job.state.hosts[1]
    mb.link(behind.agent, via=relay)
    assert mb.request(behind.agent, lambda cid: protocol.Ping(cid, mb.address)).get(timeout=30)["host"] == behind.name


def test_a_route_through_a_relay_that_is_gone_does_not_outlive_its_set(relayed: tuple[Job, list[str]]) -> None:
    """A long-lived process (a notebook, ``monarch mcp``) keeps one mailbox across reservations.
    An address it once reached through a relay that is gone (its reservation released, a new
    agent on the same port) is reached directly by the next set that does not relay: it used to
    stay routed through the dead relay, and every ping to it timed out."""
    job, _ = relayed
    mb = job.hostset().mb
    behind = job.state.hosts[1]
    mb.link(behind.agent, via="tcp://127.0.0.1:9")  # (the discard port: no agent there)
    configure(relay_from_hosts=256)  # the next set is a star
    try:
        started = time.monotonic()
        hs = job.hostset()
    finally:
        configure(relay_from_hosts=2)
    assert [info["host"] for info in hs.infos] == ["local0", "local1", "local2"]
    assert time.monotonic() - started < 30  # answered, not timed out and retried


def test_a_relay_passes_on_questions_only(relayed: tuple[Job, list[str]]) -> None:
    job, _ = relayed
    hs = job.hostset()
    relay, target = job.state.hosts[0].agent, job.state.hosts[1].agent
    run = protocol.header(protocol.ForgetPreload(0, hs.mb.address))[:1] + ("x",)  # a malformed inner header
    for inner in (protocol.header(protocol.Stopping(0, hs.mb.address, "me")), run):
        fut = hs.mb.request(relay, lambda cid, i=inner: protocol.FanOut(cid, hs.mb.address, [target], 5.0, i))
        with pytest.raises(ActorError, match="fan_out refused"):
            fut.get(timeout=30)


def test_a_relay_keeps_a_bounded_number_of_connections(
    relayed: tuple[Job, list[str]], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The relay itself, in this process against the three real agents: at most MAX_KEPT kept
    connections, the least recently asked one let go, every question still answered."""
    import zmq

    from monarch_cli.runtime.agent import relay as relay_module
    from monarch_cli.runtime.transport import wire
    from monarch_cli.runtime.transport.keys import Keys
    from monarch_cli.runtime.transport.sockets import Transport

    job, _ = relayed
    monkeypatch.setattr(relay_module, "MAX_KEPT", 2)
    poller = zmq.Poller()
    answers: list[tuple[int, bool, object]] = []

    class Core:
        address = "tcp://127.0.0.1:1"  # (only names the relay)
        transport = Transport(Keys.decode(job.state.keys), zap=False)

        def reply(self, address: str, cid: int, ok: bool, value: object) -> None:
            answers.append((cid, ok, value))

    core = Core()
    r = relay_module.FanOutRelay(core, lambda s: poller.register(s, zmq.POLLIN), poller.unregister)  # type: ignore[arg-type]
    ask = r.handlers()[protocol.FanOut]
    try:
        for cid, host in enumerate([*job.state.hosts, job.state.hosts[0]], start=1):
            inner = protocol.header(protocol.Ping(0, "x"))
            ask(protocol.FanOut(cid, "me", [host.agent], 30.0, inner), [])
            assert len(r.socks) <= 2
            deadline = time.monotonic() + 60
            while not any(a[0] == cid for a in answers):
                assert time.monotonic() < deadline, "no answer through the relay"
                for sock, _ in poller.poll(100):
                    r.readable(sock)
                r.tick()
            (got,) = [a for a in answers if a[0] == cid]
            assert got[1] and got[2][0][0] is True  # type: ignore[index]
            assert wire.loads(got[2][0][1])["host"] == host.name  # type: ignore[index]
        # local0 was asked first, let go for local2, and asked again: a new connection, still 2 kept.
        assert sorted(r.socks.values()) == sorted([job.state.hosts[2].agent, job.state.hosts[0].agent])
    finally:
        r.close()
        core.transport.close()
