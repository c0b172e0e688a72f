"""What each dashboard page shows, as plain data: the store's named queries plus what the agents say now.

No web framework here (the app in :mod:`.app` only routes and serialises), so a script can call the
same functions. Every read of the store goes through :mod:`monarch_cli.telemetry.queries`, the queries
``monarch top``/``stack``/``diagnose`` run too.
"""

from __future__ import annotations

import json
import os
import threading
import time
from collections import defaultdict
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..jobs.run_owner import settle_open
from ..jobs.state import NoReservation, StateError, state_path
from ..telemetry import StoreError, db_path, numbers, rows

if TYPE_CHECKING:
    from ..jobs import Job

#: At most this many output lines in one answer (a page of the run view, or one live update).
MAX_LINES = 5000
#: At most this many rows of each table (samples, steps, output lines with numbers) in one series answer.
MAX_SERIES_ROWS = 20_000
#: At most about this many ``key=value`` points in one series answer (a 4 KiB line holds up to ~1,000).
MAX_NUMBER_POINTS = 50_000
#: At most this many different ``key=value`` names are plotted per run (the first ones seen).
MAX_NUMBER_KEYS = 24


#: How often (seconds, at most) the pages look for runs whose client died.
SETTLE_EVERY = 2.0


class DashboardError(Exception):
    """A request the dashboard cannot answer (the message is one line for the user)."""


class Views:
    """One reservation's pages. Calls that ask the agents are serialised: the job's mailbox is one client."""

    def __init__(self, state: str | Path | None = None) -> None:
        self.state_file = state_path(state)
        self.db = db_path(self.state_file.parent)
        self._job: Job | None = None
        self._stamp: int | None = None
        self._agents = threading.Lock()
        self._settled = -SETTLE_EVERY

    # ----------------------------------------------------------------- helpers
    def job(self) -> Job:
        """The reservation, loaded on first use (and again after it changes or goes)."""
        from ..jobs import job_load

        try:
            stamp = self.state_file.stat().st_mtime_ns
        except OSError:
            stamp = None
        if self._job is None or stamp != self._stamp:  # a new reservation (serve --replace) or none
            try:
                self._job, self._stamp = job_load(self.state_file), stamp
            except (NoReservation, StateError) as e:
                self._job = None
                raise DashboardError(str(e)) from None
        return self._job

    def _rows(self, name: str, params: tuple[Any, ...] = ()) -> list[dict[str, Any]]:
        if not self.db.exists():
            return []
        try:
            return rows(self.db, name, params)
        except StoreError as e:
            raise DashboardError(str(e)) from None

    def _settle(self) -> None:
        """Runs whose client died are ended in the store (``run_owner``) before a page lists them, at
        most every :data:`SETTLE_EVERY` seconds (live updates ask every second)."""
        now = time.monotonic()
        if now - self._settled < SETTLE_EVERY:
            return
        self._settled = now
        try:
            settle_open(self.state_file.parent)
        except OSError:
            pass  # logs we cannot read: the store says what it says

    def run_id(self, run_id: str | None) -> str | None:
        """``None`` or ``"latest"``: the newest run."""
        if run_id and run_id != "latest":
            return run_id
        latest = self._rows("latest_run")
        return latest[0]["run_id"] if latest else None

    # ------------------------------------------------------------------- pages
    def hosts(self) -> dict[str, Any]:
        """Each host: agent liveness and warm state (asked now), CPUs/GPUs and its ranks' latest use."""
        try:
            with self._agents:
                status = self.job().status()
        except DashboardError as e:
            status = {"hosts": [], "stale": str(e), "reservation_id": None, "scheduler": None, "alive": False}
        except Exception as e:  # noqa: BLE001 - agents unreachable: the page says so, the store still answers
            status = {"hosts": [], "stale": f"agents do not answer: {e}", "reservation_id": None, "alive": False}
        run_id = self.run_id(None)
        info = {h["host"]: h for h in self._rows("hosts", (run_id,))} if run_id else {}
        use: dict[str, dict[str, Any]] = defaultdict(lambda: {"ranks": 0, "cpu_percent": 0.0, "rss_mb": 0.0})
        gpu: dict[str, list[float]] = defaultdict(list)
        gpu_mem: dict[str, float] = defaultdict(float)
        newest: dict[str, float] = {}
        for s in self._rows("last_sample", (run_id,)) if run_id else []:
            u = use[s["host"]]
            u["ranks"] += 1
            u["cpu_percent"] += s["cpu_percent"] or 0.0
            u["rss_mb"] += s["rss_mb"] or 0.0
            newest[s["host"]] = max(newest.get(s["host"], 0.0), s["ts"] or 0.0)
            if s["gpu_util"] is not None:
                gpu[s["host"]].append(s["gpu_util"])
                gpu_mem[s["host"]] += s["gpu_mem_mb"] or 0.0
        names = [h["name"] for h in status["hosts"]] or list(info)
        hosts = []
        for i, name in enumerate(names):
            h = status["hosts"][i] if i < len(status["hosts"]) else {"name": name}
            warm = h.get("warm") or {}
            row = {
                "name": name,
                "agent": h.get("agent") or info.get(name, {}).get("agent"),
                "alive": h.get("alive"),
                "ranks_running": h.get("ranks_running"),
                "warm": bool(warm.get("ready")) if warm else None,
                "warming": bool(warm.get("warming")) if warm else None,
                "cpus": info.get(name, {}).get("cpus"),
                "gpus": info.get(name, {}).get("gpus"),
                "sampled_at": newest.get(name),
                "gpu_util": sum(gpu[name]) / len(gpu[name]) if gpu.get(name) else None,
                "gpu_mem_mb": gpu_mem[name] if gpu.get(name) else None,
            }
            row.update(use.get(name, {"ranks": 0, "cpu_percent": None, "rss_mb": None}))
            hosts.append(row)
        return {
            "reservation_id": status.get("reservation_id"),
            "scheduler": status.get("scheduler"),
            "alive": status.get("alive"),
            "stale": status.get("stale"),
            "run_id": run_id,
            "hosts": hosts,
        }

    def runs(self, limit: int = 50) -> list[dict[str, Any]]:
        self._settle()
        return self._rows("runs", (limit,))

    def run(self, run_id: str | None) -> dict[str, Any]:
        """One run: its row, the exit table, its events and hosts."""
        self._settle()
        rid = self.run_id(run_id)
        found = self._rows("run", (rid,)) if rid else []
        if not found:
            raise DashboardError(f"no run {run_id!r} in the telemetry store" if run_id else "no run recorded yet")
        return {
            "run": found[0],
            "ranks": self._rows("exit_table", (rid,)),
            "events": self._rows("events", (rid,)),
            "hosts": self._rows("hosts", (rid,)),
        }

    def logs(
        self,
        run_id: str | None,
        *,
        after: int | None = None,
        before: int | None = None,
        ranks: list[int] | None = None,
        text: str | None = None,
        limit: int = 1000,
    ) -> dict[str, Any]:
        """A page of output lines (oldest first), filtered by rank and text. ``after``: lines after that id;
        ``before`` (or neither): the last ``limit`` lines before it (the tail)."""
        rid = self.run_id(run_id)
        limit = max(1, min(limit, MAX_LINES))
        r = json.dumps(ranks) if ranks else None
        t = text or None
        if rid is None:
            lines: list[dict[str, Any]] = []
        elif after is not None:
            lines = self._rows("logs_after", (rid, after, r, r, t, t, limit))
        else:
            lines = self._rows("logs_before", (rid, before if before is not None else 1 << 62, r, r, t, t, limit))[::-1]
        return {"run_id": rid, "lines": lines, "more": len(lines) == limit}

    def series(
        self,
        run_id: str | None,
        after_samples: int = 0,
        after_steps: int = 0,
        after_logs: int = 0,
        limit: int = MAX_SERIES_ROWS,
    ) -> dict[str, Any]:
        """New plot points since the cursors: samples (CPU, RSS, GPU), step times, and ``key=value`` numbers
        printed in output. Rows are arrays, oldest first; the answer's cursors go in the next request.
        At most ``limit`` rows of each table and :data:`MAX_NUMBER_POINTS` numbers per answer (``more``
        says there are more), so one request never reads a whole store."""
        rid = self.run_id(run_id)
        limit = max(1, min(limit, MAX_SERIES_ROWS))
        out: dict[str, Any] = {"run_id": rid, "samples": [], "steps": [], "numbers": {}, "cursors": {}, "more": False}
        if rid is None:
            out["cursors"] = {"samples": after_samples, "steps": after_steps, "logs": after_logs}
            return out
        samples = self._rows("samples_after", (rid, after_samples, limit))
        steps = self._rows("steps_after", (rid, after_steps, limit))
        lines = self._rows("numbers_after", (rid, after_logs, limit))
        out["samples"] = [
            [s["rank"], s["ts"], s["cpu_percent"], s["rss_mb"], s["gpu_util"], s["gpu_mem_mb"]] for s in samples
        ]
        out["steps"] = [[s["rank"], s["ts"], s["step"], s["dt_ms"]] for s in steps]
        found: dict[str, list[list[Any]]] = {}
        points, last_line = 0, after_logs
        for line in lines:
            if points >= MAX_NUMBER_POINTS:  # the rest of these lines come with the next request
                break
            for key, value in numbers(line["line"]):
                if key in found or len(found) < MAX_NUMBER_KEYS:
                    found.setdefault(key, []).append([line["rank"], line["ts"], value])
                    points += 1
            last_line = line["id"]
        out["numbers"] = found
        out["cursors"] = {
            "samples": samples[-1]["id"] if samples else after_samples,
            "steps": steps[-1]["id"] if steps else after_steps,
            "logs": last_line,
        }
        out["more"] = limit in (len(samples), len(steps), len(lines)) or (bool(lines) and last_line != lines[-1]["id"])
        return out

    def stored_stacks(self, run_id: str | None) -> dict[str, Any]:
        """The newest capture stored for a run, grouped like ``monarch stack`` (no agent is asked)."""
        from ..jobs.inspector import compress

        rid = self.run_id(run_id)
        threads = self._rows("latest_capture", (rid,)) if rid else []
        if not threads:
            return {"run_id": rid, "capture_id": None, "ts": None, "groups": [], "ranks": []}
        main: dict[int, dict[str, Any]] = {}
        for t in threads:
            if t["rank"] not in main or t["is_main"]:
                main.setdefault(t["rank"], t)
        groups: dict[str, list[int]] = defaultdict(list)
        for rank, t in sorted(main.items()):
            groups[t["stack"] or f"no stack ({t['error']})"].append(rank)
        ordered = sorted(groups.items(), key=lambda g: (-len(g[1]), g[1][0]))
        return {
            "run_id": rid,
            "capture_id": threads[0]["capture_id"],
            "ts": threads[0]["ts"],
            "method": sorted({t["method"] for t in threads}),
            "groups": [
                {
                    "ranks": ranks,
                    "ranks_text": compress(ranks),
                    "summary": stack.splitlines()[0] if stack else "",
                    "frames": _own_frames(stack.splitlines()),
                }
                for stack, ranks in ordered
            ],
        }

    def capture_stacks(self, ranks: set[int] | None = None) -> dict[str, Any]:
        """Ask every agent for its live ranks' stacks now (stored, like ``monarch stack``), then show them."""
        with self._agents:
            report = self.job().stacks(ranks)
        out = self.stored_stacks(report.run_id) if report.run_id else {"run_id": None, "groups": []}
        # the summaries `monarch stack` prints (innermost function, then where in user code)
        summaries = {tuple(g.ranks): g.summary for g in report.groups}
        for g in out.get("groups", []):
            g["summary"] = summaries.get(tuple(g["ranks"]), g["summary"])
        out["seconds"] = round(report.elapsed, 3)
        out["live"] = bool(report.stacks)
        return out

    def diagnose(self, silence: float = 60.0) -> dict[str, Any]:
        try:
            with self._agents:
                d = self.job().diagnose(silence)
        except DashboardError as e:
            return {
                "verdict": "unknown",
                "exit_code": 2,
                "run_id": None,
                "summary": str(e),
                "suspects": [],
                "evidence": {},
            }
        return d.to_json()

    def top(self) -> dict[str, Any]:
        import dataclasses

        with self._agents:
            run_id, found = self.job().top()
        return {"run_id": run_id, "ranks": [dataclasses.asdict(r) for r in found]}

    def cursors(self) -> dict[str, Any]:
        """Cheap change detection for live updates (one statement, and now and then a look for lost runs)."""
        self._settle()
        found = self._rows("cursors")
        return found[0] if found else {}


_LAUNCHER = os.path.join("monarch_cli", "runtime", "")


def _own_frames(frames: list[str]) -> list[str]:
    """The frames down to the user's program: monarch's launcher frames below it are left out (as ``stack --full``)."""
    for i, f in enumerate(frames):
        if i and _LAUNCHER in f:
            return frames[:i]
    return frames
