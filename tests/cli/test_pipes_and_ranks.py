"""`monarch ... | head` and `--ranks` as users meet them: the real CLI, a real pipe, real ranks."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from monarch_cli.jobs import serve
from monarch_cli.jobs.run_log import rank_log

from ..conftest import all_gone, wait_until

pytestmark = pytest.mark.slow

CHATTY = """\
import os, time
rank = int(os.environ["RANK"])
open(f"pid{rank}", "w").write(str(os.getpid()))
i = 0
while True:
    print(f"rank {rank} line {i}", flush=True)
    i += 1
    if i % 100 == 0:
        time.sleep(0.01)
"""

HELLO = """\
import os
print("hello from", os.environ["RANK"], flush=True)
"""


@pytest.fixture(scope="module")
def work(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    work = tmp_path_factory.mktemp("pipes")
    (work / "chatty.py").write_text(CHATTY)
    (work / "hello.py").write_text(HELLO)
    job = serve(None, hosts=2, state=work / ".monarch" / "job_state.pkl")
    yield work
    job.stop()


def _monarch(work: Path, *args: str, **kwargs) -> subprocess.Popen:
    env = {**os.environ, "MONARCH_STATE": str(work / ".monarch" / "job_state.pkl"), "NO_COLOR": "1"}
    return subprocess.Popen([sys.executable, "-m", "monarch_cli", *args], cwd=work, env=env, **kwargs)


def _piped_to_head(work: Path, *args: str) -> tuple[int, bytes, bytes]:
    """`monarch ARGS | head -1`, wired as the shell wires it; (monarch's status, head's output, monarch's stderr)."""
    monarch = _monarch(work, *args, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    head = subprocess.Popen(["head", "-1"], stdin=monarch.stdout, stdout=subprocess.PIPE)
    assert monarch.stdout is not None and monarch.stderr is not None
    monarch.stdout.close()  # only head holds the read end now
    shown = head.communicate(timeout=60)[0]
    try:
        stderr = monarch.stderr.read()
        return monarch.wait(30), shown, stderr
    finally:
        if monarch.poll() is None:
            monarch.kill()


def test_head_closing_the_pipe_ends_the_run_quietly_with_logs_kept(work: Path) -> None:
    for stale in work.glob("pid*"):
        stale.unlink()
    status, shown, stderr = _piped_to_head(work, "run-spmd", "--", "torchrun", "--nproc-per-node=2", "chatty.py")
    assert shown.startswith(b"[rank") and b" line 0\n" in shown
    assert status == 141  # 128 + SIGPIPE, as `git log | head` reports
    assert b"Traceback" not in stderr and b"BrokenPipe" not in stderr, stderr.decode()[-2000:]
    # A rank stopped before it got far may have written no pid file and no line: nothing of it may be left.
    pids = [int(p.read_text()) for p in work.glob("pid*")]
    assert wait_until(lambda: all_gone(pids), 10), "ranks left running"
    assert wait_until(lambda: _ranks_running(work) == 0, 10), "an agent still runs ranks"
    run_dir = max((work / ".monarch" / "logs").iterdir(), key=lambda p: p.stat().st_mtime)
    result = json.loads((run_dir / "result.json").read_text())
    assert result["console_closed"] is True and result["exit_code"] == 141
    assert "reader went away" in result["ending"]
    shown_rank = int(shown.split(b"]")[0][len(b"[rank") :])
    for rank in range(4):  # every line a rank printed before it was stopped is in its log, in order
        lines = rank_log(run_dir, rank).read_text().splitlines()
        assert lines == [f"rank {rank} line {i}" for i in range(len(lines))]
        assert rank != shown_rank or lines  # what head printed is logged too


def _ranks_running(work: Path) -> int:
    status = _monarch(work, "status", "--json", stdout=subprocess.PIPE, text=True)
    out, _ = status.communicate(timeout=30)
    return sum(h["ranks_running"] or 0 for h in json.loads(out)["hosts"])


@pytest.mark.parametrize("args", [["exec", "--", "seq", "1000000"], ["logs"], ["status"], ["debug", "list"]])
def test_every_command_stops_quietly_when_its_reader_leaves(work: Path, args: list) -> None:
    monarch = _monarch(work, *args, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    assert monarch.stdout is not None
    monarch.stdout.close()  # the reader is gone before the first write
    _, stderr = monarch.communicate(timeout=60)
    assert monarch.returncode == 141, stderr.decode()
    assert stderr == b""


def test_unknown_ranks_are_refused_before_anything_starts(work: Path) -> None:
    logs = work / ".monarch" / "logs"
    runs_before = set(logs.iterdir()) if logs.exists() else set()
    for ranks, message in [
        ("7", "--ranks 7: no such rank; this run has ranks 0-1"),
        ("1,5-6", "--ranks 5,6: no such rank; this run has ranks 0-1"),
    ]:
        proc = _monarch(
            work,
            "run-spmd",
            "--ranks",
            ranks,
            "--",
            "torchrun",
            "--nproc-per-node=1",
            "hello.py",
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        out, err = proc.communicate(timeout=60)
        assert proc.returncode == 2 and out == ""
        assert err.strip() == f"monarch: error: {message}"
    assert (set(logs.iterdir()) if logs.exists() else set()) == runs_before  # no run was started
    proc = _monarch(
        work,
        "run-spmd",
        "--ranks",
        "1",
        "--",
        "torchrun",
        "--nproc-per-node=1",
        "hello.py",
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 0 and out.strip() == "[rank1] hello from 1", err
