"""``monarch run-spmd`` and ``monarch exec``: what they do once their options are parsed.

Both are parsed either by Typer (``cli/jobs.py``, which registers them) or, for the command
lines it fully understands, by ``cli/fast.py`` without importing Typer; either way these
functions run and print, so the two routes cannot drift apart. Nothing here imports Typer,
and rich only for what needs it (a failure's table).
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import TYPE_CHECKING

from ..errors import UserError
from ..jobs.console import CLOSED_PIPE_EXIT
from .console import emit_json, err_lines, rich_console, say

if TYPE_CHECKING:  # the job API loads the runtime: imported when a command runs
    from ..jobs import RunResult


def parse_ranks(text: str | None) -> set[int] | None:
    """``--ranks``: the same syntax as ``monarch debug`` (``0,2-3``, ``0:8:2``), without a known size."""
    if text is None:
        return None
    from ..jobs.ranks import parse_rank_list

    return parse_rank_list(text, None, "--ranks")


def run_spmd(
    command: list[str] | None,
    state: Path | None,
    ranks: str | None,
    cold: bool,
    color: bool | None,
    post_mortem: bool,
    env: list[str] | None,
    workspace: Path | None,
    no_sync: bool,
    straggler_grace: float,
    as_json: bool,
    group: bool | None = None,
    stall_timeout: float | None = None,
    keep_ranks: bool = False,
) -> int:
    """``monarch run-spmd``; returns the exit status."""
    from ..jobs import job_load
    from ..jobs.plan import parse_env_flags

    job = job_load(state)
    rank_set = parse_ranks(ranks)
    stdout = sys.stderr.buffer if as_json else None  # keep stdout for the JSON result
    result = job.run_spmd(
        command or None,
        cold=cold,
        keep_ranks=keep_ranks,
        ranks=rank_set,
        color=color,
        stdout=stdout,
        post_mortem=post_mortem,
        straggler_grace=straggler_grace,
        env=parse_env_flags(env or []),
        workspace=workspace,
        sync=not no_sync,
        on_event=say,
        group=group,
        stall_timeout=stall_timeout,
    )
    if result.console_closed:  # `| head`: its ranks are ended and logged; print nothing more
        return CLOSED_PIPE_EXIT
    if as_json:
        emit_json(result.to_json())
    else:
        render_result(result)
    return result.exit_code


def exec_command(command: list[str] | None, state: Path | None, color: bool | None, as_json: bool) -> int:
    """``monarch exec``; returns the exit status."""
    if not command:
        raise UserError("give the command after `--`, e.g. monarch exec -- nvidia-smi")
    from ..jobs import job_load

    job = job_load(state)
    result = job.exec(command, color=color, stdout=sys.stderr.buffer if as_json else None, on_event=say)
    if result.console_closed:
        return CLOSED_PIPE_EXIT
    if as_json:
        emit_json(result.to_json())
    else:
        from rich.markup import escape
        from rich.table import Table  # (rich.table and what it imports: only when there is a table)

        err = rich_console(stderr=True)
        table = Table(box=None, show_header=True, header_style="bold")
        for col in ("host", "status", "time"):
            table.add_column(col)
        for r in result.ranks:
            mark = "[green]exit 0[/]" if r.ok else f"[red]{escape(r.how)}[/]"
            table.add_row(r.label, mark, f"{r.duration:.2f}s")
        err.print(table)
        if result.ending:
            err.print(f"[red]✗[/] {escape(result.ending)}; exit status {result.exit_code}")
    return result.exit_code


def _failed_first(result: RunResult) -> str:
    """A lost host is the run's failure even where a peer's rank noticed first (gloo: connection closed)."""
    first = result.first_failure
    if first is None:
        return "failed"
    if first.lost:
        return first.lost.removeprefix("lost: ")
    return f"rank {first.rank} failed first"


def render_result(result: RunResult) -> None:
    n = len(result.ranks)
    if result.exit_code == 0:
        err_lines.line(
            ("green", "✓"),
            f" {n} rank(s) finished in ",
            ("bold", f"{result.duration:.2f} s"),
            f" (run {result.run_id})",
        )
        return
    from rich.markup import escape
    from rich.table import Table

    from ..jobs.output_groups import AUTO_MIN_RANKS, failure_rows, outcome_summary

    err = rich_console(stderr=True)
    headline = result.ending or _failed_first(result)
    err.print(f"[red]✗[/] run {result.run_id}: {headline}; exit status {result.exit_code}")
    rows, left_out = result.ranks, 0
    if n > AUTO_MIN_RANKS:  # many ranks: one line by outcome, a row per distinct failure
        err.print(escape(outcome_summary(result.ranks)))
        rows, left_out = failure_rows(result.ranks)
    table = Table(header_style="bold", show_lines=False)
    for col in ("rank", "host", "status", "time", "last output"):
        table.add_column(col, overflow="fold")
    for r in rows:
        status = "[green]exit 0[/]" if r.ok else f"[red]{escape(r.how)}[/]"
        table.add_row(str(r.rank), r.host, status, f"{r.duration:.2f}s", escape("\n".join(r.tail[-3:])))
    err.print(table)
    if left_out:
        err.print(f"({left_out:,} more failed ranks ended the same way as one above; --json lists every rank)")
    err.print(f"full logs: {result.log_dir}  (monarch logs {result.run_id} --rank N)")
