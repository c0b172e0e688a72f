"""`monarch mcp` driven by the MCP SDK's own stdio client, as an agent's client would drive it.

Real everything: the server is `python -m monarch_cli mcp` in a subprocess, the reservation is
two local hosts with real agents, ranks run real torch (gloo, CPU). Nothing is mocked.
"""

from __future__ import annotations

import json
import os
import sqlite3
import subprocess
import sys
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import anyio
import psutil
import pytest
from mcp import ClientSession, StdioServerParameters, stdio_client

from ..conftest import REPO, all_gone, wait_until, write_script

pytestmark = pytest.mark.slow

DDP = """
import sys, torch, torch.distributed as dist
dist.init_process_group("gloo")
model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(8, 1))
opt = torch.optim.SGD(model.parameters(), lr=0.01)
for step in range(5):
    opt.zero_grad()
    model(torch.randn(16, 8)).sum().backward()
    opt.step()
    print(f"rank {dist.get_rank()} step {step}", flush=True)
if dist.get_rank() == 2 and len(sys.argv) > 1 and sys.argv[1] == "--fail":
    raise ValueError("bad batch on rank 2")
dist.barrier()
dist.destroy_process_group()
"""

# Every rank prints, then rank 1 waits in a function of its own until the flag file exists,
# while the others wait for it in a barrier: a run that outlives wait_s, with a suspect.
HANG = """
import os, sys, time, torch.distributed as dist
dist.init_process_group("gloo")
def waiting_for_the_flag(flag):
    while not os.access(flag, os.F_OK):  # a C call: a sampled stack has this function innermost
        time.sleep(0.05)
print(f"ready {dist.get_rank()}", flush=True)
if dist.get_rank() == 1:
    waiting_for_the_flag(sys.argv[1])
dist.barrier()
print("released", flush=True)
dist.destroy_process_group()
"""

LONG = """
import time
print("working", flush=True)
time.sleep(600)
"""

CRASH = """
import os
answer = 41 + int(os.environ["RANK"])
raise RuntimeError(f"rank {os.environ['RANK']} crashed")
"""

BIG_WAIT = 240  # seconds: a loaded 2-core machine may take long to start torch


class Agent:
    """The client side: calls tools, keeps every result (to check what the server ever returned)."""

    def __init__(self, session: ClientSession) -> None:
        self.session = session
        self.seen: list[str] = []
        self.progress: list[str] = []

    async def call(self, name: str, args: dict[str, Any] | None = None) -> tuple[dict[str, Any], str, bool]:
        values: list[float] = []

        async def on_progress(progress: float, total: float | None, message: str | None) -> None:
            values.append(progress)
            self.progress.append(message or "")

        res = await self.session.call_tool(name, args or {}, progress_callback=on_progress)
        assert values == sorted(set(values)), values  # progress only grows
        text = "".join(c.text for c in res.content if c.type == "text")
        data = res.structured_content or {}
        self.seen.append(text + json.dumps(data))
        return data, text, res.is_error

    async def ok(self, name: str, args: dict[str, Any] | None = None) -> dict[str, Any]:
        data, text, error = await self.call(name, args)
        assert not error, f"{name} {args}: {text}"
        return data

    async def refused(self, name: str, args: dict[str, Any] | None = None) -> str:
        """An error result: one line of ours, no traceback, and the server lives on."""
        data, text, error = await self.call(name, args)
        assert error, f"{name} {args} was not refused: {text}"
        assert "Traceback" not in text and "\n" not in text.strip(), text
        assert data["error"] == text and data["kind"] != "internal", data
        return text


def _server_params(cwd: Path) -> StdioServerParameters:
    env = {k: v for k, v in os.environ.items() if k.startswith("MONARCH_") or k in ("PATH", "HOME", "TMPDIR")}
    env["PYTHONPATH"] = str(REPO)
    return StdioServerParameters(command=sys.executable, args=["-m", "monarch_cli", "mcp", "-v"], env=env, cwd=cwd)


def _servers() -> list[psutil.Process]:
    return [
        p
        for p in psutil.Process().children(recursive=True)
        if "monarch_cli" in " ".join(p.cmdline()) and "mcp" in p.cmdline()
    ]


@asynccontextmanager
async def connected(cwd: Path, errlog: Path) -> AsyncIterator[Agent]:
    with open(errlog, "a") as err:
        async with stdio_client(_server_params(cwd), errlog=err) as (read, write):
            async with ClientSession(read, write) as session:
                await session.initialize()
                yield Agent(session)


def _runner_pids(project: Path) -> list[int]:
    records = (project / ".monarch" / "mcp" / "runs").glob("*.json")
    return [json.loads(p.read_text())["pid"] for p in records]


def test_tools_are_listed_for_an_agent_and_bad_calls_are_one_line(tmp_path: Path) -> None:
    async def session() -> None:
        async with connected(tmp_path, tmp_path / "server.log") as agent:
            tools = {t.name: t for t in (await agent.session.list_tools()).tools}
            assert set(tools) == {
                "serve",
                "run_spmd",
                "wait_run",
                "cancel_run",
                "logs",
                "status",
                "sql",
                "stack",
                "diagnose",
                "exec",
                "debug_list",
                "debug_cast",
                "warm",
                "stop",
            }
            for t in tools.values():
                assert len(t.description) > 80 and t.input_schema["type"] == "object", t.name
            hints = {n: (t.annotations.read_only_hint, t.annotations.destructive_hint) for n, t in tools.items()}
            for name in ("stop", "cancel_run", "exec", "run_spmd", "serve", "debug_cast"):
                assert hints[name] == (False, True), name  # each may end a run or run code on every host
            for name in ("status", "sql", "logs", "stack", "diagnose", "wait_run", "debug_list"):
                assert hints[name][0] is True, name
            assert tools["run_spmd"].input_schema["properties"]["wait_s"]["type"] == "number"

            status = await agent.ok("status")  # nothing served here yet: not an error
            assert status["reservation"] is None
            assert "no tool 'nope'" in await agent.refused("nope")
            assert "wait_s" in await agent.refused("run_spmd", {"wait_s": "soon"})
            assert "'typo' was unexpected" in await agent.refused("logs", {"typo": 1})
            assert "no reservation" in await agent.refused("run_spmd")
            assert "no reservation" in await agent.refused("stack")
            for tool in ("cancel_run", "wait_run"):  # a run id names files: never a path
                assert "does not match" in await agent.refused(tool, {"run_id": "../../../tmp/planted"})
            plan = await agent.ok("serve", {"hosts": 2, "command": ["python", "t.py"], "dry_run": True})
            assert plan["scheduler"] == "local" and plan["hosts"] == 2  # the plan, nothing started
            assert not (tmp_path / ".monarch" / "job_state.pkl").exists()
            assert (await agent.ok("status"))["reservation"] is None  # and the server lives on

    anyio.run(session)
    assert wait_until(lambda: not _servers(), 10), "the server outlived its client"


def test_a_session_serve_run_fail_diagnose_rerun_cancel_stop(tmp_path: Path) -> None:
    project = tmp_path / "project"
    write_script(project, "train.py", DDP)
    write_script(project, "hang.py", HANG)
    write_script(project, "long.py", LONG)
    flag = tmp_path / "release"
    facts: dict[str, Any] = {}

    async def session() -> None:
        async with connected(project, tmp_path / "server.log") as agent:
            served = await agent.ok("serve", {"hosts": 2, "command": "torchrun --nproc-per-node=2 train.py"})
            assert [h["alive"] for h in served["hosts"]] == [True, True]
            facts["keys"] = _keys(project)

            # a run to its end: the same object `monarch run-spmd --json` prints, plus state and groups
            run = await agent.ok("run_spmd", {"wait_s": BIG_WAIT})
            assert run["state"] == "finished" and run["exit_code"] == 0, run
            assert run["rank_groups"] == [{"ranks": "0-3", "count": 4, "status": 0, "how": "exit 0"}]
            on_disk = json.loads((Path(run["log_dir"]) / "result.json").read_text())
            assert {k: run[k] for k in on_disk} == on_disk
            assert any("started" in p for p in agent.progress)

            logs = await agent.ok("logs", {"rank": 3, "tail": 2})
            assert [l["line"] for l in logs["ranks"][0]["lines"]] == ["rank 3 step 3", "rank 3 step 4"]
            assert logs["ranks"][0]["lines_left_out"] == 3 and logs["logs"] == {"rank3": logs["logs"]["rank3"]}
            grep = await agent.ok("logs", {"grep": r"step [04]$", "tail": 10})
            assert [r["matched"] for r in grep["ranks"]] == [2, 2, 2, 2]

            rows = await agent.ok("sql", {"query": "SELECT rank, status FROM ranks ORDER BY rank"})
            assert rows["rows"] == [{"rank": r, "status": 0} for r in range(4)] and rows["row_count"] == 4
            before = await agent.ok("sql", {"query": "SELECT count(*) AS n FROM logs"})
            for write in (
                "DELETE FROM logs",
                "UPDATE runs SET exit_code = 9",
                "DROP TABLE runs",
                "PRAGMA user_version=7",
            ):
                assert "read-only" in await agent.refused("sql", {"query": write})
            assert await agent.ok("sql", {"query": "SELECT count(*) AS n FROM logs"}) == before
            assert before["rows"][0]["n"] >= 20

            # keep_ranks: the second such run runs in the first one's processes
            kept = [(await agent.ok("run_spmd", {"keep_ranks": True, "wait_s": BIG_WAIT}))["run_id"] for _ in range(2)]
            pids = [
                (await agent.ok("sql", {"query": f"SELECT rank, pid FROM ranks WHERE run_id = '{r}' ORDER BY rank"}))[
                    "rows"
                ]
                for r in kept
            ]
            assert pids[0] == pids[1] and len(pids[0]) == 4, pids

            # a failing rank: named in the result, and diagnose says which and why
            failed = await agent.ok(
                "run_spmd", {"command": "torchrun --nproc-per-node=2 train.py --fail", "wait_s": BIG_WAIT}
            )
            assert failed["state"] == "finished" and failed["exit_code"] == 1 and failed["first_failure"] == 2
            assert failed["tail"]["rank"] == 2 and "ValueError: bad batch on rank 2" in failed["tail"]["lines"][-1]
            assert sum(g["count"] for g in failed["rank_groups"]) == 4  # the others failed after it, or were ended
            assert all(g["status"] != 0 for g in failed["rank_groups"]), failed["rank_groups"]
            verdict = await agent.ok("diagnose")
            assert verdict["verdict"] == "suspect" and verdict["suspects"][0]["rank"] == 2, verdict

            # a run that outlives wait_s: its progress now, wait_run picks it up later
            hang = await agent.ok("run_spmd", {"command": f"torchrun --nproc-per-node=2 hang.py {flag}", "wait_s": 3})
            assert hang["state"] in ("starting", "running"), hang
            run_id = hang["run_id"]
            while True:  # every rank printed "ready": rank 1 is in its own function, the rest in the barrier
                hang = await agent.ok("wait_run", {"run_id": run_id, "wait_s": 2})
                if (hang.get("lines") or 0) >= 4:
                    break
                assert hang["state"] in ("starting", "running"), hang
            assert any(f"run {run_id} running, 0/4 ranks exited" in p for p in agent.progress), agent.progress
            stacks = await agent.ok("stack")
            assert stacks["run_id"] == run_id
            assert any(g["ranks"] == [1] and "waiting_for_the_flag" in g["summary"] for g in stacks["groups"]), stacks
            hung = await agent.ok("diagnose")  # rank 1 is elsewhere than the rest
            assert [s["rank"] for s in hung["suspects"]] == [1], hung
            flag.write_text("go")
            done = await agent.ok("wait_run", {"run_id": run_id, "wait_s": BIG_WAIT})
            assert done["state"] == "finished" and done["exit_code"] == 0 and done["run_id"] == run_id

            # exec on every host, then a run cancelled
            ran = await agent.ok("exec", {"command": "echo hello from $(hostname)"})
            assert ran["exit_code"] == 0 and len(ran["ranks"]) == 2
            long = await agent.ok("run_spmd", {"command": "python long.py", "wait_s": 0})
            while (await agent.ok("wait_run", {"run_id": long["run_id"], "wait_s": 1})).get("lines", 0) < 2:
                pass
            cancelled = await agent.ok("cancel_run", {"run_id": long["run_id"], "wait_s": BIG_WAIT})
            assert cancelled["state"] == "finished" and cancelled["exit_code"] == 128 + 15, cancelled
            assert "received SIGTERM" in cancelled["ending"]
            assert "already ended" in await agent.refused("cancel_run", {"run_id": long["run_id"]})

            agents = await agent.ok("sql", {"query": "SELECT DISTINCT agent_pid FROM hosts"})
            facts["agents"] = [r["agent_pid"] for r in agents["rows"]]
            facts["server"] = [p.pid for p in _servers()]
            stopped = await agent.ok("stop")
            assert stopped["stopped"] == served["reservation_id"]
            assert (await agent.ok("status"))["reservation"] is None
            facts["seen"] = agent.seen

    anyio.run(session)
    # nothing left running: the server, the runs' processes, the agents (and with them every rank)
    assert facts["server"] and wait_until(lambda: all_gone(facts["server"]), 10)
    assert wait_until(lambda: all_gone(_runner_pids(project)), 30)
    assert wait_until(lambda: all_gone(facts["agents"]), 30)
    # and no result ever held the reservation's keys
    assert not any(k in text for k in facts["keys"] for text in facts["seen"])


def test_a_run_outlives_its_server_and_a_new_server_picks_it_up(tmp_path: Path) -> None:
    project = tmp_path / "project"
    write_script(project, "hang.py", HANG)
    write_script(project, "long.py", LONG)
    flag = tmp_path / "release"
    ids: dict[str, Any] = {}

    async def first() -> None:
        async with connected(project, tmp_path / "server.log") as agent:
            await agent.ok("serve", {"hosts": 1})
            run = await agent.ok("run_spmd", {"command": f"torchrun --nproc-per-node=2 hang.py {flag}", "wait_s": 0})
            ids["run"] = run["run_id"]

    async def second() -> None:
        async with connected(project, tmp_path / "server.log") as agent:
            still = await agent.ok("wait_run", {"wait_s": 1})  # the latest run, from the record it left
            assert still["run_id"] == ids["run"] and still["state"] in ("starting", "running"), still
            flag.write_text("go")
            done = await agent.ok("wait_run", {"run_id": ids["run"], "wait_s": BIG_WAIT})
            assert done["state"] == "finished" and done["exit_code"] == 0, done

            # a run whose process is killed (kill -9, the OOM killer): lost, and said so in one line
            long = await agent.ok("run_spmd", {"command": "python long.py", "wait_s": 0})
            while (await agent.ok("wait_run", {"run_id": long["run_id"], "wait_s": 1})).get("lines", 0) < 1:
                pass
            record = project / ".monarch" / "mcp" / "runs" / f"{long['run_id']}.json"
            os.kill(json.loads(record.read_text())["pid"], 9)
            lost = await agent.refused("wait_run", {"run_id": long["run_id"], "wait_s": BIG_WAIT})
            assert "ended without a result" in lost
            await agent.ok("stop")

    anyio.run(first)
    assert wait_until(lambda: not _servers(), 10)
    runner = _runner_pids(project)
    assert runner and all(psutil.pid_exists(p) for p in runner)  # the run goes on without a server
    anyio.run(second)
    assert wait_until(lambda: all_gone(runner), 30)


def _keys(project: Path) -> list[str]:
    from monarch_cli.jobs import job_load

    keys = job_load(project / ".monarch" / "job_state.pkl").keys
    return [keys.secret.decode(), keys.public.decode()]


def test_sql_refusal_leaves_the_store_intact_even_for_tricks(tmp_path: Path) -> None:
    """ATTACH and VACUUM INTO would write elsewhere; a second statement would sneak a write in."""
    store = tmp_path / ".monarch" / "telemetry.db"
    store.parent.mkdir()
    with sqlite3.connect(store) as db:
        db.execute("CREATE TABLE runs (run_id TEXT)")
        db.execute("INSERT INTO runs VALUES ('r1')")

    async def session() -> None:
        async with connected(tmp_path, tmp_path / "server.log") as agent:
            for trick in (
                f"ATTACH DATABASE '{tmp_path / 'x.db'}' AS x",
                f"VACUUM INTO '{tmp_path / 'copy.db'}'",
                "SELECT 1; DELETE FROM runs",
                "INSERT INTO runs VALUES ('r2')",
            ):
                await agent.refused("sql", {"query": trick})
            assert (await agent.ok("sql", {"query": "SELECT run_id FROM runs"}))["rows"] == [{"run_id": "r1"}]

    anyio.run(session)
    assert not (tmp_path / "x.db").exists() and not (tmp_path / "copy.db").exists()
    with sqlite3.connect(store) as db:
        assert db.execute("SELECT run_id FROM runs").fetchall() == [("r1",)]


def test_debug_tools_reach_a_rank_paused_post_mortem(tmp_path: Path) -> None:
    project = tmp_path / "project"
    write_script(project, "crash.py", CRASH)

    async def session() -> None:
        async with connected(project, tmp_path / "server.log") as agent:
            await agent.ok("serve", {"hosts": 1})
            assert "no rank is paused" in await agent.refused("debug_cast", {"command": "p 1"})
            run = await agent.ok(
                "run_spmd", {"command": "torchrun --nproc-per-node=1 crash.py", "post_mortem": True, "wait_s": 0}
            )
            for _ in range(BIG_WAIT * 2):
                paused = (await agent.ok("debug_list"))["paused"]
                if paused and paused[0]["state"] == "paused":
                    break
                await anyio.sleep(0.5)
            assert [(p["rank"], p["run_id"]) for p in paused] == [(0, run["run_id"])], paused
            answer = await agent.ok("debug_cast", {"ranks": "0", "command": "p answer"})
            assert answer["0"]["output"].strip() == "41", answer
            await agent.ok("debug_cast", {"command": "c"})
            done = await agent.ok("wait_run", {"run_id": run["run_id"], "wait_s": BIG_WAIT})
            assert done["state"] == "finished" and done["exit_code"] == 1, done
            assert "RuntimeError: rank 0 crashed" in "\n".join(done["tail"]["lines"])
            # a run that cannot start is an error result with our one line; the next call works
            assert "nnodes" in await agent.refused(
                "run_spmd", {"command": "torchrun --nnodes=3 --nproc-per-node=1 crash.py"}
            )
            rows = await agent.ok("sql", {"query": "SELECT run_id FROM runs", "limit": 1})
            assert rows["row_count"] == 2 and len(rows["rows"]) == 1 and rows["rows_left_out"] == 1, rows
            await agent.ok("stop")

    anyio.run(session)


def test_cancel_run_signals_only_its_own_runner(tmp_path: Path) -> None:
    """A record naming another process (planted, or a runner whose pid was reused) makes
    cancel_run refuse: the process is left alone."""
    project = tmp_path / "project"
    records = project / ".monarch" / "mcp" / "runs"
    records.mkdir(parents=True, mode=0o700)
    run_id = "20261127-120000000-abcd"
    (project / ".monarch" / "logs" / run_id).mkdir(parents=True)
    bystander = subprocess.Popen(["sleep", "120"])
    try:
        record = {"run_id": run_id, "pid": bystander.pid, "started_at": time.time(), "command": None}
        (records / f"{run_id}.json").write_text(json.dumps({**record, "state": "running"}))

        async def session() -> str:
            async with connected(project, tmp_path / "server.log") as agent:
                return await agent.refused("cancel_run", {"run_id": run_id})

        said = anyio.run(session)
        assert "not its runner" in said, said
        assert bystander.poll() is None, "cancel_run signalled a process that is not its runner"
    finally:
        bystander.kill()
        bystander.wait()


def test_sql_clips_big_cells_as_it_reads_and_counts_past_a_trailing_comment(tmp_path: Path) -> None:
    """200 rows of 4 MB cells make a 1 MB answer (cells clipped to 2,000 characters), and the
    server never holds the 800 MB whole; a query ending in a `--` comment still gets its row count."""
    from monarch_cli.telemetry import TelemetryWriter, db_path

    project = tmp_path / "project"
    (project / ".monarch").mkdir(parents=True, mode=0o700)
    writer = TelemetryWriter(db_path(project / ".monarch"), "run-1")
    writer.output(0, 1, b"one line\n")
    writer.close()
    rows = "WITH RECURSIVE c(x) AS (SELECT 1 UNION ALL SELECT x + 1 FROM c LIMIT 200)"

    async def session() -> tuple[dict[str, Any], dict[str, Any], int]:
        async with connected(project, tmp_path / "server.log") as agent:
            big = await agent.ok("sql", {"query": f"{rows} SELECT x, printf('%.*c', 4000000, 'y') AS big FROM c"})
            counted = await agent.ok("sql", {"query": f"{rows} SELECT x FROM c -- every row", "limit": 10})
            (server,) = _servers()
            with open(f"/proc/{server.pid}/status") as f:
                peak = next(int(line.split()[1]) for line in f if line.startswith("VmHWM:"))
            return big, counted, peak << 10

    big, counted, peak = anyio.run(session)
    assert len(big["rows"]) == 200 and big["rows"][0]["big"].startswith("y" * 2000), big["rows"][0]["big"][-60:]
    assert big["rows"][0]["big"].endswith("[3998000 more characters]")
    assert peak < 400 << 20, f"the server's peak RSS was {peak >> 20} MiB"
    assert counted["row_count"] == 200 and counted["rows_left_out"] == 190, counted
