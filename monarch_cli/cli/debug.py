"""``monarch debug``: an interactive prompt over every paused rank, and scriptable subcommands."""

from __future__ import annotations

import cmd
import json
import os
import queue
import shlex
from pathlib import Path
from typing import TYPE_CHECKING, Any

import typer
from rich.markup import escape

from ..config import env
from ..jobs.debug import DebugClient, PausedRank, select_ranks, vscode_config
from ..jobs.errors import JobError
from .common import JsonOpt, StateOpt, app, emit_json, err, friendly, out
from .interrupts import reliable_ctrl_c
from .results import cast_json, paused_json, paused_summary

debug_app = typer.Typer(help="Inspect ranks paused in breakpoint() / pdb, from any terminal.", no_args_is_help=False)
app.add_typer(debug_app, name="debug")

_PROMPTS = ("(Pdb) ", ">>> ", "... ")
_HISTORY = Path(env.debug_history or Path.home() / ".monarch_debug_history")


def _client(state: Path | None, run: str | None) -> DebugClient:
    from ..jobs import job_load

    return DebugClient(job_load(state).hostset(), run)


def _where(row: PausedRank) -> str:
    """file:line, relative to here when the file is under the current directory (short columns)."""
    if not row.file:
        return "-"
    path = row.file
    if os.path.isabs(path) and path.startswith(os.getcwd() + os.sep):
        path = os.path.relpath(path)
    return f"{path}:{row.line}"


if TYPE_CHECKING:
    from rich.table import Table


def _table(rows: list[PausedRank]) -> Table:
    from rich.table import Table  # only when there is a table to show

    table = Table(header_style="bold", box=None)
    for col in ("rank", "host", "pid", "where", "function", "state", "held by"):
        table.add_column(col)
    for r in rows:
        state = r.state if r.state != "exited" else f"exited ({r.exit})"
        if r.reason == "post-mortem" and r.state == "paused":
            state = "post-mortem"
        table.add_row(
            str(r.rank),
            r.host,
            str(r.pid or "-"),
            escape(_where(r)),
            escape(r.function or "-"),
            state,
            escape(r.holder or "-"),
        )
    return table


def _split_prompt(text: str) -> tuple[str, str | None]:
    for prompt in _PROMPTS:
        if text.endswith(prompt):
            return text[: -len(prompt)], prompt
    return text, None


class DebugShell(cmd.Cmd):
    """The `monarch_dbg>` prompt. `help` lists the commands."""

    prompt = "monarch_dbg> "

    def __init__(self, client: DebugClient) -> None:
        super().__init__()
        self.client = client

    # -------------------------------------------------------------- commands
    def do_list(self, arg: str) -> None:
        """list: the paused ranks (rank, host, pid, file:line, function, state, holder)."""
        rows = self.client.list()
        if rows:
            out.print(_table(rows))
        else:
            out.print("no rank is paused (ranks pause at breakpoint(), pdb.set_trace(), or a crash with --post-mortem)")

    def do_attach(self, arg: str) -> None:
        """attach RANK: a pdb session on RANK; `detach` (or Ctrl-C, or Ctrl-D) comes back here."""
        try:
            rank = int(arg)
        except ValueError:
            out.print("usage: attach RANK")
            return
        attached_session(self.client, rank)

    def do_cast(self, arg: str) -> None:
        """cast RANKS CMD: run one pdb command on many ranks (RANKS: *, 0,3, 2-5, 0:8:2, hosts=1,gpus=0:2)."""
        ranks_expr, _, command = arg.partition(" ")
        if not command.strip():
            out.print("usage: cast RANKS CMD, e.g. cast * p loss")
            return
        print_cast(self.client.cast(select_ranks(ranks_expr, self.client.list()), command.strip()))

    def do_continue(self, arg: str) -> None:
        """continue [RANKS]: let ranks run on (all paused ranks by default)."""
        ranks = select_ranks(arg or "*", self.client.list())
        for rank, message in self.client.continue_(ranks).items():
            out.print(escape(f"[rank{rank}] {message}"))

    do_c = do_continue

    def do_quit(self, arg: str) -> bool:
        """quit: leave; paused ranks stay paused for the next `monarch debug`."""
        return True

    do_exit = do_quit

    def do_EOF(self, arg: str) -> bool:  # noqa: N802 - cmd's name for Ctrl-D
        print()
        return True

    def emptyline(self) -> bool:
        return False

    def default(self, line: str) -> None:
        out.print(f"unknown command {escape(line.split()[0])!r}; `help` lists the commands")

    def onecmd(self, line: str) -> bool:
        try:
            return super().onecmd(line)
        except JobError as e:
            err.print(f"[red]error:[/] {escape(str(e))}")
            return False


def attached_session(client: DebugClient, rank: int) -> None:
    """Relay a pdb session until detach, Ctrl-C/Ctrl-D, or the rank runs on or exits."""
    info = client.attach(rank)
    text, prompt = _split_prompt(info["unseen"])
    out.print(f"[dim]attached to rank {rank}; `detach` or Ctrl-C returns to monarch_dbg[/]")
    print(text, end="", flush=True)
    if prompt is None:
        prompt = "(Pdb) "
    try:
        while prompt is not None:
            try:
                line = input(prompt)
            except EOFError:
                if prompt in (">>> ", "... "):
                    client.send(rank, "\x04")  # leave `interact`, stay in pdb
                    prompt = _relay(client, rank)
                    continue
                print()
                break
            if line.strip() == "detach":
                break
            client.send(rank, line)
            prompt = _relay(client, rank)
    except KeyboardInterrupt:
        print()
    finally:
        client.detach(rank)


def _relay(client: DebugClient, rank: int) -> str | None:
    """Print the rank's answer; the next prompt, or None when the session is over."""
    pending = ""
    while True:
        try:
            kind, r, what, detail = client.events.get(timeout=0.5)
        except queue.Empty:
            continue
        if r != rank:
            continue
        if kind == "output":
            pending += what
            text, prompt = _split_prompt(pending)
            print(text, end="", flush=True)
            pending = ""
            if prompt is not None:
                return prompt
        elif what == "running":
            out.print(f"[dim]rank {rank} is running again; detached[/]")
            return None
        elif what == "exited":
            out.print(f"[yellow]rank {rank} exited ({escape(str(detail))}); session ended[/]")
            return None
        elif what == "lost":
            out.print(f"[red]rank {rank}: {escape(str(detail))}; session ended[/]")
            return None


def print_cast(results: dict) -> None:
    for rank, result in results.items():
        if isinstance(result, Exception):
            err.print(escape(f"[rank{rank}] ") + f"[red]{escape(str(result))}[/]")
            continue
        for line in result["output"].rstrip("\n").splitlines() or [""]:
            print(f"[rank{rank}] {line}")


# ------------------------------------------------------------------ commands
@debug_app.callback(invoke_without_command=True)
@friendly
def debug_main(
    ctx: typer.Context,
    state: Path | None = StateOpt,
    run: str | None = typer.Option(None, "--run", help="Run id (default: the newest run with paused ranks)."),
    dap: int | None = typer.Option(
        None,
        "--dap",
        help="Relay an IDE (debugpy / DAP) to RANK from a local port only you can use; runs until the rank ends or Ctrl-C.",
    ),
    as_json: bool = JsonOpt,
) -> None:
    """The interactive prompt: list, attach RANK, cast RANKS CMD, continue [RANKS], quit."""
    if ctx.invoked_subcommand is not None:
        return
    client = _client(state, run)
    try:
        if dap is not None:
            _dap(client, dap, as_json)
            return
        _load_history()
        shell = DebugShell(client)
        rows = client.list()
        intro = paused_summary(rows)
        out.print(f"monarch debug: {intro}; type `help` for commands")
        if rows:
            out.print(_table(rows))
        try:
            with reliable_ctrl_c():
                shell.cmdloop()
        except KeyboardInterrupt:
            print()
        _save_history()
    finally:
        client.close()


def _dap(client: DebugClient, rank: int, as_json: bool) -> None:
    """Relay an IDE to the rank from a port here that only this user can use, until the rank ends or Ctrl-C."""
    relay = client.dap(rank)
    try:
        info = relay.info()
        config = vscode_config(rank, info)
        if as_json:  # one line, at once: a script reads it, then connects
            print(json.dumps({"rank": rank, **info, "vscode": config}), flush=True)
        else:
            out.print(
                f"rank {rank}: attach your IDE (DAP) to [bold]{info['host']}:{info['port']}[/] "
                "(this machine, your user only)"
            )
            out.print("If it was paused in pdb it now waits for the IDE and then runs on under it.")
            out.print("VS Code launch.json entry:")
            print(json.dumps(config, indent=2))
            out.print("[dim]relaying until the rank exits; Ctrl-C stops (the rank runs on)[/]")
        with reliable_ctrl_c():
            why = relay.serve(on_notice=lambda msg: err.print(f"[yellow]monarch debug:[/] {escape(msg)}"))
        err.print(escape(why))
    except KeyboardInterrupt:
        pass
    finally:
        relay.close()


@debug_app.command("list")
@friendly
def list_cmd(
    state: Path | None = StateOpt, run: str | None = typer.Option(None, "--run"), as_json: bool = JsonOpt
) -> None:
    """The paused ranks."""
    rows = _client(state, run).list()
    if as_json:
        emit_json(paused_json(rows))
    elif rows:
        out.print(_table(rows))
    else:
        out.print("no rank is paused")


@debug_app.command("attach")
@friendly
def attach_cmd(rank: int, state: Path | None = StateOpt, run: str | None = typer.Option(None, "--run")) -> None:
    """A pdb session on RANK (leave with `detach`, Ctrl-C or Ctrl-D)."""
    _load_history()
    client = _client(state, run)
    try:
        with reliable_ctrl_c():
            attached_session(client, rank)
    finally:
        client.close()
        _save_history()


@debug_app.command("cast")
@friendly
def cast_cmd(
    ranks: str,
    command: list[str] = typer.Argument(..., help="The pdb command."),
    state: Path | None = StateOpt,
    run: str | None = typer.Option(None, "--run"),
    as_json: bool = JsonOpt,
) -> None:
    """Run one pdb command on RANKS and print each rank's output."""
    client = _client(state, run)
    line = shlex.join(command) if len(command) > 1 else command[0]
    results = client.cast(select_ranks(ranks, client.list()), line)
    if as_json:
        emit_json(cast_json(results))
    else:
        print_cast(results)
    if any(isinstance(v, Exception) for v in results.values()):
        raise typer.Exit(1)


@debug_app.command("continue")
@friendly
def continue_cmd(
    ranks: str = typer.Argument("*", help="Which ranks (default: all paused)."),
    state: Path | None = StateOpt,
    run: str | None = typer.Option(None, "--run"),
    as_json: bool = JsonOpt,
) -> None:
    """Let paused ranks run on."""
    client = _client(state, run)
    rows = client.list()
    results = client.continue_(select_ranks(ranks, rows)) if rows else {}
    if as_json:
        emit_json({str(r): m for r, m in results.items()})
        return
    if not results:
        out.print("no rank is paused; nothing to continue")
    for rank, message in results.items():
        out.print(escape(f"[rank{rank}] {message}"))


def _load_history() -> None:
    try:
        import readline

        readline.read_history_file(_HISTORY)
    except (ImportError, OSError):
        pass


def _save_history() -> None:
    try:
        import readline

        readline.set_history_length(1000)
        readline.write_history_file(_HISTORY)
    except (ImportError, OSError):
        pass


__all__: list[Any] = ["debug_app"]
