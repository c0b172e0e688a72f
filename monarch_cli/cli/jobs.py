"""Commands for reservations and runs: serve, run-spmd, exec, status, stop, logs, demo."""

from __future__ import annotations

import shlex
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import typer
from rich.markup import escape

from ..config import EnvSettings, env
from ..jobs.run_log import split as split_run_log
from ..jobs.state import NoReservation, StateError, state_path
from . import results, runs
from .backend_options import BackendOptionsCommand, BackendStopOptionsCommand, backend_options
from .common import CmdArg, JsonOpt, StateOpt, app, emit_json, err, fail, friendly, out
from .runs import render_result as _render_result

_OTLP_ENV = EnvSettings.otlp_endpoint.var


# ------------------------------------------------------------------- commands
@app.command("serve", cls=BackendOptionsCommand)
@friendly
def serve_cmd(
    ctx: typer.Context,
    command: list[str] | None = CmdArg,
    scheduler: str = typer.Option(
        "local",
        "--scheduler",
        "-s",
        help="The backend: local (alias local_cwd), slurm, ssh, kubernetes, "
        "skypilot, or one a package registers; its options are listed below.",
    ),
    hosts: str | None = typer.Option(
        None,
        "--hosts",
        "-n",
        metavar="N|NAMES",
        help="How many hosts to reserve (default 1; inside a Slurm allocation, all its "
        "nodes), or, for a backend that reaches hosts by name (ssh), their names: h1,h2.",
    ),
    state: Path | None = StateOpt,
    dry_run: bool = typer.Option(
        False, "--dry-run", help="Print the plan (with --json: as JSON for --plan), start nothing."
    ),
    plan_file: Path | None = typer.Option(
        None, "--plan", help="Reserve exactly this plan (what --dry-run --json printed)."
    ),
    replace: bool = typer.Option(False, "--replace", help="Release an existing reservation that cannot serve this."),
    preload: str | None = typer.Option(None, "--preload", help="Modules warm ranks import up front (default: torch)."),
    agent_port: int | None = typer.Option(
        None, "--agent-port", min=1, max=65535, help="Agents listen on this port (local: port+i for host i)."
    ),
    port_range: str | None = typer.Option(
        None, "--port-range", metavar="LO-HI", help="Keep every port agents, procs and ranks open within LO-HI."
    ),
    option: list[str] | None = typer.Option(
        None, "--option", "-o", metavar="KEY=VALUE", help="A backend option (repeatable), e.g. -o partition=gpu."
    ),
    nodes: int | None = typer.Option(None, "--nodes", "-N", min=1, help="Same as --hosts."),
    otlp: str | None = typer.Option(
        None,
        "--otlp",
        metavar="ENDPOINT",
        help="Export runs to this OpenTelemetry collector (OTLP/HTTP, e.g. http://localhost:4318): rank "
        f"metrics, run/rank spans, output as logs. 'off' stops it; 'env' takes it from ${_OTLP_ENV} "
        "(for an endpoint with credentials, which a command line would show to every user). Needs the 'otlp' extra.",
    ),
    as_json: bool = JsonOpt,
) -> None:
    """Reserve hosts and leave them up; reuse a reservation that can serve the request."""
    from ..jobs import dryrun, reserve_plan, serve

    if otlp is not None and otlp != "off":
        otlp = _otlp_endpoint(otlp, as_json)

    if plan_file is not None:
        started = time.monotonic()
        with err.status("reserving...") as spinner:
            job = reserve_plan(
                _read_plan(plan_file), state=state, replace=replace, progress=lambda msg: spinner.update(escape(msg))
            )
        if otlp is not None:
            from ..jobs.otlp import set_endpoint

            set_endpoint(job.path.parent, otlp)
        _served(job, started, as_json)
        return
    hosts = str(nodes) if nodes is not None else hosts
    options = backend_options(ctx, scheduler, option)
    ports = _port_range(port_range)
    if dry_run:
        plan = dryrun(
            command,
            scheduler,
            hosts=hosts,
            state=state,
            preload=preload,
            agent_port=agent_port,
            port_range=ports,
            **options,
        )
        if as_json:
            emit_json(plan.to_json())
        else:
            out.print(escape(plan.render()), soft_wrap=True)
        return
    started = time.monotonic()
    with err.status("reserving...") as spinner:
        job = serve(
            command,
            scheduler,
            hosts=hosts,
            state=state,
            replace=replace,
            preload=preload,
            agent_port=agent_port,
            port_range=ports,
            progress=lambda msg: spinner.update(escape(msg)),
            **options,
        )
    if otlp is not None:
        from ..jobs.otlp import set_endpoint

        set_endpoint(job.path.parent, otlp)
    _served(job, started, as_json)


def _read_plan(path: Path) -> Any:
    from ..errors import PlanError

    try:
        return sys.stdin.read() if str(path) == "-" else path.read_text()
    except OSError as e:
        raise PlanError(f"cannot read the plan {path}: {e.strerror or e}") from None


def _port_range(text: str | None) -> tuple[int, int] | None:
    if text is None:
        return None
    from ..errors import UserError
    from ..runtime.launch.command import parse_port_range

    try:
        return parse_port_range(text)
    except ValueError as e:
        raise UserError(f"--port-range: {e}") from None


def _served(job: Any, started: float, as_json: bool) -> None:
    if as_json:
        emit_json(job.status())
        return
    s = job.state
    err.print(
        f"[green]✓[/] reservation [bold]{s.reservation_id}[/] ({s.scheduler}, {len(s.hosts)} host(s)) "
        f"ready in {time.monotonic() - started:.2f} s; state in {job.path}"
    )
    if s.default_command:
        err.print(f"  run it with: [bold]monarch run-spmd[/]   ({escape(shlex.join(s.default_command))})")
    else:
        err.print("  run something with: [bold]monarch run-spmd -- torchrun --nproc-per-node=2 train.py[/]")


@app.command("run-spmd", context_settings={"allow_interspersed_args": False})
@friendly
def run_spmd_cmd(
    command: list[str] | None = CmdArg,
    state: Path | None = StateOpt,
    ranks: str | None = typer.Option(None, "--ranks", help="Only print these ranks (e.g. 0,2-3); all are logged."),
    cold: bool = typer.Option(False, "--cold", help="Start ranks in fresh interpreters (skip the warm start)."),
    keep_ranks: bool = typer.Option(
        False,
        "--keep-ranks",
        help="Keep the rank processes for the next --keep-ranks run: imports, CUDA context and compiled "
        "graphs survive; globals, process group, seeds and logging are reset.",
    ),
    color: bool | None = typer.Option(
        None, "--color/--no-color", help="Colour rank prefixes (default: on a terminal)."
    ),
    post_mortem: bool = typer.Option(
        False, "--post-mortem", help="Keep a rank that raises paused in pdb at the failing frame."
    ),
    env: list[str] | None = typer.Option(
        None, "--env", "-e", help="NAME=VALUE, or NAME to forward this shell's value, to every rank (repeatable)."
    ),
    workspace: Path | None = typer.Option(
        None,
        "--workspace",
        help="Directory mirrored to hosts that do not share this filesystem (default: where the command runs).",
    ),
    no_sync: bool = typer.Option(False, "--no-sync", help="Do not mirror the workspace before the run."),
    straggler_grace: float = typer.Option(
        30.0,
        "--straggler-grace",
        min=0,
        metavar="SECONDS",
        help="Name the ranks still running this long after the first one ended.",
    ),
    group: bool | None = typer.Option(
        None,
        "--group/--no-group",
        help="Print a line many ranks print alike once, as [rank 0-4095] (default: when over 16 ranks are shown).",
    ),
    stall_timeout: float | None = typer.Option(
        None,
        "--stall-timeout",
        min=0,
        metavar="SECONDS",
        help="End the run when no rank prints or finishes a step for this long while its hosts answer "
        f"(default: ${EnvSettings.stall_timeout.var}, else never).",
    ),
    as_json: bool = JsonOpt,
) -> None:
    """Run the served command (or the one after `--`) on every host of the reservation.

    Ctrl-C sends SIGINT to the ranks, a second Ctrl-C kills them. SIGTERM, SIGHUP or SIGQUIT
    to monarch is forwarded to the ranks, which get torchrun's --shutdown-timeout (30 s)
    before SIGKILL; the exit status is then 128+N. A run whose reservation is stopped exits 254.
    """
    raise typer.Exit(
        runs.run_spmd(
            command,
            state,
            ranks,
            cold,
            color,
            post_mortem,
            env,
            workspace,
            no_sync,
            straggler_grace,
            as_json,
            group,
            stall_timeout,
            keep_ranks,
        )
    )


@app.command("sync")
@friendly
def sync_cmd(
    workspace: Path | None = typer.Option(None, "--workspace", help="Directory to mirror (default: here)."),
    state: Path | None = StateOpt,
    as_json: bool = JsonOpt,
) -> None:
    """Mirror the workspace to the hosts that do not share this filesystem now (run-spmd does it too)."""
    from ..jobs import job_load

    report = job_load(state).sync(workspace)
    if as_json:
        emit_json(report.to_json())
    else:
        for warning in report.warnings:
            err.print(f"[yellow]![/] {escape(warning)}")
        err.print(f"[green]✓[/] {escape(str(report))}")


@app.command("exec", context_settings={"allow_interspersed_args": False})
@friendly
def exec_cmd(
    command: list[str] | None = CmdArg,
    state: Path | None = StateOpt,
    color: bool | None = typer.Option(None, "--color/--no-color"),
    as_json: bool = JsonOpt,
) -> None:
    """Run a shell command on every host, with host-prefixed output and per-host exit codes."""
    raise typer.Exit(runs.exec_command(command, state, color, as_json))


@app.command("status")
@friendly
def status_cmd(
    state: Path | None = StateOpt,
    job_id: str | None = typer.Option(None, "--job", help="A `monarch sbatch` job id: its Slurm state and run."),
    show_all: bool = typer.Option(False, "--all", help="A row for every host, however many."),
    as_json: bool = JsonOpt,
) -> None:
    """The reservation: scheduler, hosts and agent liveness, age, last run."""
    if job_id is not None:
        from .slurm import batch_status_cmd  # batch jobs (monarch sbatch)

        batch_status_cmd(job_id, state, as_json)
        return
    from ..jobs import job_load

    try:
        job = job_load(state)
    except NoReservation as e:
        if as_json:
            emit_json(results.no_reservation_json(str(e)))
            raise typer.Exit(1) from None
        raise
    info = job.status()
    if as_json:
        emit_json(info)
        raise typer.Exit(0 if info["alive"] else 1)
    health = "[green]up[/]" if info["alive"] else "[red]gone[/]"
    out.print(
        f"[bold]{info['reservation_id']}[/] ({info['scheduler']}) {health}, "
        f"made {_age(info['age_seconds'])} ago; state: {info['state_file']}"
    )
    if info["stale"]:
        out.print(f"[red]{escape(info['stale'])}[/]")
    for line in info.get("scheduler_lines", []):
        out.print(escape(line))
    if info.get("relays"):
        out.print(f"asked {len(info['hosts']):,} hosts through {info['relays']} of them (relays)")
    from rich.table import Table

    table = Table(box=None, header_style="bold")
    for col in ("host", "agent", "alive", "ranks running", "warm process"):
        table.add_column(col)
    shown, rest = _status_rows(info["hosts"], show_all)
    for h in shown:
        table.add_row(
            h["name"],
            h["agent"],
            "[green]yes[/]" if h["alive"] else "[red]no[/]",
            "-" if h["ranks_running"] is None else str(h["ranks_running"]),
            _warm_cell(h.get("warm")),
        )
    out.print(table)
    if rest:
        running = sum(h["ranks_running"] or 0 for h in rest)
        out.print(
            f"… and {len(rest):,} more hosts, all answering, {running:,} ranks running on them "
            "(`--all` for a row each, `--json` for every field)"
        )
    if info["default_command"]:
        where = f"  (in {info['default_cwd']})" if info.get("default_cwd") else ""
        out.print(f"default command: {escape(shlex.join(info['default_command']))}{escape(where)}")
    last = info["last_run"]
    if last:
        outcome = "[green]ok[/]" if last["exit_code"] == 0 else f"[red]exit {last['exit_code']}[/]"
        out.print(
            f"last run: {last['run_id']} {outcome} in {last['duration']:.2f} s, "
            f"{_age(time.time() - last['finished_at'])} ago"
        )
    raise typer.Exit(0 if info["alive"] else 1)


@app.command("warm")
@friendly
def warm_cmd(
    forget: bool = typer.Option(False, "--forget", help="Forget the modules learned from past runs, on every host."),
    state: Path | None = StateOpt,
    as_json: bool = JsonOpt,
) -> None:
    """Each host's warm process: modules it holds, learned from past runs, left out, memory."""
    from ..jobs import job_load

    job = job_load(state)
    if forget:
        forgotten = job.forget_preload()
        _done_msg(
            as_json,
            {"forgotten": forgotten},
            "forgot " + ", ".join(f"{n} module(s) on {h}" for h, n in forgotten.items()),
        )
        return
    if as_json:
        emit_json(results.warm_json(job))
        return
    for h in job.status()["hosts"]:
        out.print(f"[bold]{h['name']}[/]: {_warm_cell(h['warm'])}")
        warm = h["warm"] or {}
        for name, why in sorted(warm.get("excluded", {}).items()):
            out.print(f"  left out: {escape(name)} ({escape(why)})")


@app.command("stop", cls=BackendStopOptionsCommand)
@friendly
def stop_cmd(
    ctx: typer.Context,
    state: Path | None = StateOpt,
    force: bool = typer.Option(False, "--force", help="Also clear an unreadable state file."),
    option: list[str] | None = typer.Option(
        None,
        "--option",
        "-o",
        metavar="KEY=VALUE",
        help="A stop option of the reservation's backend (repeatable), e.g. -o keep_cluster=true.",
    ),
    as_json: bool = JsonOpt,
) -> None:
    """Release the reservation; none of its processes is left. Nothing to stop is not an error.

    A backend may offer stop options (listed below): they apply to its reservations only."""
    from ..jobs import clear_unreadable, job_load

    try:
        job = job_load(state)
    except NoReservation:
        _done_msg(
            as_json,
            results.NOTHING_TO_STOP,
            f"nothing to stop: no reservation at {state_path(state)}",
        )
        return
    except StateError:
        if not force:
            raise
        cleared = clear_unreadable(state)
        stopped = cleared["agents_stopped"]
        _done_msg(
            as_json,
            {"stopped": None, **cleared},
            "cleared the unreadable state file" + (f" and stopped its {len(stopped)} agent(s)" if stopped else ""),
        )
        return
    rid = job.state.reservation_id
    ended = job.stop(**backend_options(ctx, job.state.scheduler, option, "stop_options"))
    told = f" (run {', '.join(ended)} in progress was told and ends with exit status 254)" if ended else ""
    _done_msg(as_json, results.stopped_json(rid, ended), f"released reservation {rid}{told}")


@app.command("logs")
@friendly
def logs_cmd(
    run: str | None = typer.Argument(None, help="Run id (default: the latest)."),
    rank: int | None = typer.Option(None, "--rank", "-r", help="Only this rank, raw."),
    follow: bool = typer.Option(False, "--follow", "-f", help="Keep printing until the run ends."),
    state: Path | None = StateOpt,
    job_id: str | None = typer.Option(None, "--job", help="A `monarch sbatch` job id: that job's runs."),
    as_json: bool = JsonOpt,
) -> None:
    """Print a run's per-rank logs (kept under .monarch/logs/<run-id>/)."""
    run_dir, files = results.run_logs(results.logs_root(state, job_id), run, rank)
    if as_json:
        emit_json(results.logs_json(run_dir, files))
        return
    _print_logs(run_dir, files, raw=rank is not None, follow=follow)


@app.command("demo")
@friendly
def demo_cmd(
    hosts: int = typer.Option(2, "--hosts", min=1),
    runs: int = typer.Option(2, "--runs", min=1),
) -> None:
    """Serve local hosts, run the bundled DDP example a few times (timed), stop. No cluster needed."""
    from ..jobs import serve

    script = Path(__file__).resolve().parents[1] / "templates" / "train_ddp.py"
    with tempfile.TemporaryDirectory(prefix="monarch-demo-") as tmp:
        state = Path(tmp) / ".monarch" / "job_state.pkl"
        cmd = ["torchrun", "--nproc-per-node=2", str(script), "--epochs", "2"]
        err.print(f"[bold]1.[/] monarch serve --hosts {hosts} -- {escape(shlex.join(cmd))}")
        t = time.monotonic()
        job = serve(cmd, hosts=hosts, state=state)
        err.print(f"   reserved {hosts} local host(s) in {time.monotonic() - t:.2f} s")
        code = 0
        try:
            for i in range(runs):
                err.print(f"[bold]{i + 2}.[/] monarch run-spmd   (run {i + 1} of {runs})")
                result = job.run_spmd()
                _render_result(result)
                code = code or result.exit_code
                if i == 0 and runs > 1:
                    with err.status(
                        "the hosts' warm processes learn what the ranks imported (in the background; "
                        "a run would not wait for it)..."
                    ):
                        job.wait_warm()
        finally:
            err.print(f"[bold]{runs + 2}.[/] monarch stop")
            job.stop()
    raise typer.Exit(code)


# -------------------------------------------------------------------- rendering
def _print_logs(run_dir: Path, files: list[Path], raw: bool, follow: bool) -> None:
    offsets = {f: 0 for f in files}
    sink = sys.stdout.buffer
    while True:
        if follow:
            split_run_log(run_dir)  # what the run wrote since
        for f in files:
            with open(f, "rb") as fh:
                fh.seek(offsets[f])
                data = fh.read()
            if not data:
                continue
            complete = data if not follow else data[: data.rfind(b"\n") + 1]
            offsets[f] += len(complete)
            if raw:
                sink.write(complete)
            else:
                prefix = f"[{f.stem}] ".encode()
                sink.write(b"".join(prefix + line for line in complete.splitlines(keepends=True)))
            sink.flush()
        if not follow or (run_dir / "result.json").exists():
            return
        ended = results.ended_without_result(run_dir)
        if ended is not None:  # its client died: nothing more comes
            from ..errors import UserError

            raise UserError(ended)
        time.sleep(0.2)


#: Hosts shown one row each by `monarch status` before the rest are summed up in a line.
_STATUS_ROWS = 32


def _status_rows(hosts: list[dict[str, Any]], show_all: bool) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """The hosts that get a row, and the rest (all answering): every host that does not answer
    gets its row, whatever the count; 4,096 rows of hosts that do were a screen nobody reads."""
    if show_all or len(hosts) <= _STATUS_ROWS:
        return hosts, []
    first = _STATUS_ROWS // 2
    shown = [h for i, h in enumerate(hosts) if i < first or not h["alive"]]
    return shown, [h for i, h in enumerate(hosts) if i >= first and h["alive"]]


def _warm_cell(warm: dict | None) -> str:
    if not warm:
        return "-"
    if not warm["ready"]:
        return "starting"
    rss = f", {warm['rss_bytes'] / 2**20:.0f} MiB" if warm.get("rss_bytes") else ""
    learned = f" ({warm['learned_held']} learned)" if warm["learned_held"] else ""
    warming = ", warming more" if warm["warming"] else ""
    spares = warm.get("spares") or 0
    kept = f", {spares} spare{'s' if spares != 1 else ''}" if spares else ""
    return f"{warm['modules']} modules{learned}{rss}, up {_age(time.time() - warm['since'])}{kept}{warming}"


def _age(seconds: float) -> str:
    if seconds < 120:
        return f"{seconds:.0f} s"
    if seconds < 7200:
        return f"{seconds / 60:.0f} min"
    return f"{seconds / 3600:.1f} h"


def _done_msg(as_json: bool, data: Any, text: str) -> None:
    if as_json:
        emit_json(data)
    else:
        err.print(f"[green]✓[/] {escape(text)}")


def _otlp_endpoint(given: str, as_json: bool) -> str:
    """``--otlp``'s endpoint: the URL given, or with ``env`` $MONARCH_OTLP_ENDPOINT's; one with
    credentials is refused on the command line (``ps`` shows it to every user)."""
    from ..jobs.otlp import carries_credentials, check_endpoint, redact

    endpoint = (env.otlp_endpoint or "") if given == "env" else given
    if given == "env" and not endpoint:
        fail(f"--otlp env: ${_OTLP_ENV} is not set", as_json=as_json)
    if given != "env" and carries_credentials(given):
        fail(
            f"--otlp {redact(given)}: an endpoint with credentials on a command line is visible to every user "
            f"(ps); export {_OTLP_ENV}=<url> and pass --otlp env",
            as_json=as_json,
        )
    try:
        check_endpoint(endpoint)
    except ValueError as e:
        fail(str(e), as_json=as_json)
    return endpoint
