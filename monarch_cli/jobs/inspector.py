"""The questions asked of a reservation's telemetry: ``monarch stack``, ``diagnose`` and ``top``.

:class:`Inspector` answers them by asking the agents for what is live (stacks, process
samples; through relays on thousands of hosts, :mod:`.fanout`) and the store for the rest
(what :class:`~.telemetry.RunTelemetry` recorded).
"""

from __future__ import annotations

import dataclasses
import os
import time
import uuid
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..runtime import protocol
from ..telemetry import StoreError, _connect_rw, db_path, query
from ..telemetry import sql as named_sql
from .rank_rows import RankRow, suspicions
from .ranks import rank_ranges as compress  # (its name here, for the CLI, the dashboard and tests)
from .telemetry import TelemetryError

if TYPE_CHECKING:
    from .model import HostSet

#: Stack frames that mean "waiting for the other ranks".
_COLLECTIVES = {
    "barrier",
    "all_reduce",
    "all_gather",
    "all_gather_into_tensor",
    "reduce_scatter",
    "broadcast",
    "reduce",
    "gather",
    "scatter",
    "all_to_all",
    "all_to_all_single",
    "send",
    "recv",
    "wait",
    "monitored_barrier",
    "_wait_for_workers",
    "get",
    "synchronize",
}
_LAUNCHER = os.path.join("monarch_cli", "runtime", "")
_LIBRARY_PARTS = ("site-packages", "dist-packages", f"{os.sep}lib{os.sep}python", "<frozen", "monarch_cli")


# ------------------------------------------------------------------------------- stacks
@dataclasses.dataclass
class RankStack:
    run_id: str
    rank: int
    host: str
    pid: int
    method: str
    threads: list[dict[str, Any]]
    error: str | None = None
    fallback: str | None = None  # why py-spy was not used, when the interpreter's own dump was

    @property
    def main(self) -> list[dict[str, Any]]:
        """The main thread's frames, innermost first (the first thread if none is marked main),
        without monarch's own launcher frames below the user's program."""
        frames = next(
            (t["frames"] for t in self.threads if t.get("main")), self.threads[0]["frames"] if self.threads else []
        )
        for i, f in enumerate(frames):
            if i and _LAUNCHER in (f.get("file") or ""):
                return frames[:i]
        return frames

    def in_collective(self) -> bool:
        return any(f["function"] in _COLLECTIVES and "torch" in (f["file"] or "") for f in self.main) or any(
            f"torch{os.sep}distributed" in (f["file"] or "") for f in self.main[:3]
        )


@dataclasses.dataclass
class StackGroup:
    ranks: list[int]
    summary: str
    frames: list[dict[str, Any]]

    def describe(self) -> str:
        n = len(self.ranks)
        return f"{n} rank{'s' if n != 1 else ''} ({compress(self.ranks)}): {self.summary}"


@dataclasses.dataclass
class StackReport:
    run_id: str | None
    capture_id: str
    stacks: list[RankStack]
    groups: list[StackGroup]
    elapsed: float

    def to_json(self) -> dict[str, Any]:
        return {
            "run_id": self.run_id,
            "capture_id": self.capture_id,
            "seconds": round(self.elapsed, 3),
            "groups": [{"ranks": g.ranks, "summary": g.summary, "frames": g.frames} for g in self.groups],
            "ranks": [_shallow(s) for s in self.stacks],
        }


def _shallow(obj: Any) -> dict[str, Any]:
    """A dataclass's fields as a dict, sharing its values: ``dataclasses.asdict`` deep-copies every
    frame of every stack (seconds at 32,768 ranks) for output that only reads them."""
    return dict(vars(obj))  # (these dataclasses have no slots: their fields are their __dict__)


def _is_user(frame: dict[str, Any]) -> bool:
    path = frame.get("file") or ""
    return not any(part in path for part in _LIBRARY_PARTS)


def _where(frame: dict[str, Any]) -> str:
    return f"{os.path.basename(frame.get('file') or '?')}:{frame.get('line')}"


def summarize(frames: list[dict[str, Any]]) -> str:
    """``barrier ← train.py:20``: the innermost function, then where in user code it is (up to 3 frames)."""
    if not frames:
        return "(no Python frames)"
    user = [f for f in frames if _is_user(f)][:3]
    if not user:
        return f"{frames[0]['function']} ({_where(frames[0])})"
    return f"{frames[0]['function']} ← " + " ← ".join(_where(f) for f in user)


def group_stacks(stacks: list[RankStack]) -> list[StackGroup]:
    """Ranks with identical main-thread stacks together, the largest group first."""
    groups: dict[Any, StackGroup] = {}
    for s in stacks:
        if s.error or not s.threads:
            key: Any = ("error", s.error)
            summary = f"no stack ({s.error})"
        else:
            key = tuple((f["function"], f["file"], f["line"]) for f in s.main)
            summary = summarize(s.main)
        g = groups.get(key)
        if g is None:
            g = groups[key] = StackGroup([], summary, s.main)
        g.ranks.append(s.rank)
    return sorted(groups.values(), key=lambda g: (-len(g.ranks), g.ranks[0]))


# ------------------------------------------------------------------------------ diagnose
@dataclasses.dataclass
class Suspect:
    rank: int
    host: str | None
    reasons: list[str]


@dataclasses.dataclass
class Diagnosis:
    verdict: str  # healthy | suspect | unknown
    exit_code: int  # 0 | 1 | 2
    run_id: str | None
    summary: str
    suspects: list[Suspect] = dataclasses.field(default_factory=list)
    evidence: dict[str, Any] = dataclasses.field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        return {
            "verdict": self.verdict,
            "exit_code": self.exit_code,
            "run_id": self.run_id,
            "summary": self.summary,
            "suspects": [_shallow(s) for s in self.suspects],
            "evidence": self.evidence,
        }


class Inspector:
    """``monarch stack / diagnose / top`` for one reservation."""

    def __init__(self, state_dir: Path, hostset: Callable[[], HostSet]) -> None:
        """``state_dir`` holds the reservation's store; ``hostset`` connects to its agents (only when asked)."""
        self.db = db_path(state_dir)
        self._connect = hostset
        self._hs: HostSet | None = None

    # ------------------------------------------------------------------- store
    def sql(self, statement: str, params: Sequence[Any] = ()) -> list[dict[str, Any]]:
        try:
            cols, rows = query(self.db, statement, params)
        except StoreError as e:
            raise TelemetryError(str(e)) from None
        return [dict(zip(cols, r)) for r in rows]

    def latest_run(self) -> dict[str, Any] | None:
        if not self.db.exists():
            return None
        rows = self.sql(named_sql("latest_run"))
        return rows[0] if rows else None

    # ------------------------------------------------------------------- agents
    def _hostset(self) -> HostSet:
        """The agents, connected once per inspection (``diagnose`` probes them, then asks their stacks)."""
        if self._hs is None:
            self._hs = self._connect()
        return self._hs

    def _ask(self, make: Any, timeout: float) -> list[Any]:
        hs = self._hostset()
        return hs.ask_all(make(hs.mb), timeout)

    def stacks(self, ranks: set[int] | None = None, native: bool = False, run_id: str | None = None) -> StackReport:
        """Every live rank's stack, captured by the agents in parallel, grouped, and stored."""
        started = time.monotonic()
        wanted = sorted(ranks) if ranks is not None else None
        answers = self._ask(
            lambda mb: lambda cid: protocol.TelemetryStacks(cid, mb.address, run_id, wanted, native), 30.0
        )
        stacks = [
            RankStack(
                **{k: e.get(k) for k in ("run_id", "rank", "host", "pid", "method", "threads", "error", "fallback")}
            )
            for per_host in answers
            for e in per_host
        ]
        if stacks:
            newest = max(s.run_id for s in stacks)
            stacks = sorted((s for s in stacks if s.run_id == newest), key=lambda s: s.rank)
        report = StackReport(
            stacks[0].run_id if stacks else None,
            uuid.uuid4().hex[:12],
            stacks,
            group_stacks(stacks),
            time.monotonic() - started,
        )
        self._store(report)
        return report

    def _store(self, report: StackReport) -> None:
        rows: list[tuple[Any, ...]] = []
        now = time.time()
        for s in report.stacks:
            if not s.threads:
                rows.append(
                    (report.capture_id, s.run_id, s.rank, s.host, s.pid, now, s.method, None, None, None, s.error)
                )
            for t in s.threads:
                text = "\n".join(f"{f['function']} ({f['file']}:{f['line']})" for f in t["frames"])
                rows.append(
                    (
                        report.capture_id,
                        s.run_id,
                        s.rank,
                        s.host,
                        s.pid,
                        now,
                        s.method,
                        t["name"],
                        int(bool(t.get("main"))),
                        text,
                        s.error,
                    )
                )
        if not rows:
            return
        try:
            conn = _connect_rw(self.db)
            with conn:
                conn.execute("BEGIN")
                conn.executemany("INSERT INTO stacks VALUES (?,?,?,?,?,?,?,?,?,?,?)", rows)
            conn.close()
        except Exception:  # noqa: BLE001 - sqlite3.Error, OSError
            pass  # the answer still goes to the user; only its record is lost

    def live(self, run_id: str | None = None) -> tuple[list[tuple[Any, ...]], dict[int, tuple[Any, ...]]]:
        """(sample rows, rank -> last step row) of the live ranks, straight from the agents."""
        answers = self._ask(lambda mb: lambda cid: protocol.TelemetrySample(cid, mb.address, run_id), 10.0)
        samples = [s for a in answers for s in a["samples"]]
        steps = {int(r): s for a in answers for r, s in a["steps"].items() if s is not None}
        return samples, steps

    # -------------------------------------------------------------------- views
    def top(self, with_stacks: bool = False) -> tuple[str | None, list[RankRow]]:
        """One row per rank of the newest run, most suspicious first."""
        run = self.latest_run()
        if run is None:
            return None, []
        run_id = run["run_id"]
        rows = {
            r["rank"]: RankRow(r["rank"], r["host"], r["how"] or "running")
            for r in self.sql(named_sql("rank_states"), (run_id,))
        }
        now = time.time()
        for r in self.sql(named_sql("last_output_at"), (run_id,)):
            if r["rank"] in rows:
                rows[r["rank"]].output_age = now - r["ts"]
        for r in self.sql(named_sql("last_line"), (run_id,)):
            if r["rank"] in rows:
                rows[r["rank"]].last_line = r["line"]
        for r in self.sql(named_sql("last_step"), (run_id,)):
            if r["rank"] in rows:
                rows[r["rank"]].step, rows[r["rank"]].step_ms = r["step"], r["dt"]
        for r in self.sql(named_sql("last_sample"), (run_id,)):  # the last sample recorded: all a finished run has
            if r["rank"] in rows:
                row = rows[r["rank"]]
                row.cpu_percent, row.rss_mb, row.gpu_util, row.gpu_mem_mb = (
                    r["cpu_percent"],
                    r["rss_mb"],
                    r["gpu_util"],
                    r["gpu_mem_mb"],
                )
        if run["ended_at"] is None:
            try:
                samples, steps = self.live(run_id)
            except Exception:  # noqa: BLE001 - agents gone: the store's view is all there is
                samples, steps = [], {}
            for s in samples:
                row = rows.setdefault(s[1], RankRow(s[1]))
                row.host, row.state, row.cpu_percent, row.rss_mb = s[2], s[5], s[6], s[7]
                row.gpu_util, row.gpu_mem_mb = s[10], s[11]
            for rank, st in steps.items():
                if rank in rows:
                    rows[rank].step, rows[rank].step_ms = st[2], st[4]
        ordered = list(rows.values())
        for rank, reasons in suspicions(ordered).items():
            rows[rank].suspect = "; ".join(reasons)
        ordered.sort(key=lambda r: (not r.suspect, -(r.output_age or 0.0), r.rank))
        return run_id, ordered

    def _partition(self) -> str | None:
        """A host-to-host probe of the reservation's agents, where they reach each other at the
        addresses this client has (not through a backend's forwards)."""
        from .partition import partition_now

        try:
            hs = self._hostset()
        except Exception:  # noqa: BLE001 - the stacks below say the hosts do not answer
            return None
        if not hs.peers_reachable:
            return None
        hs.link_for_requests()  # each host is asked to probe its own peers: not one question for all
        return partition_now(hs.mb, hs.hosts)

    def diagnose(self, silence: float = 60.0) -> Diagnosis:
        """One verdict: 0 healthy, 1 a suspect found, 2 cannot tell."""
        try:
            run = self.latest_run()
        except TelemetryError as e:
            return Diagnosis("unknown", 2, None, str(e))
        if run is None:
            return Diagnosis("unknown", 2, None, "no run recorded on this reservation yet")
        run_id = run["run_id"]
        partition = self.sql(
            "SELECT kind, detail FROM events WHERE run_id = ? AND kind IN ('partition', 'stall') "
            "ORDER BY kind = 'stall' LIMIT 1",
            (run_id,),
        )
        if partition:  # its hosts could not reach each other (jobs/partition.py), or its ranks made no progress
            why = str(partition[0]["detail"])
            ranks = self.sql("SELECT rank, host FROM ranks WHERE run_id = ? ORDER BY rank", (run_id,))
            suspects = [Suspect(r["rank"], r["host"], [why]) for r in ranks]
            return Diagnosis("suspect", 1, run_id, why, suspects, {str(partition[0]["kind"]): why})
        if run["ended_at"] is not None:
            return self._diagnose_ended(run)
        found = self._partition()
        if found is not None:  # probed now: the run's client may not have noticed yet
            ranks = self.sql("SELECT rank, host FROM ranks WHERE run_id = ? ORDER BY rank", (run_id,))
            return Diagnosis(
                "suspect",
                1,
                run_id,
                found,
                [Suspect(r["rank"], r["host"], [found]) for r in ranks],
                {"partition": found},
            )
        try:
            report = self.stacks(run_id=run_id)
            _, rows = self.top()
        except Exception as e:  # noqa: BLE001
            return Diagnosis(
                "unknown", 2, run_id, f"run {run_id} has no recorded end, and its hosts do not answer: {e}"
            )
        if not report.stacks:
            return Diagnosis(
                "unknown",
                2,
                run_id,
                f"run {run_id} has no recorded end but no rank of it is alive (was its client killed?)",
            )
        reasons: dict[int, list[str]] = {}
        by_rank = {s.rank: s for s in report.stacks}
        captured = [s for s in report.stacks if s.threads]
        groups = report.groups
        if len(captured) >= 2 and len(groups) > 1:
            waiting = [s for s in captured if s.in_collective()]
            if waiting and len(waiting) < len(captured):
                where = summarize(waiting[0].main)
                for s in captured:
                    if not s.in_collective():
                        reasons.setdefault(s.rank, []).append(
                            f"not in a collective ({summarize(s.main)}) while rank(s) {compress([w.rank for w in waiting])} "
                            f"wait in {where}"
                        )
            elif len(groups[0].ranks) > len(groups[1].ranks):
                for g in groups[1:]:
                    for r in g.ranks:
                        reasons.setdefault(r, []).append(
                            f"different stack ({g.summary}) from rank(s) "
                            f"{compress(groups[0].ranks)} ({groups[0].summary})"
                        )
        for rank, suspected in suspicions(rows, silence).items():
            reasons.setdefault(rank, []).extend(suspected)
        evidence = {
            "stack_groups": [{"ranks": g.ranks, "summary": g.summary} for g in groups],
            "ranks": [_shallow(r) for r in rows],
        }
        if reasons:
            suspects = [
                Suspect(r, by_rank[r].host if r in by_rank else None, why) for r, why in sorted(reasons.items())
            ]
            head = "; ".join(f"rank {s.rank}: {s.reasons[0]}" for s in suspects[:3])
            return Diagnosis("suspect", 1, run_id, head, suspects, evidence)
        if not captured:
            return Diagnosis(
                "unknown",
                2,
                run_id,
                "no stack could be captured: " + "; ".join(sorted({s.error or "?" for s in report.stacks})),
                evidence=evidence,
            )
        if len(groups) > 1:
            return Diagnosis("unknown", 2, run_id, f"{len(groups)} different stacks and no majority", evidence=evidence)
        return Diagnosis(
            "healthy", 0, run_id, f"{len(captured)} rank(s) alive, all at {groups[0].summary}", evidence=evidence
        )

    def _diagnose_ended(self, run: dict[str, Any]) -> Diagnosis:
        run_id = run["run_id"]
        ranks = self.sql(named_sql("rank_endings"), (run_id,))
        evidence = {"ranks": ranks}
        if run["interrupted"]:
            return Diagnosis(
                "unknown",
                2,
                run_id,
                f"nothing running; the last run ({run_id}) was interrupted "
                f"(exit {run['exit_code']}); its stacks, if captured, are in the stacks table",
                evidence=evidence,
            )
        if not run["exit_code"]:
            return Diagnosis(
                "healthy", 0, run_id, f"nothing running; the last run ({run_id}) finished ok", evidence=evidence
            )
        failed = [r for r in ranks if r["status"]]
        if not failed:
            return Diagnosis(
                "unknown", 2, run_id, f"run {run_id} ended with exit {run['exit_code']}", evidence=evidence
            )
        first = failed[0]
        tail = self.sql(named_sql("tail"), (run_id, first["rank"]))[::-1]
        lines = [r["line"] for r in tail]
        # stdout and stderr come through separate pipes, so their order is not certain: an
        # error message is on stderr, so its last line is the one to quote
        errors = [r["line"] for r in tail if r["stream"] == "stderr"]
        last = errors[-1] if errors else lines[-1] if lines else None
        why = f"failed first ({first['how']})" + (f"; last line: {last}" if last else "")
        evidence["last_lines"] = lines
        return Diagnosis(
            "suspect",
            1,
            run_id,
            f"run {run_id} ended with exit {run['exit_code']}: rank {first['rank']} {why}",
            [Suspect(first["rank"], first["host"], [why])],
            evidence,
        )
