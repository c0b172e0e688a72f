"""Commands that inspect runs: sql, stack, diagnose, top."""

from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING

import typer
from rich.markup import escape
from rich.table import Table

from ..telemetry import DEFAULT_MAX_ROWS, DEFAULT_TIMEOUT
from .common import JsonOpt, StateOpt, app, emit_json, err, friendly, out, parse_ranks
from .results import top_json
from .sql import run_sql

if TYPE_CHECKING:  # the job API loads the runtime: only the commands that run import it
    from rich.console import RenderableType

    from ..jobs.inspector import Diagnosis, RankRow, StackReport


def _job(state: Path | None):  # type: ignore[no-untyped-def]
    from ..jobs import job_load

    return job_load(state)


@app.command("sql")
def sql_cmd(
    statement: str | None = typer.Argument(None, help="One SELECT statement."),
    state: Path | None = StateOpt,
    as_json: bool = typer.Option(False, "--json", help="Rows as a JSON list of objects."),
    as_csv: bool = typer.Option(False, "--csv", help="Rows as CSV with a header line."),
    schema: bool = typer.Option(False, "--schema", help="The tables, their columns, what they mean, example queries."),
    max_rows: int = typer.Option(
        DEFAULT_MAX_ROWS, "--max-rows", min=1, help="Rows shown at most (the rest is left out, with a note)."
    ),
    timeout: float = typer.Option(
        DEFAULT_TIMEOUT, "--timeout", min=0.001, help="Seconds a query may run before it is stopped."
    ),
) -> None:
    """Query the reservation's telemetry store (read-only SQLite: runs, ranks, logs, samples, steps, stacks...)."""
    if as_json and as_csv:
        err.print("[bold red]monarch: error:[/] --json and --csv together: pick one")
        raise typer.Exit(2)
    code, text, problem = run_sql(
        statement,
        str(state) if state else None,
        "json" if as_json else "csv" if as_csv else "text",
        schema,
        max_rows,
        timeout,
    )
    sys.stdout.write(text)
    sys.stderr.write(problem)
    raise typer.Exit(code)


@app.command("stack")
@friendly
def stack_cmd(
    ranks: str | None = typer.Option(None, "--ranks", help="Only these ranks (e.g. 0,2-3)."),
    native: bool = typer.Option(False, "--native", help="Include native (C/C++) frames (py-spy --native)."),
    full: bool = typer.Option(False, "--full", help="Print every group's whole main-thread stack."),
    state: Path | None = StateOpt,
    as_json: bool = JsonOpt,
) -> None:
    """The Python stacks of every live rank of the current run, grouped by identical stack."""
    report = _job(state).stacks(parse_ranks(ranks), native)
    if as_json:
        emit_json(report.to_json())
        return
    _render_stacks(report, full)


@app.command("diagnose")
@friendly
def diagnose_cmd(
    silence: float = typer.Option(60.0, "--silence", help="Seconds without output that make a rank suspect."),
    state: Path | None = StateOpt,
    as_json: bool = JsonOpt,
) -> None:
    """One verdict on the current (or last) run: exit 0 healthy, 1 a suspect rank found, 2 cannot tell."""
    d = _job(state).diagnose(silence)
    if as_json:
        emit_json(d.to_json())
    else:
        _render_diagnosis(d)
    raise typer.Exit(d.exit_code)


@app.command("top")
@friendly
def top_cmd(
    once: bool = typer.Option(False, "--once", help="Print one snapshot and exit."),
    interval: float = typer.Option(2.0, "--interval", min=0.2, help="Seconds between refreshes."),
    state: Path | None = StateOpt,
    as_json: bool = JsonOpt,
) -> None:
    """One row per rank: host, state, CPU, RSS, GPU, step, step time, output age, last line; suspects first."""
    job = _job(state)
    if once or as_json:
        run_id, rows = job.top()
        if as_json:
            emit_json(top_json(run_id, rows))
        else:
            out.print(_top_view(run_id, rows))
        return
    from rich.live import Live

    try:
        with Live(_top_view(*job.top()), console=out, auto_refresh=False, screen=False) as live:
            while True:
                time.sleep(interval)
                live.update(_top_view(*job.top()), refresh=True)
    except KeyboardInterrupt:  # the way to leave a live view: not an error
        return


# -------------------------------------------------------------------- rendering
def _render_stacks(report: StackReport, full: bool) -> None:
    if not report.stacks:
        err.print("no live rank to capture (nothing running on this reservation)")
        return
    methods = sorted({s.method for s in report.stacks})
    out.print(
        f"[bold]run {report.run_id}[/]: {len(report.stacks)} rank(s), {len(report.groups)} distinct stack(s) "
        f"in {report.elapsed:.2f} s ({', '.join(methods)})"
    )
    for g in report.groups:
        out.print(f"  [bold]{escape(g.describe())}[/]")
        if full:
            for f in g.frames:
                out.print(f"      {escape(str(f['function']))} ({escape(str(f['file']))}:{f['line']})")


def _render_diagnosis(d: Diagnosis) -> None:
    from ..jobs.inspector import compress

    mark = {"healthy": "[green]healthy[/]", "suspect": "[red]suspect[/]", "unknown": "[yellow]cannot tell[/]"}[
        d.verdict
    ]
    out.print(f"{mark}: {escape(d.summary)}")
    for s in d.suspects:
        out.print(f"  rank {s.rank}{' on ' + s.host if s.host else ''}:")
        for why in s.reasons:
            out.print(f"    - {escape(why)}")
    for g in d.evidence.get("stack_groups", []):
        n = len(g["ranks"])
        out.print(f"  stacks: {n} rank{'s' if n != 1 else ''} ({compress(g['ranks'])}): {escape(g['summary'])}")


def _fmt(v: float | None, spec: str, unit: str = "") -> str:
    return "-" if v is None else f"{v:{spec}}{unit}"


#: Above this many ranks, `top` shows the suspects' rows and a grid of short cells for the rest.
GRID_ABOVE = 32


def _top_view(run_id: str | None, rows: list[RankRow]) -> RenderableType:
    """One row per rank; for many ranks, the suspects' rows and then every other rank as one short cell."""
    if len(rows) <= GRID_ABOVE:
        return _top_table(run_id, rows)
    from rich.columns import Columns
    from rich.console import Group
    from rich.text import Text

    suspects = [r for r in rows if r.suspect]
    others = sorted((r for r in rows if not r.suspect), key=lambda r: r.rank)
    head = (
        _top_table(run_id, suspects) if suspects else Text(f"run {run_id}: {len(rows)} ranks, no suspect", style="bold")
    )
    cells = [
        Text(
            f"{r.rank:>4} {r.state[:8]:<8} {_fmt(r.cpu_percent, '.0f', '%'):>4} "
            f"{'-' if r.step is None else r.step:>6} {_fmt(r.output_age, '.0f', 's'):>4}"
        )
        for r in others
    ]
    legend = Text(f"{len(others)} other rank(s): rank, state, cpu, step, age of last output", style="dim")
    return Group(head, legend, Columns(cells, padding=(0, 3), equal=True))


def _top_table(run_id: str | None, rows: list[RankRow]) -> Table:
    table = Table(title=f"run {run_id}" if run_id else "no run recorded", header_style="bold", box=None)
    cols = ["rank", "host", "state", "cpu", "rss", "gpu", "step", "step ms", "output age", "last line"]
    for c in cols:
        table.add_column(c, overflow="ellipsis", no_wrap=True, max_width=60 if c == "last line" else None)
    for r in rows:
        gpu = "-" if r.gpu_util is None else f"{r.gpu_util:.0f}% {_fmt(r.gpu_mem_mb, '.0f', 'M')}"
        cells = [
            str(r.rank),
            r.host or "-",
            r.state,
            _fmt(r.cpu_percent, ".0f", "%"),
            _fmt(r.rss_mb, ".0f", "M"),
            gpu,
            "-" if r.step is None else str(r.step),
            _fmt(r.step_ms, ".1f"),
            _fmt(r.output_age, ".0f", "s"),
            r.last_line,
        ]
        style = "red" if r.suspect else None
        table.add_row(*[escape(c) for c in cells], style=style)
    suspects = [r for r in rows if r.suspect]
    if suspects:
        table.caption = escape("; ".join(f"rank {r.rank}: {r.suspect}" for r in suspects[:4]))
    return table
