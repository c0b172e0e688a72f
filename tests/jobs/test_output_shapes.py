"""Output of any shape — long lines, no newline, ``\\r`` storms, binary, a flood of tiny
writes — reaches the log whole and the console prefixed, at a cost linear in its size, and
never makes a busy client declare its hosts lost. Also: logs are private and pruned.
"""

from __future__ import annotations

import errno
import io
import os
import re
import stat
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from monarch_cli.config import configure, settings
from monarch_cli.errors import OptionError
from monarch_cli.jobs import Job
from monarch_cli.jobs.output import MAX_HELD_LINE, TAIL_WIDTH, OutputSink, list_runs, new_run_dir
from monarch_cli.jobs.run_log import rank_log
from monarch_cli.runtime import protocol

from ..conftest import write_script
from .conftest import PREFIX, spmd

_SEGMENT = re.compile(rb"[^\r\n]*(?:\r\n|\n|\r)")


def console_segments(console: bytes) -> dict[str, list[bytes]]:
    """Each rank's console segments, prefix removed; every segment must carry its prefix."""
    segments = _SEGMENT.findall(console)
    assert b"".join(segments) == console, "console output does not end with a line end"
    per_rank: dict[str, list[bytes]] = {}
    for seg in segments:
        m = PREFIX.match(seg)
        assert m, f"segment without a rank prefix: {seg[:80]!r}"
        per_rank.setdefault(m.group(1).decode(), []).append(seg[m.end() :])
    return per_rank


def assert_all_ok(run) -> None:
    assert run.result.exit_code == 0, (run.err[-2000:], [r.how for r in run.result.ranks])
    assert not any(r.lost for r in run.result.ranks), [r.how for r in run.result.ranks]


# ----------------------------------------------------------------- the sink, no processes
def test_sink_cost_is_linear_for_one_long_line_in_many_chunks(tmp_path: Path) -> None:
    out = io.BytesIO()
    sink = OutputSink(tmp_path / "run", {0: "rank0"}, stdout=out, stderr=io.BytesIO(), color=False)
    chunk = b"z" * 4096
    n = 2_500  # 10 MB, no newline: the old sink searched the held-back part again per chunk
    for _ in range(n):
        sink.write(0, 1, chunk)
        assert len(sink.partial.get((0, 1), b"")) < MAX_HELD_LINE  # memory stays bounded
    sink.write(0, 1, b"end\n")
    sink.close()
    total = n * len(chunk) + 4
    assert sink.scanned <= 3 * total, f"{sink.scanned} bytes scanned for {total} written"
    assert rank_log(tmp_path / "run", 0).read_bytes() == chunk * n + b"end\n"
    pieces = out.getvalue().split(b"\n")[:-1]
    assert all(p.startswith(b"[rank0] ") for p in pieces)
    assert b"".join(p[len(b"[rank0] ") :] for p in pieces) == chunk * n + b"end"
    assert len(pieces) == -(-total // MAX_HELD_LINE)  # wrapped on the console, about 1 MiB a line
    assert sink.tail(0) == ["z" * TAIL_WIDTH + "…"]  # the line once, cut for display


def test_sink_cost_is_linear_for_many_short_lines_and_tiny_writes(tmp_path: Path) -> None:
    out = io.BytesIO()
    sink = OutputSink(tmp_path / "run", {0: "rank0"}, stdout=out, stderr=io.BytesIO(), color=False)
    lines = b"".join(b"line %d\n" % i for i in range(100_000))
    for i in range(0, len(lines), 65536):
        sink.write(0, 1, lines[i : i + 65536])
    for _ in range(3000):
        sink.write(0, 1, b".")
    sink.end_of_rank(0)
    sink.close()
    total = len(lines) + 3000
    assert sink.scanned <= 3 * total
    assert rank_log(tmp_path / "run", 0).read_bytes() == lines + b"." * 3000
    assert (
        out.getvalue() == b"".join(b"[rank0] line %d\n" % i for i in range(100_000)) + b"[rank0] " + b"." * 3000 + b"\n"
    )
    assert sink.tail(0) == [f"line {i}" for i in range(99_996, 100_000)] + ["." * TAIL_WIDTH + "…"]


# --------------------------------------------------------------------- real ranks
@pytest.mark.slow
def test_thirty_kilobyte_json_lines(job: Job, tmp_path: Path) -> None:
    script = write_script(
        tmp_path,
        "json_lines.py",
        """
        import json, os
        rank = int(os.environ["RANK"])
        for i in range(5):
            print(json.dumps({"rank": rank, "i": i, "data": "x" * 30_000}))
    """,
    )
    run = spmd(job, script)
    assert_all_ok(run)
    console = console_segments(run.out)
    for rank in range(4):
        want = [f'{{"rank": {rank}, "i": {i}, "data": "{"x" * 30_000}"}}\n'.encode() for i in range(5)]
        assert run.log(rank) == b"".join(want)
        assert console[f"rank{rank}"] == want  # each line whole, once, on the console
        tail = run.result.ranks[rank].tail
        assert len(tail) == 5 and all(len(line) == TAIL_WIDTH + 1 and line.endswith("…") for line in tail)


@pytest.mark.slow
def test_ten_megabyte_line_without_newline_arrives_whole(job: Job, tmp_path: Path) -> None:
    script = write_script(
        tmp_path,
        "huge.py",
        """
        import os, sys
        sys.stdout.write(os.environ["RANK"] * 10_000_000)
    """,
    )
    run = spmd(job, script, nproc=1)
    assert_all_ok(run)
    console = console_segments(run.out)
    for rank in range(2):
        written = str(rank).encode() * 10_000_000
        assert run.log(rank) == written
        pieces = console[f"rank{rank}"]
        assert len(pieces) >= 10  # wrapped, with the prefix on every piece
        assert b"".join(p[:-1] for p in pieces) == written


@pytest.mark.slow
def test_three_thousand_flushed_dots(job: Job, tmp_path: Path) -> None:
    script = write_script(
        tmp_path,
        "dots.py",
        """
        for _ in range(3000):
            print(".", end="", flush=True)
    """,
    )
    run = spmd(job, script)
    assert_all_ok(run)
    console = console_segments(run.out)
    for rank in range(4):
        assert run.log(rank) == b"." * 3000
        assert console[f"rank{rank}"] == [b"." * 3000 + b"\n"]


@pytest.mark.slow
def test_carriage_return_storm_and_binary_bytes_survive(job: Job, tmp_path: Path) -> None:
    script = write_script(
        tmp_path,
        "storm.py",
        """
        import sys
        out = sys.stdout.buffer
        for i in range(20_000):
            out.write(b"\\r%d%%" % (i % 100))
        out.write(bytes(range(256)) * 400)
        out.write(b"\\r\\n" * 1000)
        out.flush()
    """,
    )
    run = spmd(job, script, nproc=1)
    assert_all_ok(run)
    written = b"".join(b"\r%d%%" % (i % 100) for i in range(20_000)) + bytes(range(256)) * 400 + b"\r\n" * 1000
    console = console_segments(run.out)
    for rank in range(2):
        assert run.log(rank) == written
        assert b"".join(console[f"rank{rank}"]) == written


@pytest.mark.slow
def test_failure_table_shows_a_bounded_tail(job: Job, tmp_path: Path) -> None:
    script = write_script(
        tmp_path,
        "big_then_fail.py",
        """
        import os, sys
        if os.environ["RANK"] == "1":
            print("starting")
            print("{" + "y" * 200_000 + "}")
            sys.exit(3)
    """,
    )
    cli = subprocess.run(
        [sys.executable, "-m", "monarch_cli", "run-spmd", "--", "torchrun", "--nproc-per-node=1", str(script)],
        env={**os.environ, "MONARCH_STATE": str(job.path), "COLUMNS": "120"},
        capture_output=True,
        timeout=120,
        stdin=subprocess.DEVNULL,
    )
    assert cli.returncode == 3, cli.stderr[-3000:]
    table = cli.stderr.decode()
    assert "rank 1 failed first" in table
    assert len(table.splitlines()) < 40, table[-3000:]  # the 200 KB line once, cut, not ~2,500 rows
    assert "…" in table
    run_dir = job.runs()[-1]
    assert rank_log(run_dir, 1).read_bytes() == b"starting\n{" + b"y" * 200_000 + b"}\n"


@pytest.mark.slow
def test_a_console_that_stops_reading_holds_the_ranks_back(job: Job, tmp_path: Path) -> None:
    """As under torchrun, a rank that writes faster than the console takes blocks in write():
    output does not pile up in memory between them (hosts send only a window ahead).

    The reservation has two hosts, so the run has two ranks; only rank 0 is shown. Rank 1's
    output goes to its log alone and is not held back by the console, so each rank marks
    its own end and only rank 0's mark is watched (one shared mark once let rank 1, done
    before rank 0 reached the console, pass for rank 0)."""
    marker = tmp_path / "finished-writing-0"
    script = write_script(
        tmp_path,
        "flood.py",
        f"""
        import os, sys
        block = b"f" * 65536
        for _ in range(512):  # 32 MiB
            sys.stdout.buffer.write(block)
        sys.stdout.flush()
        open({str(tmp_path)!r} + "/finished-writing-" + os.environ["RANK"], "w").close()
    """,
    )
    seen_during_stall: list[bool] = []

    class StalledConsole(io.BytesIO):
        def write(self, data: bytes) -> int:  # type: ignore[override]
            if not seen_during_stall:  # the first write stalls, like a terminal paused with Ctrl-S
                deadline = time.monotonic() + 4
                while not marker.exists() and time.monotonic() < deadline:
                    time.sleep(0.05)
                seen_during_stall.append(marker.exists())
            return super().write(data)

    out = StalledConsole()
    result = job.run_spmd(["torchrun", "--nproc-per-node=1", str(script)], stdout=out, stderr=io.BytesIO(), ranks={0})
    assert result.exit_code == 0, [r.how for r in result.ranks]
    assert len(result.ranks) == 2  # what the docstring says: rank 1 runs too, unseen
    assert seen_during_stall == [False]  # the rank could not finish writing while the console stalled
    assert marker.exists()
    assert rank_log(result.log_dir, 0).read_bytes() == b"f" * (32 << 20)
    assert out.getvalue().replace(b"[rank0] ", b"").replace(b"\n", b"") == b"f" * (32 << 20)


@pytest.mark.slow
def test_a_console_that_fails_does_not_stall_the_ranks(job: Job, tmp_path: Path, capfd: pytest.CaptureFixture) -> None:
    """A console that raises (a terminal gone: EIO) is dropped with one line, and the output
    still goes through to the log: the ranks are credited, so they never wait for ever. (A closed
    pipe, EPIPE, ends the run instead, as `| head` expects: tests/cli/test_pipes_and_ranks.py.)"""

    class ClosedConsole(io.BytesIO):
        def write(self, data: bytes) -> int:  # type: ignore[override]
            raise OSError(errno.EIO, "Input/output error")

    script = write_script(
        tmp_path,
        "lots.py",
        """
        import sys
        for i in range(300_000):
            sys.stdout.write(f"line {i:06d} {'x' * 40}\\n")
    """,
    )
    results: list = []
    runner = threading.Thread(
        target=lambda: results.append(
            job.run_spmd(
                ["torchrun", "--nproc-per-node=1", str(script)], stdout=ClosedConsole(), stderr=io.BytesIO(), ranks={0}
            )
        ),
        daemon=True,
    )
    runner.start()
    runner.join(120)
    reported = capfd.readouterr().err
    assert results, "the run stalled behind a console that failed"
    assert reported.count("the console failed (Input/output error)") == 1 and "Traceback" not in reported
    result = results[0]
    assert result.exit_code == 0, [r.how for r in result.ranks]
    want = "".join(f"line {i:06d} {'x' * 40}\n" for i in range(300_000)).encode()
    assert rank_log(result.log_dir, 0).read_bytes() == want  # > OUTPUT_WINDOW: credit kept flowing


@pytest.mark.slow
def test_heartbeats_go_on_while_a_run_handler_blocks(job: Job) -> None:
    """A run's handler blocked for longer than the heartbeat timeout (output to a terminal the
    user paused) must not make a live agent look lost, nor the agent reap the client: a run's
    events have a thread of their own, and heartbeats ride the links on the I/O thread."""
    from monarch_cli.jobs.model import HostSet

    hs = HostSet(job.state.hosts, job.keys)
    mb, host = hs.mb, job.state.hosts[0]
    lost: list[float] = []
    blocked, handled = threading.Event(), threading.Event()

    def slow(_header, _body) -> None:
        blocked.set()
        time.sleep(5 * settings().heartbeat_timeout)
        handled.set()

    old = settings().heartbeat_timeout
    configure(heartbeat_timeout=1.0)
    subscription = mb.subscribe("slow-test-run", {protocol.Output: slow}, thread="test-run-events")
    try:
        mb.watch_agent(host.agent, lambda _agent, silence: lost.append(silence))
        mb.send(mb.address, protocol.Output("slow-test-run", 0, 1), [b"x"])  # handled by the I/O thread: nobody waits
        assert blocked.wait(10)
        # While the handler blocks, the agent's answers on the same link are still read ...
        assert hs.ask_all(lambda cid: protocol.Ping(cid, mb.address), timeout=2)[0]["host"]
        assert not handled.is_set()
        assert handled.wait(30)
        time.sleep(2 * settings().heartbeat_interval)
        assert lost == []  # ... and its heartbeats were answered all along
    finally:
        mb.unwatch_agent(host.agent)
        subscription.close()
        configure(heartbeat_timeout=old)


def test_a_run_holds_one_connection_per_host(job: Job, tmp_path: Path) -> None:
    """Heartbeats ride the links: while a run is going, this client has exactly one TCP
    connection to each host's agent (a second one per host was a CURVE handshake per host per
    command, and ~25-60 KB of libzmq buffers: ~100 MB at 4,096 hosts)."""
    import psutil

    go = tmp_path / "go"
    script = write_script(
        tmp_path,
        "wait.py",
        f"""
        import os, time
        print("ready", flush=True)
        while not os.path.exists({str(go)!r}):
            time.sleep(0.02)
        """,
    )
    ports = {int(h.agent.rsplit(":", 1)[1]) for h in job.state.hosts}
    console = io.BytesIO()
    runner = threading.Thread(
        target=lambda: job.run_spmd(
            ["torchrun", "--nproc-per-node=1", str(script)], stdout=console, stderr=io.BytesIO()
        ),
        daemon=True,
    )
    runner.start()
    try:
        deadline = time.monotonic() + 60
        while console.getvalue().count(b"ready") < len(ports) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert console.getvalue().count(b"ready") == len(ports), console.getvalue()
        time.sleep(3 * settings().heartbeat_interval)  # heartbeats have gone out meanwhile
        to_agents = [
            c.raddr.port
            for c in psutil.Process().net_connections(kind="tcp")
            if c.raddr and c.raddr.port in ports and c.status == psutil.CONN_ESTABLISHED
        ]
        assert sorted(to_agents) == sorted(ports), to_agents
    finally:
        go.touch()
        runner.join(60)


# ------------------------------------------------------------------- private, pruned logs
def test_logs_are_private(job: Job, tmp_path: Path) -> None:
    script = write_script(tmp_path, "ok.py", "print('secret token')\n")
    run = spmd(job, script, flags=["--log-dir", str(tmp_path / "torchrun-logs")])
    assert_all_ok(run)
    mode = lambda p: stat.S_IMODE(p.stat().st_mode)  # noqa: E731
    assert mode(job.logs_root) == 0o700
    assert mode(run.result.log_dir) == 0o700
    assert mode(run.result.log_dir / "output.log") == 0o600
    for rank in range(4):
        assert mode(rank_log(run.result.log_dir, rank)) == 0o600
    torchrun_logs = list((tmp_path / "torchrun-logs").rglob("*.log"))
    assert torchrun_logs and all(mode(p) == 0o600 for p in torchrun_logs)


def test_old_runs_are_pruned_when_a_run_starts(job: Job, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    old = []
    for i in range(6):
        d = job.logs_root / f"20000101-00000{i}000-old{i}"
        d.mkdir(parents=True)
        (d / "rank0.log").write_text("old\n")
        os.utime(d, (946684800 + i, 946684800 + i))  # older than every real run
        old.append(d)
    before = list_runs(job.logs_root)
    monkeypatch.setenv("MONARCH_KEEP_RUNS", str(len(before) - 2))
    script = write_script(tmp_path, "ok.py", "print('ok')\n")
    run = spmd(job, script)
    assert_all_ok(run)
    after = list_runs(job.logs_root)
    assert len(after) == len(before) - 2 and after[-1] == run.result.log_dir
    assert after == before[3:] + [run.result.log_dir]  # the three oldest went
    assert not any(d.exists() for d in old[:3]) and all(d.exists() for d in old[3:])

    monkeypatch.setenv("MONARCH_KEEP_RUNS", "many")
    with pytest.raises(OptionError, match=r"^MONARCH_KEEP_RUNS: expected a whole number \(0 or more\), got 'many'$"):
        spmd(job, script)


def test_run_dir_retention_defaults_and_zero_keeps_all(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    root = tmp_path / "logs"
    monkeypatch.delenv("MONARCH_KEEP_RUNS", raising=False)
    for i in range(25):
        new_run_dir(root, f"run{i:02d}")
        os.utime(root / f"run{i:02d}", (1_000_000 + i, 1_000_000 + i))
    assert [p.name for p in list_runs(root)] == [f"run{i:02d}" for i in range(5, 25)]  # the last 20
    monkeypatch.setenv("MONARCH_KEEP_RUNS", "0")
    new_run_dir(root, "run25")
    assert len(list_runs(root)) == 21
