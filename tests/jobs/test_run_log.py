"""The run's one log file and its lazy split into ``rankN.log`` (``jobs/run_log.py``).

What a user relies on: every rank's file holds exactly the bytes that rank wrote, a silent rank
has an (empty) file, a split taken while the run still writes is completed by the next one
(never a byte twice or lost), and two readers splitting at once do not interleave.
"""

from __future__ import annotations

import json
import multiprocessing
import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from monarch_cli.jobs import run_log
from monarch_cli.jobs.run_log import LOG_NAME, header, rank_log, record, split


def _write(run_dir: Path, data: bytes) -> None:
    with open(run_dir / LOG_NAME, "ab") as f:
        f.write(data)


def test_each_rank_gets_exactly_its_bytes_and_a_silent_rank_an_empty_file(tmp_path: Path) -> None:
    chunks = [
        (0, 1, b"step 1\n"),
        (2, 2, b"\xff\xfe not utf-8\r"),
        (0, 2, b"warning: 3 4\n5 6 7\n"),  # (digits and spaces that look like a header)
        (2, 1, b""),
        (0, 1, b"no line end"),
    ]
    _write(tmp_path, header([0, 1, 2]) + b"".join(record(*c) for c in chunks))
    split(tmp_path)
    assert (tmp_path / "rank0.log").read_bytes() == b"step 1\nwarning: 3 4\n5 6 7\nno line end"
    assert (tmp_path / "rank1.log").read_bytes() == b""
    assert (tmp_path / "rank2.log").read_bytes() == b"\xff\xfe not utf-8\r"
    made = [p for p in tmp_path.iterdir() if p.name != LOG_NAME]  # rank files, and the split's own
    assert len(made) > 3 and all(stat.S_IMODE(p.stat().st_mode) == 0o600 for p in made)


def test_a_split_while_the_run_writes_takes_whole_records_and_the_next_one_the_rest(tmp_path: Path) -> None:
    big = os.urandom(3 << 20)  # longer than one read of the splitter
    whole = header([0, 1]) + record(0, 1, b"first\n") + record(1, 1, big) + record(0, 1, b"last\n")
    cut = len(header([0, 1])) + len(record(0, 1, b"first\n")) + 1000  # in the middle of rank 1's record
    _write(tmp_path, whole[:cut])
    split(tmp_path)
    assert rank_log(tmp_path, 0).read_bytes() == b"first\n"
    assert (tmp_path / "rank1.log").read_bytes() == b""  # nothing of a record not yet whole
    _write(tmp_path, whole[cut:-3])  # (a header split too)
    split(tmp_path)
    _write(tmp_path, whole[-3:])
    assert rank_log(tmp_path, 1).read_bytes() == big
    assert rank_log(tmp_path, 0).read_bytes() == b"first\nlast\n"
    split(tmp_path)  # nothing new: nothing appended twice
    assert (tmp_path / "rank0.log").read_bytes() == b"first\nlast\n"


def _split(run_dir: str) -> None:
    split(Path(run_dir))


def test_readers_splitting_at_once_write_each_byte_once(tmp_path: Path) -> None:
    ranks = range(64)
    body = b"".join(record(r, 1, f"rank {r} line {i}\n".encode()) for i in range(200) for r in ranks)
    _write(tmp_path, header(ranks) + body)
    ctx = multiprocessing.get_context("spawn")
    procs = [ctx.Process(target=_split, args=(str(tmp_path),)) for _ in range(4)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(120)
        assert p.exitcode == 0
    for r in ranks:
        want = b"".join(f"rank {r} line {i}\n".encode() for i in range(200))
        assert (tmp_path / f"rank{r}.log").read_bytes() == want


def test_a_run_logged_before_the_combined_log_is_left_as_it_is(tmp_path: Path) -> None:
    (tmp_path / "rank0.log").write_bytes(b"old layout\n")
    assert rank_log(tmp_path, 0).read_bytes() == b"old layout\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["rank0.log"]


def test_a_restart_appends_its_own_header_and_its_output_still_reaches_the_rank_files(tmp_path: Path) -> None:
    """A run's attempts (torchrun --max-restarts) share its directory: each starts with a header."""
    _write(tmp_path, header([0, 1]) + record(0, 1, b"attempt 0\n") + record(1, 2, b"failed\n"))
    split(tmp_path)
    _write(tmp_path, header([0, 1]) + record(0, 1, b"attempt 1\n") + record(1, 1, b"ok\n"))
    assert rank_log(tmp_path, 0).read_bytes() == b"attempt 0\nattempt 1\n"
    assert rank_log(tmp_path, 1).read_bytes() == b"failed\nok\n"


def test_a_split_killed_while_appending_is_done_again_without_a_record_twice(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Ctrl-C on `monarch logs` between appending to the rank files and saving how far it got:
    the next split must not append those records again."""
    _write(tmp_path, header([0, 1]) + record(0, 1, b"one\n") + record(1, 1, b"two\n"))
    split(tmp_path)
    _write(tmp_path, record(0, 1, b"three\n") + record(1, 2, b"four\n"))

    def killed(self: object) -> None:
        raise KeyboardInterrupt  # after the appends, before the offset is saved

    monkeypatch.setattr(run_log._Splitter, "close", killed)
    with pytest.raises(KeyboardInterrupt):
        split(tmp_path)
    assert (tmp_path / "rank0.log").read_bytes() == b"one\nthree\n"  # appended, not yet recorded
    monkeypatch.undo()
    assert rank_log(tmp_path, 0).read_bytes() == b"one\nthree\n"
    assert rank_log(tmp_path, 1).read_bytes() == b"two\nfour\n"
    _write(tmp_path, header([0, 1]) + record(0, 1, b"restart\n"))  # a restart's header keeps what came before
    assert rank_log(tmp_path, 0).read_bytes() == b"one\nthree\nrestart\n"


def test_monarch_logs_reads_a_run_on_a_read_only_mount(tmp_path: Path) -> None:
    """The rank files of a run directory that cannot be written (a read-only mount of a shared file
    system) are split into a private copy under the cache directory, not refused."""
    state = tmp_path / "job" / ".monarch" / "job_state.pkl"
    run_dir = state.parent / "logs" / "20261126-000000-abcd"
    run_dir.mkdir(parents=True)
    _write(run_dir, header([0, 1]) + record(0, 1, b"hello from 0\n") + record(1, 1, b"hello from 1\n"))
    cache = tmp_path / "cache"
    logs = f"{sys.executable} -m monarch_cli logs --state {state}"
    script = (
        f"mount --bind -o ro {run_dir} {run_dir} && touch {run_dir}/probe 2>/dev/null && exit 99; "
        f"{logs} && {logs} --rank 1 && {logs} --json"
    )
    env = {**os.environ, "MONARCH_CACHE_DIR": str(cache), "NO_COLOR": "1"}
    proc = subprocess.run(["unshare", "-m", "sh", "-c", script], capture_output=True, env=env, timeout=120)
    assert proc.returncode == 0, proc.stderr.decode()[-2000:]
    out = proc.stdout.decode()
    assert "[rank0] hello from 0\n[rank1] hello from 1\n" in out and "\nhello from 1\n" in out
    listed = json.loads(out[out.index("{") :])
    copies = [Path(f) for f in listed["logs"].values()]
    assert copies and all(cache in f.parents for f in copies), listed
    assert sorted(p.name for p in run_dir.iterdir()) == [LOG_NAME]  # nothing written beside the run
    assert stat.S_IMODE((cache / "split-logs").stat().st_mode) == 0o700
    assert all(stat.S_IMODE(f.stat().st_mode) == 0o600 for f in copies)
