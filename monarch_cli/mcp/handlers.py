"""What each tool does: call the job API, return what ``--json`` prints plus a short text.

No MCP here: these are plain functions (run in a worker thread) that the server
(``server.py``) calls with validated arguments. Each returns a :class:`Reply`; our errors are
raised and become error results there.
"""

from __future__ import annotations

import dataclasses
import os
import shlex
from collections.abc import Callable
from pathlib import Path
from typing import Any

from ..cli import results
from ..errors import UserError
from .bounds import (
    MAX_FRAMES,
    MAX_GROUPS,
    MAX_HOSTS,
    MAX_LOG_LINES,
    MAX_RANKS,
    MAX_ROWS,
    Grep,
    cap,
    cell,
    clip_line,
    scan,
)
from .runs import Runs, run_logs_for


@dataclasses.dataclass
class Reply:
    data: dict[str, Any]
    text: str
    error: bool = False


@dataclasses.dataclass
class Session:
    """What the tools share: the reservation's state file, and a way to report progress."""

    state: Path | None
    progress: Callable[[str], None] = lambda _msg: None

    @property
    def runs(self) -> Runs:
        return Runs(self.state)

    def job(self) -> Any:
        from ..jobs import job_load

        return job_load(self.state)


def _command(value: str | list[str] | None) -> list[str] | None:
    """A command given as one string (split as a shell would) or as a list of words."""
    if value is None:
        return None
    if isinstance(value, str):
        try:
            words = shlex.split(value)
        except ValueError as e:
            raise UserError(f"command: {e}") from None
    else:
        words = list(value)
    if not words:
        raise UserError("command is empty")
    return words


def _option_pairs(options: dict[str, Any]) -> list[str]:
    """Backend options as ``-o key=value`` words, so they are checked and typed as on the command line."""
    pairs = []
    for key, value in options.items():
        for v in value if isinstance(value, list) else [value]:
            pairs.append(f"{key}={str(v).lower() if isinstance(v, bool) else v}")
    return pairs


def _backend_options(scheduler: str, options: dict[str, Any], kind: str = "options") -> dict[str, Any]:
    if not options:
        return {}
    from ..schedulers import parse_option_pairs, scheduler_class

    return parse_option_pairs(_option_pairs(options), getattr(scheduler_class(scheduler), kind), scheduler)


# ------------------------------------------------------------------- reservations
def serve(s: Session, a: dict[str, Any]) -> Reply:
    from ..jobs import dryrun, serve

    scheduler = a.get("scheduler", "local")
    hosts = a.get("hosts")
    if isinstance(hosts, list):
        hosts = ",".join(hosts)
    options = _backend_options(scheduler, a.get("options") or {})
    command = _command(a.get("command"))
    if a.get("dry_run"):
        plan = dryrun(command, scheduler, hosts=hosts, state=s.state, preload=a.get("preload"), **options)
        return Reply(plan.to_json(), plan.render())
    job = serve(
        command,
        scheduler,
        hosts=hosts,
        state=s.state,
        replace=bool(a.get("replace")),
        preload=a.get("preload"),
        progress=s.progress,
        **options,
    )
    info = job.status()
    default = f"; runs {shlex.join(info['default_command'])} by default" if info["default_command"] else ""
    text = f"reservation {info['reservation_id']} ({info['scheduler']}, {len(info['hosts'])} host(s)) is up{default}"
    return Reply(info, text)


def status(s: Session, a: dict[str, Any]) -> Reply:
    from ..jobs.state import NoReservation

    try:
        job = s.job()
    except NoReservation as e:
        return Reply(results.no_reservation_json(str(e)), f"no reservation: {e}")
    info = job.status()
    cap(info, "hosts", MAX_HOSTS, "every host: monarch status --json")
    hosts = ", ".join(f"{h['name']} {'up' if h['alive'] else 'DOWN'}" for h in info["hosts"])
    lines = [f"reservation {info['reservation_id']} ({info['scheduler']}): {'up' if info['alive'] else 'GONE'}"]
    lines.append(f"hosts: {hosts}")
    if info["stale"]:
        lines.append(info["stale"])
    if info["default_command"]:
        lines.append(f"default command: {shlex.join(info['default_command'])}")
    last = info["last_run"]
    if last:
        lines.append(f"last run: {last['run_id']} exit {last['exit_code']} in {last['duration']:.2f} s")
    return Reply(info, "\n".join(lines))


def warm(s: Session, a: dict[str, Any]) -> Reply:
    job = s.job()
    if a.get("forget"):
        forgotten = job.forget_preload()
        text = "forgot " + ", ".join(f"{n} module(s) on {h}" for h, n in forgotten.items())
        return Reply({"forgotten": forgotten}, text)
    data = results.warm_json(job)
    cap(data, "hosts", MAX_HOSTS, "every host: monarch warm --json")
    text = "\n".join(
        f"{h['name']}: "
        + (
            f"{h['warm']['modules']} modules ({h['warm']['learned_held']} learned), ready={h['warm']['ready']}"
            if h["warm"]
            else "no warm process"
        )
        for h in data["hosts"]
    )
    return Reply(data, text)


def stop(s: Session, a: dict[str, Any]) -> Reply:
    from ..jobs import clear_unreadable
    from ..jobs.state import NoReservation, StateError

    try:
        job = s.job()
    except NoReservation:
        return Reply(dict(results.NOTHING_TO_STOP), "nothing to stop: no reservation")
    except StateError:
        if not a.get("force"):
            raise
        cleared = clear_unreadable(s.state)
        return Reply({"stopped": None, **cleared}, "cleared the unreadable state file")
    rid = job.state.reservation_id
    ended = job.stop(
        by="monarch mcp stop", **_backend_options(job.state.scheduler, a.get("options") or {}, "stop_options")
    )
    told = f"; run(s) {', '.join(ended)} in progress ended with exit status 254" if ended else ""
    return Reply(results.stopped_json(rid, ended), f"released reservation {rid}{told}")


def exec_(s: Session, a: dict[str, Any]) -> Reply:
    command = a["command"]
    if isinstance(command, list) and not command:
        raise UserError("command is empty")
    with open(os.devnull, "wb") as sink:  # each host's output is in the run's logs, and its last lines below
        result = s.job().exec(command, stdout=sink, stderr=sink, on_event=s.progress)
    data = result.to_json()
    if len(data["ranks"]) > MAX_HOSTS:  # failures first, if some must be cut
        data["ranks"].sort(key=lambda r: (r["status"] == 0, r["rank"]))
    cap(data, "ranks", MAX_HOSTS, f"every host's output: logs with run_id {result.run_id}")
    lines = [f"exec {result.run_id}: exit status {result.exit_code}"]
    for r in data["ranks"]:
        r["last_lines"] = [clip_line(l) for l in r["last_lines"]]
        lines.append(f"[{r['host']}] {r['how']}" + "".join(f"\n  {l}" for l in r["last_lines"]))
    return Reply(data, "\n".join(lines), error=False)


# --------------------------------------------------------------------------- logs
def logs(s: Session, a: dict[str, Any]) -> Reply:
    run_dir, files = run_logs_for(s.state, a.get("run_id") or s.runs.latest(), a.get("rank"))
    data = results.logs_json(run_dir, files)
    if data["result"]:
        cap(data["result"], "ranks", MAX_RANKS, "every rank's ending: sql over the ranks table")
    pattern = Grep(a["grep"]) if a.get("grep") else None  # with a time budget: a pattern may backtrack for ever
    tail = a.get("tail", 100)
    per_rank = max(1, min(tail, MAX_LOG_LINES // max(1, len(files))))
    shown = files[: MAX_LOG_LINES // per_rank]
    ranks: list[dict[str, Any]] = []
    text: list[str] = []
    for f in shown:
        lines, matched, total = scan(f, pattern, per_rank)
        ranks.append(
            {
                "rank": int(f.stem[4:]),
                "lines": lines,
                "lines_total": total,
                **({"matched": matched} if pattern else {}),
                "lines_left_out": (matched if pattern else total) - len(lines),
            }
        )
        text += [f"[{f.stem}] {l['line']}" for l in lines]
    data["ranks"] = ranks
    if len(shown) < len(files):
        data["ranks_left_out"] = len(files) - len(shown)
    left = sum(r["lines_left_out"] for r in ranks)
    if left or len(shown) < len(files):
        data["hint"] = (
            f"{left} earlier line(s) left out"
            + (f" and {len(files) - len(shown)} rank(s)" if len(shown) < len(files) else "")
            + "; narrow with rank=, grep= or a larger tail= (at most "
            f"{MAX_LOG_LINES} lines a call), or sql over the logs table"
        )
    head = f"run {run_dir.name}: {len(files)} rank log(s)" + (f" ({data['hint']})" if "hint" in data else "")
    return Reply(data, "\n".join([head, *text]))


# ---------------------------------------------------------------------- telemetry
#: How long one `sql` tool call may run (twice: the rows, then how many were left out).
SQL_TIMEOUT = 20.0


def sql(s: Session, a: dict[str, Any]) -> Reply:
    from ..cli.sql import render, settle_runs, store_path
    from ..telemetry import StoreError, query_bounded, schema_json, schema_text

    if a.get("schema"):
        return Reply(schema_json(), schema_text())
    statement = (a.get("query") or "").strip()
    if not statement:
        raise UserError("give a query, e.g. SELECT * FROM runs (schema=true lists the tables)")
    limit = min(a.get("limit", 200), MAX_ROWS)
    path = store_path(str(s.state) if s.state else None)
    settle_runs(path.parent)  # a run whose client died reads as ended, here as in `monarch sql`
    try:  # at most `limit` rows held: `SELECT * FROM logs` may be millions; a runaway query stops at the timeout
        cols, rows, more = query_bounded(path, statement, (), max_rows=limit, timeout=SQL_TIMEOUT, clip=cell)
        total = len(rows)
        if more:  # how many were left out, asked of SQLite (bounded by the same timeout), not counted here
            # (on a line of its own: a trailing `-- comment` must not swallow the closing parenthesis)
            counted = f"SELECT COUNT(*) FROM (\n{statement.rstrip().rstrip(';')}\n)"
            total = int(query_bounded(path, counted, (), timeout=SQL_TIMEOUT)[1][0][0])
    except StoreError as e:
        raise UserError(str(e)) from None
    kept = [dict(zip(cols, r)) for r in rows]
    data: dict[str, Any] = {"columns": cols, "rows": kept, "row_count": total}
    text = render(cols, [tuple(r.values()) for r in kept], "text")
    if total > limit:
        data["rows_left_out"] = total - limit
        data["hint"] = f"{total - limit} more row(s): add LIMIT/OFFSET or aggregate"
        text += data["hint"] + "\n"
    return Reply(data, text)


def stack(s: Session, a: dict[str, Any]) -> Reply:
    from ..cli.runs import parse_ranks

    report = s.job().stacks(parse_ranks(a.get("ranks")), bool(a.get("native")))
    data = report.to_json()
    if not report.stacks:
        return Reply(data, "no live rank to capture (nothing running on this reservation)")
    if len(data["groups"]) > MAX_GROUPS:
        data["groups_left_out"] = len(data["groups"]) - MAX_GROUPS
        data["groups"] = data["groups"][:MAX_GROUPS]
    for g in data["groups"]:
        if len(g["frames"]) > MAX_FRAMES:
            g["frames_left_out"] = len(g["frames"]) - MAX_FRAMES
            g["frames"] = g["frames"][-MAX_FRAMES:]  # the outermost ones: where in the script it is
    data["ranks"] = [
        {k: v for k, v in r.items() if k in ("rank", "host", "pid", "method", "error")} for r in data["ranks"]
    ]
    cap(data, "ranks", MAX_RANKS, "every rank: sql over the stacks table")
    data["hint"] = "every thread's frames: sql \"SELECT rank, thread, stack FROM stacks WHERE capture_id = '...'\""
    lines = [f"run {report.run_id}: {len(report.stacks)} rank(s), {len(report.groups)} distinct stack(s)"]
    lines += [f"  {g.describe()}" for g in report.groups[:MAX_GROUPS]]
    return Reply(data, "\n".join(lines))


def diagnose(s: Session, a: dict[str, Any]) -> Reply:
    d = s.job().diagnose(a.get("silence", 60.0))
    data = d.to_json()
    cap(data, "suspects", MAX_RANKS, "all of them: call diagnose again after fixing these, or sql over ranks")
    evidence = data["evidence"]
    suspects = {sus.rank for sus in d.suspects}
    if len(evidence.get("ranks") or ()) > MAX_RANKS:  # keep the suspects' rows, then the first others
        evidence["ranks"].sort(key=lambda r: (r.get("rank") not in suspects, r.get("rank", 0)))
        cap(evidence, "ranks", MAX_RANKS, "every rank: sql over the ranks and samples tables")
    cap(evidence, "stack_groups", MAX_GROUPS, "every stack: call stack, or sql over the stacks table")
    lines = [f"{d.verdict}: {d.summary}"]
    for sus in d.suspects[:MAX_RANKS]:
        lines.append(f"  rank {sus.rank}{' on ' + sus.host if sus.host else ''}: " + "; ".join(sus.reasons))
    for g in d.evidence.get("stack_groups", []):
        lines.append(f"  stacks: ranks {g['ranks']}: {g['summary']}")
    return Reply(data, "\n".join(lines))


# ------------------------------------------------------------------------ debugger
def _debugger(s: Session, a: dict[str, Any]) -> Any:
    from ..jobs.debug import DebugClient

    return DebugClient(s.job().hostset(), a.get("run_id"))


def debug_list(s: Session, a: dict[str, Any]) -> Reply:
    client = _debugger(s, a)
    try:
        rows = client.list()
    finally:
        client.close()
    data = {"paused": results.paused_json(rows)}
    cap(data, "paused", MAX_RANKS, "narrow with run_id, or use `monarch debug list --json`")
    if not rows:
        return Reply(data, "no rank is paused (ranks pause at breakpoint(), or on a crash with post_mortem)")
    text = "\n".join(f"rank {r.rank} on {r.host}: {r.state} at {r.where} in {r.function}" for r in rows)
    return Reply(data, f"{results.paused_summary(rows)}\n{text}")


def debug_cast(s: Session, a: dict[str, Any]) -> Reply:
    from ..jobs.debug import select_ranks

    client = _debugger(s, a)
    try:
        rows = client.list()
        if not rows:
            raise UserError("no rank is paused: nothing to send a pdb command to (debug_list shows paused ranks)")
        answers = client.cast(select_ranks(a.get("ranks", "*"), rows), a["command"])
    finally:
        client.close()
    data = results.cast_json(answers)
    text = []
    for rank, v in data.items():
        if "error" in v:
            text.append(f"[rank{rank}] error: {v['error']}")
            continue
        out = v["output"].rstrip("\n").splitlines() or [""]
        if len(out) > 200:
            v["output_lines_left_out"] = len(out) - 200
            v["output"] = "\n".join(out[-200:])
        text += [f"[rank{rank}] {clip_line(l)}" for l in out[-200:]]
    failed = any("error" in v for v in data.values())
    return Reply(data, "\n".join(text), error=failed and len(data) == sum("error" in v for v in data.values()))


HANDLERS: dict[str, Callable[[Session, dict[str, Any]], Reply]] = {
    "serve": serve,
    "status": status,
    "warm": warm,
    "stop": stop,
    "exec": exec_,
    "logs": logs,
    "sql": sql,
    "stack": stack,
    "diagnose": diagnose,
    "debug_list": debug_list,
    "debug_cast": debug_cast,
}
