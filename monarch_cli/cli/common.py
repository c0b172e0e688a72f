"""What every command shares: the app, consoles, common options, error handling."""

from __future__ import annotations

import functools
import sys
from collections.abc import Callable
from typing import Any, TypeVar

import typer

from ..config import EnvSettings
from .click_compat import click
from .console import INTERNAL_ERROR, emit_json, explain, report, rich_console, set_debug  # noqa: F401 - shared
from .console import internal_error as _internal_error
from .runs import parse_ranks  # noqa: F401 - shared

app = typer.Typer(
    name="monarch",
    no_args_is_help=True,
    add_completion=True,  # --install-completion / --show-completion; costs ~nothing per command
    context_settings={"help_option_names": ["-h", "--help"]},
)

err = rich_console(stderr=True)
out = rich_console(stderr=False)
F = TypeVar("F", bound=Callable[..., Any])

StateOpt = typer.Option(
    None,
    "--state",
    help=f"Job state file (default: ${EnvSettings.state.var}, else .monarch/job_state.pkl "
    "here or in the nearest parent directory that has a .monarch/).",
)
JsonOpt = typer.Option(False, "--json", help="Print one JSON object for scripts and agents.")
CmdArg = typer.Argument(None, help="The command, after `--`.", show_default=False)


def fail(message: str, code: int = 2, kind: str = "user", as_json: bool = False) -> None:
    """One line on stderr (or ``{"error", "kind"}`` on stdout with --json) and exit ``code``."""
    report(message, kind, as_json)
    raise typer.Exit(code)


def _wants_json(kwargs: Any) -> bool:
    if kwargs.get("as_json"):
        return True
    ctx = kwargs.get("ctx")  # commands that parse their own options (sbatch)
    args = getattr(ctx, "args", None) or []
    return "--json" in args[: args.index("--") if "--" in args else len(args)]


def internal_error(e: BaseException, as_json: bool = False) -> None:
    """A bug, not a user mistake: say so, keep the traceback in a file, show it with --debug."""
    raise typer.Exit(_internal_error(e, as_json))


def friendly(fn: F) -> F:
    """Our errors become one clear line and a non-zero exit; a bug becomes an internal error."""

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        as_json = _wants_json(kwargs)
        try:
            try:
                return fn(*args, **kwargs)
            finally:
                sys.stdout.flush()  # a closed pipe shows here, while we can still exit quietly
        except (typer.Exit, typer.Abort, click.ClickException):
            raise
        except (Exception, KeyboardInterrupt) as e:  # noqa: BLE001
            raise typer.Exit(explain(e, as_json)) from None

    return wrapper  # type: ignore[return-value]
