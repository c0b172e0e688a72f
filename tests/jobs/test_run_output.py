"""Rank output as a user sees it: ``[rankN]``-prefixed whole lines on the console, exactly
the bytes written in the run's log (``<state dir>/logs/<run-id>/output.log``, split into ``rank<N>.log``); plus ``Job.exec``.
"""

from __future__ import annotations

import re
from pathlib import Path

from monarch_cli.jobs import Job
from monarch_cli.jobs.run_log import rank_log

from ..conftest import write_script
from .conftest import PREFIX, Run, spmd

_SEGMENT = re.compile(rb"[^\r\n]*(?:\r\n|\n|\r)")


def console_by_rank(console: bytes) -> dict[str, bytes]:
    """Reassemble each rank's bytes from the console: every segment must carry its prefix."""
    segments = _SEGMENT.findall(console)
    assert b"".join(segments) == console, "console output does not end with a line end"
    per_rank: dict[str, bytes] = {}
    for seg in segments:
        m = PREFIX.match(seg)
        assert m, f"segment without a rank prefix: {seg!r}"
        label = m.group(1).decode()
        per_rank[label] = per_rank.get(label, b"") + seg[m.end() :]
    return per_rank


def expected_lines(rank: int) -> bytes:
    return b"".join(f"rank {rank} line {i:05d} {'x' * (i % 70)}\n".encode() for i in range(10_000))


def test_ten_thousand_lines_are_kept_byte_for_byte(job: Job, tmp_path: Path) -> None:
    script = write_script(
        tmp_path,
        "many.py",
        """
        import os, sys
        rank = int(os.environ["RANK"])
        for i in range(10_000):
            sys.stdout.write(f"rank {rank} line {i:05d} {'x' * (i % 70)}\\n")
        sys.stdout.write("last words without a newline")
    """,
    )
    run = spmd(job, script)
    assert run.result.exit_code == 0, run.err
    assert run.err == b""
    console = console_by_rank(run.out)
    assert sorted(console) == ["rank0", "rank1", "rank2", "rank3"]
    for rank in range(4):
        written = expected_lines(rank) + b"last words without a newline"
        assert run.log(rank) == written  # the log has exactly what the rank wrote
        # The console has every line once, in order; the unterminated last line is shown whole.
        assert console[f"rank{rank}"] == written + b"\n"
        assert run.result.ranks[rank].tail[-1] == "last words without a newline"
    assert len(run.lines()) == 4 * 10_001


def test_progress_bars_split_characters_and_invalid_utf8(job: Job, tmp_path: Path) -> None:
    script = write_script(
        tmp_path,
        "bytes.py",
        """
        import sys, time
        out = sys.stdout.buffer
        for pct in (0, 25, 50, 75, 100):
            out.write(b"\\rprogress %d%%" % pct)
            out.flush()
            time.sleep(0.02)
        out.write(b"\\n")
        out.write(b"invalid \\xff\\xfe\\x80 utf-8\\n")
        word = "h\\u00e9llo w\\u00f6rld\\n".encode()
        out.write(word[:2])  # an utf-8 character split across two writes (and two reads)
        out.flush()
        time.sleep(0.05)
        out.write(word[2:])
        out.write(b"crlf line\\r\\n")
        out.flush()
    """,
    )
    run = spmd(job, script)
    assert run.result.exit_code == 0, run.err
    written = (
        b"\rprogress 0%\rprogress 25%\rprogress 50%\rprogress 75%\rprogress 100%\n"
        b"invalid \xff\xfe\x80 utf-8\n" + "h\u00e9llo w\u00f6rld\n".encode() + b"crlf line\r\n"
    )
    console = console_by_rank(run.out)
    for rank in range(4):
        assert run.log(rank) == written
        assert console[f"rank{rank}"] == written
    segments = [seg for seg in _SEGMENT.findall(run.out) if seg.startswith(b"[rank0] ")]
    # Each redraw of the bar starts with the prefix, so it redraws in place on a terminal;
    # the character split across writes and the invalid bytes arrive whole, in one line.
    assert segments == [
        b"[rank0] \r",
        b"[rank0] progress 0%\r",
        b"[rank0] progress 25%\r",
        b"[rank0] progress 50%\r",
        b"[rank0] progress 75%\r",
        b"[rank0] progress 100%\n",
        b"[rank0] invalid \xff\xfe\x80 utf-8\n",
        "[rank0] h\u00e9llo w\u00f6rld\n".encode(),
        b"[rank0] crlf line\r\n",
    ]
    # The tail (shown in failure tables) is text; invalid bytes are escaped, not lost.
    assert run.result.ranks[0].tail[-3:] == ["invalid \\xff\\xfe\\x80 utf-8", "h\u00e9llo w\u00f6rld", "crlf line"]


def test_interleaved_stdout_and_stderr(job: Job, tmp_path: Path) -> None:
    script = write_script(
        tmp_path,
        "both.py",
        """
        import os, sys
        rank = os.environ["RANK"]
        for i in range(2000):
            stream = sys.stdout if i % 2 == 0 else sys.stderr
            stream.write(f"{'out' if i % 2 == 0 else 'err'} {rank} {i}\\n")
        sys.stderr.write(f"err {rank} unterminated")
    """,
    )
    run = spmd(job, script)
    assert run.result.exit_code == 0, run.text()
    out, err = console_by_rank(run.out), console_by_rank(run.err)
    for rank in range(4):
        want_out = [f"out {rank} {i}".encode() for i in range(0, 2000, 2)]
        want_err = [f"err {rank} {i}".encode() for i in range(1, 2000, 2)] + [f"err {rank} unterminated".encode()]
        assert out[f"rank{rank}"].splitlines() == want_out
        assert err[f"rank{rank}"].splitlines() == want_err
        # The log holds both streams, every line whole and once, each stream in its order.
        logged: list[bytes] = run.log(rank).split(b"\n")
        assert sorted(logged) == sorted(want_out + want_err)
        assert [l for l in logged if l.startswith(b"out")] == want_out
        assert [l for l in logged if l.startswith(b"err")] == want_err
        assert run.log(rank).endswith(f"err {rank} unterminated".encode())


def test_ranks_filter_shows_rank_0_but_logs_every_rank(job: Job, tmp_path: Path) -> None:
    script = write_script(
        tmp_path,
        "hello.py",
        """
        import os, sys
        print("hello from", os.environ["RANK"])
        print("problem on", os.environ["RANK"], file=sys.stderr)
    """,
    )
    run = spmd(job, script, ranks={0})
    assert run.result.exit_code == 0
    assert run.out == b"[rank0] hello from 0\n"
    assert run.err == b"[rank0] problem on 0\n"
    for rank in range(4):
        log = run.log(rank)
        assert f"hello from {rank}\n".encode() in log and f"problem on {rank}\n".encode() in log
    assert sorted(p.name for p in run.result.log_dir.glob("rank*.log")) == [f"rank{r}.log" for r in range(4)]
    assert all(r.tail for r in run.result.ranks)  # tails are kept for hidden ranks too


def test_redirects_keep_a_local_ranks_streams_off_the_console_but_in_its_log(job: Job, tmp_path: Path) -> None:
    """torchrun's ``--redirects 0:1,1:2``: local rank 0's stdout and local rank 1's stderr are
    kept off the console (on each host), and every line is still in the rank's log."""
    script = write_script(
        tmp_path,
        "both.py",
        """
        import os, sys
        print("out of", os.environ["RANK"], flush=True)
        print("err of", os.environ["RANK"], file=sys.stderr, flush=True)
    """,
    )
    run = spmd(job, script, flags=["--redirects=0:1,1:2"])
    assert run.result.exit_code == 0
    assert sorted(run.lines("out")) == [b"[rank1] out of 1", b"[rank3] out of 3"]
    assert sorted(run.lines("err")) == [b"[rank0] err of 0", b"[rank2] err of 2"]
    for rank in range(4):
        assert sorted(run.log(rank).splitlines()) == [f"err of {rank}".encode(), f"out of {rank}".encode()]


def test_logs_live_under_the_state_directory(job: Job, tmp_path: Path) -> None:
    script = write_script(tmp_path, "ok.py", "print('ok')\n")
    run = spmd(job, script)
    assert run.result.log_dir == job.path.parent / "logs" / run.result.run_id
    assert run.result.log_dir in job.runs()
    assert job.status()["last_run"]["run_id"] == run.result.run_id
    assert (run.result.log_dir / "result.json").is_file()


# ---------------------------------------------------------------------------- exec
def test_exec_runs_a_shell_command_on_every_host(job: Job) -> None:
    from io import BytesIO

    out, err = BytesIO(), BytesIO()
    result = job.exec(
        "echo host $GROUP_RANK of $(hostname); echo oops $GROUP_RANK >&2; exit $((3 + GROUP_RANK))",
        stdout=out,
        stderr=err,
    )
    assert [(r.label, r.exitcode) for r in result.ranks] == [("local0", 3), ("local1", 4)]
    assert result.exit_code == 3  # the first failing host's status
    import socket

    hostname = socket.gethostname()
    assert sorted(out.getvalue().splitlines()) == [
        f"[local0] host 0 of {hostname}".encode(),
        f"[local1] host 1 of {hostname}".encode(),
    ]
    assert sorted(err.getvalue().splitlines()) == [b"[local0] oops 0", b"[local1] oops 1"]
    # Both streams go to the log; their order between two pipes is whichever the agent read first.
    assert sorted(rank_log(result.log_dir, 0).read_bytes().splitlines()) == sorted(
        [f"host 0 of {hostname}".encode(), b"oops 0"]
    )


def test_exec_argv_and_a_missing_program(job: Job) -> None:
    from io import BytesIO

    ok = job.exec(["sh", "-c", "echo fine"], stdout=BytesIO(), stderr=BytesIO())
    assert ok.exit_code == 0 and [r.ok for r in ok.ranks] == [True, True]
    err = BytesIO()
    missing = job.exec(["no-such-program-anywhere", "--x"], stdout=BytesIO(), stderr=err)
    assert missing.exit_code == 127
    assert err.getvalue().count(b"cannot execute no-such-program-anywhere") == 2


def test_two_runs_at_once_from_one_process_each_get_only_their_own_ranks(job: Job, tmp_path: Path) -> None:
    """Two ``run_spmd()`` calls in two threads of one process share its mailbox: each run's
    output and exits reach that run alone (events are routed by run id)."""
    import threading

    script = write_script(
        tmp_path,
        "tagged.py",
        """
        import os, sys, time
        tag = sys.argv[1]
        rank = int(os.environ["RANK"])
        for i in range(200):
            print(f"{tag} rank {rank} line {i}", flush=True)
            time.sleep(0.005)  # long enough for the two runs to overlap
    """,
    )
    runs: dict[str, Run] = {}
    both_ready = threading.Barrier(2)

    def run(tag: str) -> None:
        both_ready.wait()
        runs[tag] = spmd(job, script, tag, nproc=1)

    threads = [threading.Thread(target=run, args=(tag,)) for tag in ("alpha", "beta")]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert set(runs) == {"alpha", "beta"}, "a run did not finish"
    assert runs["alpha"].result.run_id != runs["beta"].result.run_id
    for tag, r in runs.items():
        assert r.result.exit_code == 0, r.text()
        ranks = sorted(e.rank for e in r.result.ranks)
        assert ranks == list(range(len(job.state.hosts))), "a rank's exit went to the other run, or was lost"
        assert r.by_rank() == {f"rank{n}": [f"{tag} rank {n} line {i}".encode() for i in range(200)] for n in ranks}


def test_batched_events_keep_each_ranks_order_and_its_exit_after_its_output(job: Job, tmp_path: Path) -> None:
    """Eight ranks that start printing together and exit at once: an agent sends what a round of
    its loop read (several ranks' output and exits) as one batch; each rank's lines still arrive
    whole and in order, and its exit only after them (its last line is in the exit's tail).
    Real agents batch only when a round finds several events (here 1-3 batches a run, checked by
    hand); tests/runtime/test_batches.py and the emulated cluster batch every time."""
    script = write_script(
        tmp_path,
        "burst.py",
        """
        import os, sys, time
        rank = int(os.environ["RANK"])
        # All eight start writing together, so an agent's round finds several ranks' output.
        open(os.path.join(sys.argv[1], str(rank)), "w").close()
        while len(os.listdir(sys.argv[1])) < 8:
            time.sleep(0.001)
        for i in range(2000):
            os.write(1, f"rank {rank} line {i:04d}\\n".encode())
        os.write(1, f"rank {rank} done\\n".encode())
        os._exit(0)
    """,
    )
    (tmp_path / "arrived").mkdir()
    run = spmd(job, script, str(tmp_path / "arrived"), nproc=4)
    assert sorted(r.rank for r in run.result.ranks) == list(range(8))
    assert run.result.exit_code == 0, run.text()
    assert run.err == b""
    out = console_by_rank(run.out)
    for rank in range(8):
        want = [f"rank {rank} line {i:04d}".encode() for i in range(2000)] + [f"rank {rank} done".encode()]
        assert out[f"rank{rank}"].splitlines() == want
        # The exit came after every byte the rank wrote (one stream: two pipes have no order
        # between them): its tail ends with its last line.
        assert run.result.ranks[rank].tail[-1] == f"rank {rank} done", run.result.ranks[rank].tail
