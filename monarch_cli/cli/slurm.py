"""Slurm commands: ``monarch sbatch`` (unattended runs), and the Slurm parts of status/logs."""

from __future__ import annotations

import shlex
import time
from pathlib import Path

import typer
from rich.markup import escape

from .common import app, emit_json, err, fail, friendly, out

_OWN_FLAGS = ("--dry-run", "--json", "--wait")
_OWN_VALUES = ("--state",)


@app.command(
    "sbatch",
    context_settings={"ignore_unknown_options": True, "allow_extra_args": True, "allow_interspersed_args": False},
    options_metavar="[SBATCH OPTIONS] [--dry-run] [--wait] [--json] [--state PATH]",
)
@friendly
def sbatch_cmd(ctx: typer.Context) -> None:
    """Submit an unattended run on Slurm: `monarch sbatch [SBATCH OPTIONS] -- torchrun ... train.py`.

    Any sbatch option goes before `--`, e.g. `-N 2 --time=1:00:00 --signal=B:USR1@120 -p gpu`.

    In the allocation, monarch starts one agent per node and runs the command once: rank-prefixed output goes to
    the job's output file, per-rank logs to the state directory; the job's exit code is the run's.

    Prints the job id; follow the job with `monarch status --job ID` and `monarch logs --job ID`.

    Own options: --dry-run (print the script, submit nothing), --wait (wait; exit with the job's status), --json,
    --state PATH (where the job's state and logs go).
    """
    from ..jobs.slurm_batch import batch_script, batch_status, split_sbatch_options, submit_batch

    own, options, command = split_sbatch_options(ctx.args, _OWN_FLAGS, _OWN_VALUES)
    state = Path(own["--state"]) if "--state" in own else None
    as_json = bool(own.get("--json"))
    if not command:
        fail("give the command after `--`, e.g. monarch sbatch -N 2 -- torchrun --nproc-per-node=2 train.py")
    if own.get("--dry-run"):
        script = batch_script(command, options, state)  # every check the real submit makes
        if as_json:
            emit_json({"script": script, "submit": "sbatch --parsable SCRIPT"})
        else:
            out.print(escape(script), end="", soft_wrap=True)
        return

    def submitted(job_id: str) -> None:
        if as_json:
            return
        out.print(job_id)
        err.print(
            f"[green]✓[/] submitted Slurm job [bold]{job_id}[/]; follow it with "
            f"[bold]monarch status --job {job_id}[/] and [bold]monarch logs --job {job_id} -f[/]"
        )

    job_id, code = submit_batch(command, options, state, wait=bool(own.get("--wait")), on_submitted=submitted)
    if as_json:
        emit_json(
            {
                "job_id": job_id,
                "exit_code": code,
                **({"status": batch_status(job_id, state)} if code is not None else {}),
            }
        )
    elif code is not None:
        err.print(f"{'[green]✓[/]' if code == 0 else '[red]✗[/]'} Slurm job {job_id} ended with exit status {code}")
    raise typer.Exit(code or 0)


def batch_status_cmd(job_id: str, state: Path | None, as_json: bool) -> None:
    """``monarch status --job ID``: Slurm's view of a batch job, its run and its result."""
    from ..jobs.slurm_batch import batch_status

    info = batch_status(job_id, state)
    if as_json:
        emit_json(info)
        raise typer.Exit(0 if info["alive"] or info.get("exit_code") == 0 else 1)
    slurm = info.get("slurm") or {}
    where = f"; {slurm['state']}" if slurm else "; no longer known to Slurm"
    phase = info.get("phase", "not started")
    out.print(f"[bold]Slurm job {job_id}[/] (monarch sbatch): {phase}{escape(where)}")
    if slurm:
        from ..schedulers.slurm.scheduler import slurm_line

        out.print(escape(slurm_line({"job_id": job_id, **slurm})))
    if info.get("command"):
        out.print(f"command: {escape(shlex.join(info['command']))}")
    res = info.get("reservation")
    if res:
        hosts = ", ".join(f"{h['name']} ({'up' if h['alive'] else 'down'})" for h in res["hosts"])
        out.print(f"hosts: {escape(hosts)}")
    if phase == "finished":
        code = info.get("exit_code")
        mark = "[green]ok[/]" if code == 0 else f"[red]exit {code}[/]"
        ago = f", {time.time() - info['finished_at']:.0f} s ago" if info.get("finished_at") else ""
        failed = f", rank {info['first_failure']} failed first" if info.get("first_failure") is not None else ""
        out.print(f"result: {mark}{failed}{ago}")
        if info.get("error"):
            out.print(f"[red]{escape(info['error'])}[/]")
    if info.get("log_dir"):
        out.print(f"logs: {escape(info['log_dir'])}  (monarch logs --job {job_id} [--rank N])")
    raise typer.Exit(0 if info["alive"] or info.get("exit_code") == 0 else 1)


__all__ = ["sbatch_cmd", "batch_status_cmd"]
