"""Runs as the MCP server sees them: start one detached, say where any run is, wait, cancel.

A run's state comes from what outlives every process: its runner's record (``detached.py``),
the rank logs (``.monarch/logs/<run-id>/``, ``result.json`` once it ended) and the telemetry
store. So a run started by an earlier server, or by ``monarch run-spmd`` in a terminal, is
seen the same way.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from ..cli.results import logs_root, run_logs
from ..errors import UserError
from ..jobs import run_owner
from ..jobs.run_log import rank_log, rank_logs
from ..jobs.state import state_path
from ..telemetry import StoreError, db_path, query
from .bounds import MAX_RANKS, clip_line, tail_lines
from .detached import read_record, record_path, write_record

#: States a run can be in; the last three are final.
RUNNING, STARTING, FINISHED, ERROR, LOST = "running", "starting", "finished", "error", "lost"
FINAL = (FINISHED, ERROR, LOST)
#: Runner records kept (the oldest ended ones beyond this are removed when a run starts).
KEEP_RECORDS = 50


class Runs:
    """The runs of one reservation's state directory."""

    def __init__(self, state: Path | None) -> None:
        self.state = state
        self.state_file = state_path(state).absolute()
        self.state_dir = self.state_file.parent

    # ------------------------------------------------------------------ start
    def start(self, command: list[str] | None, options: dict[str, Any]) -> str:
        """Start a detached runner for the reservation; returns the run id at once."""
        from ..jobs import job_load, new_run_id

        job = job_load(self.state)  # no reservation, or an unreadable one: one line now, not in the runner
        if command is None and not job.state.default_command:
            raise UserError("no command to run: give `command`, or serve with a default command")
        run_id = new_run_id()
        spec = {
            "state": str(self.state_file),
            "state_dir": str(self.state_dir),
            "run_id": run_id,
            "command": command,
            **options,
        }
        record_path(self.state_dir, run_id).parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        self._prune()
        runner = subprocess.Popen(
            [sys.executable, "-m", "monarch_cli.mcp.detached"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            start_new_session=True,
            text=True,
        )
        try:
            out, _ = runner.communicate(json.dumps(spec), timeout=60)
        except subprocess.TimeoutExpired:
            runner.kill()
            runner.wait()
            raise UserError("the run's process did not start within 60 s") from None
        # The runner prints its pid once its record exists (wait_run can find it from now on).
        if runner.returncode != 0 or not out.strip().isdigit():
            raise UserError(f"the run's process did not start (exit status {runner.returncode})")
        return run_id

    def _prune(self) -> None:
        for path in _records(self.state_dir)[:-KEEP_RECORDS]:
            record = read_record(path)
            if record is None or record.get("state") in FINAL or not _alive(record):
                path.unlink(missing_ok=True)
                path.with_suffix(".out").unlink(missing_ok=True)

    # --------------------------------------------------------------- looking
    def latest(self) -> str:
        """The newest SPMD run's id (``exec`` runs are not runs here)."""
        from ..jobs.output import list_runs

        runs = [p.name for p in list_runs(self.logs) if not p.name.startswith("exec-")]
        starting = [p.stem for p in _records(self.state_dir)]
        ids = sorted(set(runs) | set(starting))
        if not ids:
            raise UserError(f"no run yet under {self.logs}: start one with run_spmd")
        return ids[-1]

    @property
    def logs(self) -> Path:
        return logs_root(self.state)

    def snapshot(self, run_id: str | None, tail: int = 20, rank: int | None = None) -> dict[str, Any]:
        """Where the run is: its result once ended (what ``run-spmd --json`` prints), else its progress."""
        run_id = run_id or self.latest()
        record = read_record(record_path(self.state_dir, run_id))
        run_dir = self.logs / run_id
        if record is None and not run_dir.is_dir():
            raise UserError(f"no run {run_id!r} under {self.logs}")
        result_file = run_dir / "result.json"
        if result_file.exists():
            try:
                return _finished(json.loads(result_file.read_text()), run_dir, tail, rank)
            except ValueError:
                pass  # being written: it is still running, for a moment
        owner = run_owner.settle(run_dir, self.state_dir) if run_dir.is_dir() else None
        if record is not None and record.get("state") == ERROR:
            return {"run_id": run_id, "state": ERROR, "error": record["error"], "kind": record["kind"]}
        if record is None and owner is not None and owner.get("state") == run_owner.FAILED:
            return {"run_id": run_id, "state": ERROR, "error": f"run {run_id}: {owner['error']}", "kind": "failed"}
        why = self._lost(run_id, record, owner)
        if why is None and record is not None and record.get("state") == FINISHED:
            if result_file.exists():
                return self.snapshot(run_id, tail, rank)  # it ended between our looks
            return {"run_id": run_id, "state": ERROR, "error": f"run {run_id} ended; its logs are gone", "kind": "gone"}
        if why is not None:
            return {"run_id": run_id, "state": LOST, "error": why, "kind": "lost", **self._progress(run_id, tail)}
        snap = {
            "run_id": run_id,
            "state": STARTING if record is not None and record.get("state") == STARTING else RUNNING,
            "started_by": "this MCP server" if record is not None else "another client (monarch run-spmd?)",
            **self._progress(run_id, tail, rank),
        }
        notices = self.notices(run_id)
        if notices:
            snap["notices"] = notices
        return snap

    def _lost(self, run_id: str, record: dict[str, Any] | None, owner: dict[str, Any] | None) -> str | None:
        """Why the run is lost (its runner died without a result), else None. A runner record found
        so is rewritten as lost, so that it reads so from now on without asking the process table."""
        if owner is not None and owner.get("state") == run_owner.LOST:
            why = str(owner["error"])
        elif record is None or record.get("state") not in (STARTING, RUNNING, LOST):
            return None
        elif record.get("state") == LOST:
            return str(record["error"])
        elif _alive(record):
            return None
        else:
            why = f"run {run_id}: its process ended without a result (killed?)"
        path = record_path(self.state_dir, run_id)
        now = read_record(path)  # as it is now: it may have finished meanwhile
        if now is not None and now.get("state") in (STARTING, RUNNING) and not _alive(now):
            write_record(path, {**now, "state": LOST, "error": why, "kind": "lost", "ended_at": time.time()})
        elif now is not None and now.get("state") in (FINISHED, ERROR):
            return None
        return why

    def notices(self, run_id: str, limit: int = 10) -> list[str]:
        """What the runner said (a rank paused, a host started cold, stragglers), newest last."""
        out = record_path(self.state_dir, run_id).with_suffix(".out")
        lines = tail_lines(out, limit) if out.exists() else []
        return [l for l in lines if l.strip()]

    def _progress(self, run_id: str, tail: int, rank: int | None = None) -> dict[str, Any]:
        """Ranks started, lines so far, exits so far (telemetry store), and the newest lines (logs)."""
        record = read_record(record_path(self.state_dir, run_id)) or {}
        started = record.get("started_at")
        info: dict[str, Any] = {"elapsed": round(time.time() - started, 1) if started else None}
        rows = self._ranks(run_id)
        if rows is not None:
            info["world_size"] = len(rows)
            info["ranks_started"] = len(rows)
            info["ranks_exited"] = sum(1 for r in rows if r["ended_at"] is not None)
            info["lines"] = sum(r["lines"] or 0 for r in rows)
            info["rank_groups"] = groups([(r["rank"], r["status"], r["how"] or "running") for r in rows])
        run_dir = self.logs / run_id
        if run_dir.is_dir():
            info["log_dir"] = str(run_dir)
            files = rank_logs(run_dir)
            if rows is None and files:
                info["ranks_started"] = len(files)
            if files:
                pick = rank if rank is not None else _first_failed(rows) if rows else 0
                path = files[0].parent / f"rank{pick}.log"
                if path.exists():
                    info["tail"] = {"rank": pick, "lines": tail_lines(path, tail)}
        return info

    def _ranks(self, run_id: str) -> list[dict[str, Any]] | None:
        try:
            cols, rows = query(
                db_path(self.state_dir),
                "SELECT rank, status, how, lines, ended_at FROM ranks WHERE run_id = ? ORDER BY rank",
                (run_id,),
            )
        except StoreError:
            return None  # telemetry off, or nothing recorded yet: the logs still tell
        return [dict(zip(cols, r)) for r in rows] or None

    # --------------------------------------------------------------- cancel
    def cancel(self, run_id: str | None, force: bool) -> str:
        """Signal the run's runner: SIGTERM (torchrun's shutdown: the ranks get it, SIGKILL after the
        shutdown timeout), or with ``force`` SIGINT twice (the ranks are killed at once)."""
        run_id = run_id or self.latest()
        snap = self.snapshot(run_id, tail=0)
        if snap["state"] in FINAL:
            raise UserError(f"run {run_id} has already ended ({snap['state']}); nothing to cancel")
        record = read_record(record_path(self.state_dir, run_id))
        if record is None:
            raise UserError(
                f"run {run_id} was not started by this MCP server: end it where it runs (Ctrl-C), "
                "or release the reservation with `stop`"
            )
        pid = record["pid"]
        if not _is_runner(pid):
            raise UserError(f"run {run_id}'s process (pid {pid}) is not its runner any more; nothing to cancel")
        if force:
            _signal(pid, signal.SIGINT)
            time.sleep(0.3)  # two Ctrl-Cs, as a person would press them, not one lost in the other
            _signal(pid, signal.SIGINT)
            return "SIGINT twice (ranks killed)"
        _signal(pid, signal.SIGTERM)
        return "SIGTERM (forwarded to the ranks; SIGKILL after the shutdown timeout)"


def groups(ranks: list[tuple[int, int | None, str]]) -> list[dict[str, Any]]:
    """Ranks with the same ending, together: ``[{"ranks": "0-2,5", "count": 4, "status": 0, "how": "exit 0"}]``."""
    from ..jobs.lifecycle import rank_list

    by: dict[tuple[int | None, str], list[int]] = {}
    for rank, status, how in ranks:
        by.setdefault((status, how), []).append(rank)
    out = [{"ranks": rank_list(rs), "count": len(rs), "status": status, "how": how} for (status, how), rs in by.items()]
    return sorted(out, key=lambda g: (g["status"] == 0, g["how"] == "running", -g["count"]))


def _finished(result: dict[str, Any], run_dir: Path, tail: int, rank: int | None) -> dict[str, Any]:
    """``run-spmd --json``'s object (as ``result.json`` keeps it), with the state, groups and a tail;
    at most :data:`MAX_RANKS` rank entries."""
    ranks = result.get("ranks", [])
    snap = {"state": FINISHED, **result}
    snap["rank_groups"] = groups([(r["rank"], r["status"], r["how"]) for r in ranks])
    if len(ranks) > MAX_RANKS:
        keep = [r for r in ranks if r["status"] != 0][: MAX_RANKS // 2]
        keep += [r for r in ranks if r not in keep][: MAX_RANKS - len(keep)]
        snap["ranks"] = sorted(keep, key=lambda r: r["rank"])
        snap["ranks_left_out"] = len(ranks) - len(keep)
        snap["ranks_hint"] = "every rank: sql \"SELECT rank, host, how FROM ranks WHERE run_id = '...'\""
    for r in snap["ranks"]:
        r["last_lines"] = [clip_line(l) for l in r.get("last_lines", [])]
    pick = rank if rank is not None else result.get("first_failure")
    pick = 0 if pick is None else pick
    if tail and (path := rank_log(run_dir, pick)).exists():
        snap["tail"] = {"rank": pick, "lines": tail_lines(path, tail)}
    return snap


def _first_failed(rows: list[dict[str, Any]]) -> int:
    failed = [r for r in rows if r["status"] not in (None, 0)]
    return failed[0]["rank"] if failed else 0


def _records(state_dir: Path) -> list[Path]:
    from .detached import record_dir

    d = record_dir(state_dir)
    return sorted(d.glob("*.json")) if d.is_dir() else []


def _alive(record: dict[str, Any]) -> bool:
    """The record's runner is alive (not another process that got its pid since)."""
    if record.get("start") is not None:  # its start time as the kernel counts it (run_owner)
        return not run_owner.runner_gone(record)
    import psutil

    try:  # a record of an older server: its creation time, within a second
        p = psutil.Process(record["pid"])
        return p.status() != psutil.STATUS_ZOMBIE and p.create_time() <= record["started_at"] + 1.0
    except (psutil.NoSuchProcess, KeyError, TypeError):
        return False


def _is_runner(pid: object) -> bool:
    """Whether ``pid`` is one of this user's detached runners (a record's pid is signalled only
    then: a planted or stale record must not make ``cancel_run`` signal another process)."""
    if not isinstance(pid, int) or pid <= 0:
        return False
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            argv = f.read().split(b"\0")
        owner = os.stat(f"/proc/{pid}").st_uid
    except OSError:
        return False
    # (a runner started before the server moved out of cli/ still runs as monarch_cli.cli.mcp_server.detached)
    return owner == os.getuid() and bool(
        {b"monarch_cli.mcp.detached", b"monarch_cli.cli.mcp_server.detached"} & set(argv)
    )


def _signal(pid: int, sig: int) -> None:
    try:
        os.kill(pid, sig)
    except ProcessLookupError:
        pass  # it ended meanwhile: the snapshot says how


def is_final(snap: dict[str, Any]) -> bool:
    return snap["state"] in FINAL


def run_logs_for(state: Path | None, run: str | None, rank: int | None) -> tuple[Path, list[Path]]:
    return run_logs(logs_root(state), run, rank)
