"""Telemetry with real ranks: the store, `monarch sql/stack/diagnose/top`, step times, stack fallback.

No GPU on this machine: the GPU columns of `samples` stay NULL here (docs/telemetry.md).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from monarch_cli.jobs import Job, serve
from monarch_cli.jobs.inspector import compress
from monarch_cli.jobs.rank_rows import RankRow, suspicions
from monarch_cli.runtime.agent.telemetry import py_spy_path
from monarch_cli.telemetry import TelemetryWriter, db_path, query, schema_json, schema_text

from ..conftest import one_line_error
from .conftest import Run, spmd

pytestmark = pytest.mark.slow

# Rank 2 (of 4) is stuck in a function of its own until the test releases it; the others
# wait for it in a gloo barrier.
HANG = """
import os, sys, time, torch.distributed as dist
dist.init_process_group("gloo")
def stuck_in_data_loader(flag):  # (os.access, not os.path.exists: a C call, so a stack sampled
    while not os.access(flag, os.F_OK):  # at any moment has this function innermost)
        time.sleep(0.02)
print(f"ready {dist.get_rank()}", flush=True)
if dist.get_rank() == int(sys.argv[2]):
    stuck_in_data_loader(sys.argv[1])
dist.barrier()
print("released", flush=True)
dist.destroy_process_group()
"""

DDP = """
import torch, torch.distributed as dist
dist.init_process_group("gloo")
model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(8, 1))
opt = torch.optim.SGD(model.parameters(), lr=0.01)
for _ in range(6):
    opt.zero_grad()
    model(torch.randn(16, 8)).sum().backward()
    opt.step()
dist.destroy_process_group()
"""

# Every rank steps, then idles in the same line of the same function; rank 1 stepped fewer
# times and has been silent since "ready", the others print a tick every 0.2 s.
LAGGING = """
import os, sys, time, torch
rank = int(os.environ["RANK"])
opt = torch.optim.SGD(torch.nn.Linear(2, 1).parameters(), lr=0.1)
for _ in range(2 if rank == 1 else 8):
    opt.step()
print(f"ready {rank}", flush=True)
def idle(flag, talk):
    while not os.path.exists(flag):
        print("tick", flush=True) if talk else None; time.sleep(0.2)
idle(sys.argv[1], rank != 1)
"""

FAIL = """
import os, sys
rank = int(os.environ["RANK"])
print(f"hello from {rank}", flush=True)
if rank == 1:
    print("boom-line on rank 1", file=sys.stderr, flush=True)
    sys.exit(3)
"""


def monarch(job: Job, *args: str, timeout: float = 60) -> subprocess.CompletedProcess:
    env = {**os.environ, "MONARCH_STATE": str(job.path)}
    return subprocess.run(
        [sys.executable, "-m", "monarch_cli", *args], env=env, capture_output=True, text=True, timeout=timeout
    )


def wait_for(what: Callable[[], Any], timeout: float = 60.0, why: str = "") -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = what()
        if value:
            return value
        time.sleep(0.2)
    raise AssertionError(f"timed out waiting for {why}")


def in_background(job: Job, script: Path, *args: str, nproc: int) -> dict[str, Run]:
    box: dict[str, Run] = {}
    t = threading.Thread(target=lambda: box.setdefault("run", spmd(job, script, *args, nproc=nproc)), daemon=True)
    t.start()
    box["thread"] = t  # type: ignore[assignment]
    return box


def ready_lines(job: Job) -> int:
    try:
        rows = job.sql(
            "SELECT count(*) AS n FROM logs WHERE run_id = (SELECT max(run_id) FROM runs WHERE ended_at IS NULL) "
            "AND line LIKE 'ready %'"
        )  # of the run in progress, not the previous one
    except Exception:  # noqa: BLE001 - the store may not exist yet
        return 0
    return rows[0]["n"]


def test_hung_rank_stacks_diagnose_top_and_reading_while_the_run_writes(job: Job, tmp_path: Path) -> None:
    script = tmp_path / "hang.py"
    script.write_text(HANG)
    flag = tmp_path / "release"
    box = in_background(job, script, str(flag), "2", nproc=2)
    try:
        wait_for(lambda: ready_lines(job) == 4, why="4 ranks to print ready")
        # a second process reads while the run's writer is active: the store is in WAL mode
        assert monarch(job, "sql", "PRAGMA journal_mode").stdout.split()[1] == "wal"
        done = monarch(
            job,
            "sql",
            "--json",
            "SELECT rank, line FROM logs WHERE run_id = (SELECT max(run_id) FROM runs) ORDER BY rank",
        )
        assert done.returncode == 0, done.stderr
        assert [r["line"] for r in json.loads(done.stdout)] == [f"ready {r}" for r in range(4)]
        assert job.sql("SELECT ended_at FROM runs ORDER BY run_id DESC LIMIT 1")[0]["ended_at"] is None

        report = job.stacks()
        assert [s.rank for s in report.stacks] == [0, 1, 2, 3]
        assert {s.method for s in report.stacks} == {"py-spy"}, [s.error for s in report.stacks]
        assert [g.ranks for g in report.groups] == [[0, 1, 3], [2]]
        assert report.groups[0].summary.startswith("barrier ← hang.py:")
        assert report.groups[1].summary.startswith("stuck_in_data_loader ← hang.py:")

        shown = monarch(job, "stack")
        assert shown.returncode == 0, shown.stderr
        assert "3 ranks (0-1,3): barrier ← hang.py:" in shown.stdout
        assert "1 rank (2): stuck_in_data_loader ← hang.py:" in shown.stdout

        # --ranks picks ranks, --json gives every rank's every thread, --native adds C frames
        picked = monarch(job, "stack", "--ranks", "1-2", "--json")
        assert picked.returncode == 0, picked.stderr
        data = json.loads(picked.stdout)
        assert [g["ranks"] for g in data["groups"]] == [[1], [2]], data["groups"]
        assert [r["rank"] for r in data["ranks"]] == [1, 2]
        assert all(any(t["main"] and t["frames"] for t in r["threads"]) for r in data["ranks"]), data["ranks"]
        native = monarch(job, "stack", "--native", "--ranks", "0", "--json")
        assert native.returncode == 0, native.stderr
        frames = [f for t in json.loads(native.stdout)["ranks"][0]["threads"] for f in t["frames"]]
        assert any(f["file"] and not f["file"].endswith(".py") for f in frames), frames  # a native frame
        assert any(f["function"] == "barrier" for f in frames), frames

        verdict = monarch(job, "diagnose", "--json")
        assert verdict.returncode == 1, verdict.stdout + verdict.stderr
        d = json.loads(verdict.stdout)
        assert d["verdict"] == "suspect" and [s["rank"] for s in d["suspects"]] == [2]
        assert "stuck_in_data_loader" in d["suspects"][0]["reasons"][0]

        # every capture is stored: ours, the CLI's and diagnose's
        rows = job.sql(
            "SELECT count(DISTINCT capture_id) AS n, count(DISTINCT rank) AS r FROM stacks WHERE is_main = 1 "
            "AND run_id = (SELECT max(run_id) FROM runs)"
        )
        assert rows[0]["n"] >= 3 and rows[0]["r"] == 4

        wait_for(
            lambda: (
                job.sql("SELECT count(DISTINCT rank) AS n FROM samples WHERE run_id = (SELECT max(run_id) FROM runs)")[
                    0
                ]["n"]
                == 4
            ),
            why="samples of all 4 ranks",
        )
        top = monarch(job, "top", "--once", "--json")
        assert top.returncode == 0, top.stderr
        ranks = json.loads(top.stdout)["ranks"]
        assert sorted(r["rank"] for r in ranks) == [0, 1, 2, 3]
        assert all(r["rss_mb"] and r["rss_mb"] > 10 and r["last_line"].startswith("ready") for r in ranks)
        assert all(r["gpu_util"] is None for r in ranks)  # no GPU here
        gpu = job.sql(
            "SELECT count(*) AS n, count(gpu_index) + count(gpu_util) + count(gpu_mem_mb) + count(gpu_power_w) "
            "+ count(gpu_temp_c) AS gpu FROM samples WHERE run_id = (SELECT max(run_id) FROM runs)"
        )[0]
        assert gpu["n"] >= 4 and gpu["gpu"] == 0, gpu  # GPU columns stay NULL without a GPU
        sampled = job.sql(
            "SELECT rank, pid, state, threads, rss_mb, cpu_percent FROM samples "
            "WHERE run_id = (SELECT max(run_id) FROM runs) ORDER BY ts DESC LIMIT 4"
        )
        # a live rank's state ("tracing-stop" while a stack capture holds it, "disk-sleep"...), never a dead one
        assert all(
            r["pid"]
            and r["state"]
            and r["state"] not in ("zombie", "dead")
            and r["threads"] >= 1
            and r["rss_mb"] > 10
            and r["cpu_percent"] is not None
            for r in sampled
        ), sampled
    finally:
        flag.write_text("")
        box["thread"].join(120)  # type: ignore[attr-defined]
    run = box["run"]
    assert run.result.exit_code == 0, run.text()
    after = job.sql("SELECT exit_code, world_size, ended_at FROM runs WHERE run_id = ?", (run.result.run_id,))
    assert after[0]["exit_code"] == 0 and after[0]["world_size"] == 4 and after[0]["ended_at"] is not None
    healthy = monarch(job, "diagnose")
    assert healthy.returncode == 0 and "healthy" in healthy.stdout, healthy.stdout + healthy.stderr


def test_a_lagging_silent_rank_comes_first_in_top_and_diagnose_names_it(job: Job, tmp_path: Path) -> None:
    script = _write(tmp_path, "lagging.py", LAGGING)
    flag = tmp_path / "release"
    box = in_background(job, script, str(flag), nproc=2)
    try:
        wait_for(lambda: ready_lines(job) == 4, why="4 ranks to print ready")
        ready_at = time.monotonic()
        top = wait_for(
            lambda: _top_json(job) if all(r["step"] for r in _top_json(job)["ranks"]) else None,
            why="every rank's steps",
        )
        ranks = top["ranks"]
        assert [r["step"] for r in sorted(ranks, key=lambda r: r["rank"])] == [8, 2, 8, 8], ranks
        assert ranks[0]["rank"] == 1 and "at step 2 while the others reached 8" in ranks[0]["suspect"], ranks
        assert not any(r["suspect"] for r in ranks[1:]), ranks
        text = monarch(job, "top", "--once")
        assert text.returncode == 0 and "rank 1: at step 2" in text.stdout, text.stdout + text.stderr
        time.sleep(max(0.0, 5.0 - (time.monotonic() - ready_at)))  # rank 1 silent for over 4 s
        verdict = monarch(job, "diagnose", "--silence", "4", "--json")
        assert verdict.returncode == 1, verdict.stdout + verdict.stderr
        d = json.loads(verdict.stdout)
        assert [s["rank"] for s in d["suspects"]] == [1], d
        reasons = " / ".join(d["suspects"][0]["reasons"])
        assert "at step 2 while the others reached 8" in reasons and "no output for" in reasons, [
            (r["rank"], r["output_age"], r["last_line"]) for r in d["evidence"]["ranks"]
        ]
        assert [g["ranks"] for g in d["evidence"]["stack_groups"]] == [[0, 1, 2, 3]], d["evidence"]
    finally:
        flag.write_text("")
        box["thread"].join(120)  # type: ignore[attr-defined]
    assert box["run"].result.exit_code == 0, box["run"].text()


def _top_json(job: Job) -> dict[str, Any]:
    done = monarch(job, "top", "--once", "--json")
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


def test_top_live_view_refreshes_until_ctrl_c(job: Job, tmp_path: Path) -> None:
    if not db_path(job.path.parent).exists():
        spmd(job, _write(tmp_path, "ok.py", "print('x')"), nproc=1)
    import pty
    import select

    # On a terminal (a pty), where the view redraws; Ctrl-C once it has drawn twice (not after a
    # sleep: a slow start would take the signal in its imports).
    env = {**os.environ, "MONARCH_STATE": str(job.path), "COLUMNS": "120", "TERM": "xterm"}
    env.pop("NO_COLOR", None)
    screen, terminal = pty.openpty()
    live = subprocess.Popen(
        [sys.executable, "-m", "monarch_cli", "top", "--interval", "0.2"],
        env=env,
        stdout=terminal,
        stderr=subprocess.PIPE,
        text=True,
    )
    os.close(terminal)
    out = b""
    deadline = time.monotonic() + 120
    try:
        frames = re.compile(rb"run \d{8}-\d{9}-")  # each drawing's title
        while len(frames.findall(out)) < 2 and time.monotonic() < deadline and live.poll() is None:
            if select.select([screen], [], [], 1.0)[0]:
                try:
                    out += os.read(screen, 65536)
                except OSError:  # the view's side closed
                    break
        assert len(frames.findall(out)) >= 2, out[-2000:]  # the view drew, then drew again
        live.send_signal(signal.SIGINT)
        _, err = live.communicate(timeout=60)
    finally:
        if live.poll() is None:
            live.kill()
        os.close(screen)
    assert live.returncode == 0 and "Traceback" not in err, err


def test_a_failing_rank_exit_codes_and_logs_are_queryable(job: Job, tmp_path: Path) -> None:
    script = tmp_path / "fail.py"
    script.write_text(FAIL)
    run = spmd(job, script, nproc=2)
    assert run.result.exit_code == 3
    rid = run.result.run_id
    ranks = {
        r["rank"]: r for r in job.sql("SELECT rank, exit_code, status, how, pid FROM ranks WHERE run_id = ?", (rid,))
    }
    assert ranks[1]["exit_code"] == 3 and ranks[1]["how"] == "exit 3" and ranks[1]["pid"], ranks
    assert ranks[0]["status"] in (0, 143), ranks  # finished, or stopped after rank 1 failed
    lines = job.sql("SELECT rank, stream, line FROM logs WHERE run_id = ? ORDER BY rank, ts", (rid,))
    assert {"rank": 1, "stream": "stderr", "line": "boom-line on rank 1"} in lines, lines
    assert {"rank": 0, "stream": "stdout", "line": "hello from 0"} in lines, lines
    events = job.sql("SELECT kind FROM events WHERE run_id = ? AND rank = 1", (rid,))
    assert events == [{"kind": "rank_failed"}], events
    kinds = [e["kind"] for e in job.sql("SELECT kind FROM events WHERE run_id = ? ORDER BY ts", (rid,))]
    assert kinds[0] == "run_start" and kinds[-1] == "run_end", kinds
    hosts = job.sql("SELECT node, host, agent, agent_pid, cpus, gpus FROM hosts WHERE run_id = ? ORDER BY node", (rid,))
    assert [h["node"] for h in hosts] == [0, 1] and all(h["agent"] and h["agent_pid"] and h["cpus"] for h in hosts), (
        hosts
    )
    assert all(h["gpus"] in (0, None) for h in hosts), hosts  # no GPU here
    run_row = job.sql("SELECT exit_code, world_size, hosts, command FROM runs WHERE run_id = ?", (rid,))[0]
    assert run_row["exit_code"] == 3 and run_row["world_size"] == 4 and run_row["hosts"] == 2, run_row
    assert "fail.py" in run_row["command"], run_row
    d = job.diagnose()
    assert d.exit_code == 1 and d.suspects[0].rank == 1 and "boom-line" in d.summary, d
    csv_out = monarch(job, "sql", "--csv", f"SELECT rank, exit_code FROM ranks WHERE run_id = '{rid}' ORDER BY rank")
    assert csv_out.stdout.splitlines()[0] == "rank,exit_code" and "1,3" in csv_out.stdout.splitlines(), csv_out


def test_sql_refuses_writes_and_bad_queries_in_one_line(job: Job, tmp_path: Path) -> None:
    if not db_path(job.path.parent).exists():
        spmd(job, _write(tmp_path, "ok.py", "print('x')"), nproc=1)
    before = job.sql("SELECT count(*) AS n FROM runs")[0]["n"]
    copy = tmp_path / "copy.db"
    refusals = {
        "DELETE FROM runs": "read-only",
        "DROP TABLE logs": "read-only",
        "UPDATE runs SET exit_code = 9": "read-only",
        "CREATE TABLE x(a)": "read-only",
        "WITH old AS (SELECT run_id FROM runs) DELETE FROM runs": "read-only",
        "INSERT INTO runs (run_id) VALUES ('x') RETURNING run_id": "read-only",
        f"ATTACH DATABASE '{tmp_path / 'other.db'}' AS o": "ATTACH",
        f"VACUUM INTO '{copy}'": "VACUUM",
        "PRAGMA journal_mode=DELETE": "PRAGMA journal_mode",
        "PRAGMA user_version=9": "PRAGMA user_version",
        "PRAGMA query_only=0": "PRAGMA query_only",
        "PRAGMA wal_checkpoint(TRUNCATE)": "PRAGMA wal_checkpoint",
        "SELECT 1; DELETE FROM runs": "one statement at a time",
    }
    for statement, why in refusals.items():
        one_line_error(monarch(job, "sql", statement), "sql:", why)
    assert job.sql("SELECT count(*) AS n FROM runs")[0]["n"] == before
    assert not (tmp_path / "other.db").exists() and not copy.exists()
    assert (
        job.sql("PRAGMA journal_mode") == [{"journal_mode": "wal"}]
        and job.sql("PRAGMA user_version")[0]["user_version"] == 1
    )
    assert [r["name"] for r in job.sql("PRAGMA table_info(steps)")] == ["run_id", "rank", "step", "ts", "dt_ms"]
    one_line_error(monarch(job, "sql", "SELECT * FROM no_such_table"), "no such table")
    schema = monarch(job, "sql", "--schema")
    assert schema.returncode == 0
    for table in ("runs", "ranks", "logs", "hosts", "events", "samples", "steps", "stacks"):
        assert f"\n{table}: " in schema.stdout
    assert "Examples:" in schema.stdout
    for example in json.loads(monarch(job, "sql", "--schema", "--json").stdout)["examples"]:
        assert monarch(job, "sql", example["sql"]).returncode == 0, example


@pytest.mark.parametrize("cold", [False, True], ids=["warm", "cold"])
def test_step_times_from_a_real_ddp_loop(job: Job, tmp_path: Path, cold: bool) -> None:
    """Warm ranks have torch already (hook installed at once); cold ones import it later (hook on import)."""
    nproc = 1 if cold else 2
    run = spmd(job, _write(tmp_path, "ddp.py", DDP), nproc=nproc, cold=cold)
    assert run.result.exit_code == 0, run.text()
    rows = job.sql(
        "SELECT rank, count(*) AS n, min(step) AS first, max(step) AS last, min(dt_ms) AS fastest "
        "FROM steps WHERE run_id = ? GROUP BY rank ORDER BY rank",
        (run.result.run_id,),
    )
    assert [(r["rank"], r["n"], r["first"], r["last"]) for r in rows] == [(r, 6, 1, 6) for r in range(2 * nproc)]
    assert all(r["fastest"] > 0 for r in rows)


def test_every_step_of_a_long_loop_is_recorded(job: Job, tmp_path: Path) -> None:
    """More steps than the step file first holds (4096): it grows, and none is lost or repeated."""
    script = _write(
        tmp_path,
        "many.py",
        """
        import torch
        opt = torch.optim.SGD(torch.nn.Linear(2, 1).parameters(), lr=0.1)
        for _ in range(10000):
            opt.step()
    """,
    )
    run = spmd(job, script, nproc=1)
    assert run.result.exit_code == 0, run.text()
    rows = job.sql(
        "SELECT rank, count(*) AS n, count(DISTINCT step) AS d, min(step) AS lo, max(step) AS hi, "
        "min(ts) > 0 AS stamped FROM steps WHERE run_id = ? GROUP BY rank",
        (run.result.run_id,),
    )
    assert rows == [{"rank": r, "n": 10000, "d": 10000, "lo": 1, "hi": 10000, "stamped": 1} for r in (0, 1)], rows


def test_telemetry_off_records_nothing(job: Job, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``MONARCH_TELEMETRY=0`` (the benchmark's reference): no rows, and no step hook in the ranks."""
    script = _write(
        tmp_path,
        "hooks.py",
        """
        import torch.optim.optimizer as optimizer
        print("hooks", len(optimizer._global_optimizer_post_hooks), flush=True)
    """,
    )
    for setting, hooks, rows in (("0", b"hooks 0", 0), ("1", b"hooks 1", 1)):
        monkeypatch.setenv("MONARCH_TELEMETRY", setting)
        run = spmd(job, script, nproc=1)
        assert run.result.exit_code == 0, run.text()
        assert {line for lines in run.by_rank().values() for line in lines} == {hooks}, run.text()
        assert job.sql("SELECT count(*) AS n FROM runs WHERE run_id = ?", (run.result.run_id,)) == [{"n": rows}]


def test_stacks_fall_back_to_the_interpreters_own_dump(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """py-spy that cannot attach. This container has no Yama (no kernel.yama.ptrace_scope to
    restrict), so the same refusal is made real another way: as root, py-spy runs as `nobody`
    and ptrace answers EPERM, exactly as under a restricted ptrace_scope; elsewhere a py-spy
    that fails stands in."""
    spy = py_spy_path()
    setpriv = shutil.which("setpriv")
    if os.geteuid() == 0 and spy and setpriv:
        wrapper = tmp_path / "py-spy-as-nobody"
        wrapper.write_text(f'#!/bin/sh\nexec {setpriv} --reuid=nobody --regid=nogroup --clear-groups {spy} "$@"\n')
        wrapper.chmod(0o700)
        monkeypatch.setenv("MONARCH_PY_SPY", str(wrapper))
    else:
        monkeypatch.setenv("MONARCH_PY_SPY", "/bin/false")
    j = serve(None, hosts=1, state=tmp_path / ".monarch" / "job_state.pkl")
    try:
        nothing = monarch(j, "diagnose", "--json")  # a reservation that has run nothing: cannot tell
        assert nothing.returncode == 2, nothing.stdout + nothing.stderr
        assert json.loads(nothing.stdout)["verdict"] == "unknown"
        script = _write(tmp_path, "hang.py", HANG)
        flag = tmp_path / "release"
        box = in_background(j, script, str(flag), "1", nproc=2)
        try:
            wait_for(lambda: ready_lines(j) == 2, why="2 ranks to print ready")
            report = j.stacks()
            assert {s.method for s in report.stacks} == {"faulthandler"}, [s.error for s in report.stacks]
            if os.environ["MONARCH_PY_SPY"] != "/bin/false":
                assert all("Permission Denied" in (s.fallback or "") for s in report.stacks), [
                    s.fallback for s in report.stacks
                ]
            assert [g.ranks for g in report.groups] == [[0], [1]] or [g.ranks for g in report.groups] == [[1], [0]]
            summaries = {g.ranks[0]: g.summary for g in report.groups}
            assert summaries[0].startswith("barrier ← hang.py:"), summaries
            assert summaries[1].startswith("stuck_in_data_loader ← hang.py:"), summaries
            stored = j.sql("SELECT DISTINCT method FROM stacks WHERE is_main = 1")
            assert stored == [{"method": "faulthandler"}]
        finally:
            flag.write_text("")
            box["thread"].join(120)  # type: ignore[attr-defined]
        assert box["run"].result.exit_code == 0, box["run"].text()  # the dump signal did not hurt the ranks
    finally:
        j.stop()


def test_retention_keeps_the_newest_runs(tmp_path: Path) -> None:
    path = tmp_path / "telemetry.db"
    for i in range(5):
        rid = f"run-{i}"
        w = TelemetryWriter(path, rid, keep_runs=3)
        w.sql("INSERT INTO runs (run_id) VALUES (?)", (rid,))
        w.rows("ranks", [(rid, 0, 0, 0, "h", 1, 0, None, 0, "exit 0", 1.0, 2.0, None, 0)])
        w.rows("hosts", [(rid, 0, "h", "tcp://h:1", 1, 2, 0)])
        w.rows("samples", [(rid, 0, "h", 1.0, 1, "sleeping", 0.0, 10.0, 1) + (None,) * 5])
        w.rows("steps", [(rid, 0, 1, 1.0, 5.0)])
        w.rows("stacks", [("c", rid, 0, "h", 1, 1.0, "py-spy", "MainThread", 1, "f (x.py:1)", None)])
        w.event("run_end", None, "exit 0")
        w.output(0, 1, b"line\npartial")
        w.end_of_rank(0)
        w.close()
    _, rows = query(path, "SELECT run_id FROM runs ORDER BY run_id")
    assert [r[0] for r in rows] == ["run-2", "run-3", "run-4"]
    _, logs = query(path, "SELECT run_id, line FROM logs ORDER BY run_id, rowid")
    assert logs == [(f"run-{i}", text) for i in (2, 3, 4) for text in ("line", "partial")]
    for table in ("ranks", "hosts", "samples", "steps", "stacks", "events"):  # every row of a pruned run goes
        _, kept = query(path, f"SELECT DISTINCT run_id FROM {table} ORDER BY run_id")
        assert [r[0] for r in kept] == ["run-2", "run-3", "run-4"], table
    assert oct(path.stat().st_mode & 0o777) == "0o600"


def test_every_table_and_column_the_issue_names_exists_and_schema_explains_it(tmp_path: Path) -> None:
    path = tmp_path / "telemetry.db"
    TelemetryWriter(path, "r").close()
    named = {
        "runs": ["run_id", "command", "started_at", "ended_at", "exit_code", "world_size"],
        "ranks": [
            "run_id",
            "rank",
            "local_rank",
            "host",
            "pid",
            "exit_code",
            "signal",
            "started_at",
            "ended_at",
            "last_output_at",
        ],
        "logs": ["run_id", "rank", "ts", "stream", "line"],
        "hosts": [],
        "events": [],
        "samples": [],
        "steps": ["run_id", "rank", "step", "ts", "dt_ms"],
        "stacks": [],
    }
    described = schema_json()["tables"]
    text = schema_text()
    for table, columns in named.items():
        _, info = query(path, f"SELECT name FROM pragma_table_info('{table}')")
        real = [r[0] for r in info]
        assert set(columns) <= set(real), (table, real)
        assert [c["name"] for c in described[table]["columns"]] == real  # --schema describes the real store
        assert all(c["meaning"] for c in described[table]["columns"])
        assert all(f"\n  {c:<15} " in text for c in real), table
    samples = [c["name"] for c in described["samples"]["columns"]]
    assert {"state", "cpu_percent", "rss_mb", "threads", "gpu_util", "gpu_mem_mb", "gpu_power_w", "gpu_temp_c"} <= set(
        samples
    )


def test_top_is_a_compact_grid_for_many_ranks() -> None:
    """Up to 32 ranks one row each; above, the suspects' rows and a grid of short cells for the rest."""
    from rich.console import Console

    from monarch_cli.cli.telemetry import GRID_ABOVE, _top_view

    def shown(n: int) -> str:
        console = Console(record=True, width=160)
        rows = [
            RankRow(r, "node-a", "sleeping", 12.0, 300.0, step=40, step_ms=9.5, output_age=1.0, last_line=f"loss {r}")
            for r in range(n)
        ]
        rows[n - 1].suspect = "at step 31 while the others reached 40"
        rows[n - 1].step = 31
        rows.insert(0, rows.pop())  # suspects first, as top() orders them
        console.print(_top_view("run-1", rows))
        return console.export_text()

    few, many = shown(4), shown(64)
    assert "last line" in few and all(f"loss {r}" in few for r in range(4))
    assert len(few.splitlines()) <= 4 + 4
    assert "rank 63: at step 31" in many and "loss 63" in many  # the suspect keeps its whole row
    assert "loss 0" not in many and len(many.splitlines()) <= 64 // 3  # the rest: a grid, not 63 rows
    cells = " ".join(many.splitlines())
    assert all(f" {r} sleeping  12%     40   1s" in f" {cells}" for r in range(63)) and "…" not in many, many
    assert shown(GRID_ABOVE).count("loss ") == GRID_ABOVE


def test_rank_ranges_compress() -> None:
    assert compress([3, 0, 1, 2, 5, 7, 8]) == "0-3,5,7-8"
    assert compress([4]) == "4"


def _write(tmp_path: Path, name: str, text: str) -> Path:
    path = tmp_path / name
    path.write_text(textwrap.dedent(text))
    return path


def test_diagnose_rules_for_silence_step_lag_and_idle_gpu() -> None:
    """The row-level rules `diagnose` and `top` share (the stack rule is shown with real ranks above)."""
    rows = [RankRow(r, output_age=2.0, step=40, gpu_util=95.0) for r in range(4)]
    assert suspicions(rows) == {}
    rows[1].output_age = 300.0
    rows[2].step = 31
    rows[3].gpu_util = 0.0
    found = suspicions(rows, silence=60.0)
    assert sorted(found) == [1, 2, 3]
    assert "no output for 300 s" in found[1][0]
    assert "at step 31 while the others reached 40" in found[2][0]
    assert "GPU idle" in found[3][0]
    # no GPU (NULL utilisation, as on this machine), or one rank's figure alone: no GPU verdict either way
    assert suspicions([RankRow(r, output_age=2.0, step=40) for r in range(4)]) == {}
    lone = [RankRow(r, output_age=2.0, step=40) for r in range(4)]
    lone[0].gpu_util = 0.0
    assert suspicions(lone) == {}


def _suspicions_by_definition(rows: list[RankRow], silence: float = 60.0) -> dict[int, list[str]]:
    """The rules written the plain way, each rank against a list of the others (quadratic in ranks):
    the reference the fast version must agree with."""
    import statistics

    out: dict[int, list[str]] = {}
    if len(rows) < 2:
        return out
    ages = [r.output_age for r in rows if r.output_age is not None]
    steps = [r.step or 0 for r in rows]
    gpus = [r.gpu_util for r in rows if r.gpu_util is not None]
    for r in rows:
        others = [o for o in rows if o is not r]
        if r.output_age is not None and r.output_age > silence and len(ages) == len(rows):
            recent = [o.output_age for o in others if o.output_age is not None and o.output_age < silence / 2]
            if len(recent) > len(others) / 2:
                out.setdefault(r.rank, []).append(
                    f"no output for {r.output_age:.0f} s while the others printed within {max(recent):.0f} s"
                )
        top = max(steps)
        if top >= 2 and top - (r.step or 0) >= 2 and statistics.median(o.step or 0 for o in others) >= top - 1:
            out.setdefault(r.rank, []).append(f"at step {r.step or 0} while the others reached {top}")
        if r.gpu_util is not None and r.gpu_util < 10 and len(gpus) >= 2:
            busy = [o.gpu_util for o in others if o.gpu_util is not None]
            if busy and statistics.median(busy) > 50:
                out.setdefault(r.rank, []).append(
                    f"GPU idle ({r.gpu_util:.0f} %) while the others are busy (median {statistics.median(busy):.0f} %)"
                )
    return out


def test_diagnose_rules_agree_with_their_definition_on_many_shapes() -> None:
    """`diagnose` at 1,024 hosts x 8 ranks computes the others' aggregates once; its verdicts must be
    those of the plain rules, on small and even/odd counts, ties, missing figures, and a large set."""
    import random

    rng = random.Random(23)
    for trial in range(300):
        n = rng.choice([2, 3, 4, 5, 8, 9, 16, 33]) if trial < 290 else 600
        rows = []
        for r in range(n):
            row = RankRow(r)
            if rng.random() < 0.95 or trial % 3:
                row.output_age = rng.choice([1.0, 2.0, 29.0, 31.0, 61.0, 300.0, rng.uniform(0, 400)])
            row.step = rng.choice([None, 0, 1, 2, 39, 40, 40, 41, rng.randint(0, 50)])
            if trial % 2:
                row.gpu_util = rng.choice([None, 0.0, 5.0, 9.9, 10.0, 51.0, 95.0, rng.uniform(0, 100)])
            rows.append(row)
        for silence in (60.0, 30.0):
            assert suspicions(rows, silence) == _suspicions_by_definition(rows, silence), (trial, silence)
    # the shape diagnose meets at scale: 8,192 ranks, two of them lagging (once quadratic, now linear)
    rows = [RankRow(r, output_age=1.0, step=40, gpu_util=90.0) for r in range(8192)]
    rows[17].output_age, rows[802].step = 120.0, 3
    found = suspicions(rows)
    assert found == _suspicions_by_definition(rows)
    assert sorted(found) == [17, 802]


def test_sql_without_a_store_is_one_line(tmp_path: Path) -> None:
    env = {**os.environ, "MONARCH_STATE": str(tmp_path / ".monarch" / "job_state.pkl")}
    done = subprocess.run(
        [sys.executable, "-m", "monarch_cli", "sql", "SELECT 1"], env=env, capture_output=True, text=True
    )
    one_line_error(done, "no telemetry store")


def test_a_flood_of_output_is_committed_as_it_comes_and_bounded_in_memory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """More output queued than one transaction takes: rows become visible to a reader while the
    rest still waits (a round once ran until the queue was empty, which under a flood it never
    was: nothing was committed), and what waits stays under the writer's byte bound (the rest
    is counted, in the rank logs only)."""
    from monarch_cli.telemetry import writer as writer_module

    monkeypatch.setattr(writer_module, "MAX_QUEUED_BYTES", 8 << 20)
    writer = TelemetryWriter(db_path(tmp_path), "run-flood", start=False)
    chunk = b"step ok\n" * 4
    for _ in range(300_000):  # ~10 MB: past the bound, and many transactions' worth of items
        writer.output(0, 1, chunk)
    assert writer._queued_bytes <= 8 << 20 and writer.bytes_left_out > 0
    writer.start()
    deadline = time.monotonic() + 120
    while True:  # read by another connection, as `monarch sql` would
        assert time.monotonic() < deadline, "nothing committed"
        waiting = len(writer._queue)
        try:
            seen = query(db_path(tmp_path), "SELECT count(*) FROM logs")[1][0][0]
        except Exception:  # noqa: BLE001 - the store may not exist yet
            seen = 0
        if seen:
            break
        time.sleep(0.02)
    assert waiting > 0, "the first rows were committed only once nothing was left to write"
    writer.close(timeout=120)
    events = query(db_path(tmp_path), "SELECT kind, detail FROM events")[1]
    assert any(kind == "output_left_out" for kind, _ in events), events
