"""What every command shares: the app, consoles, common options, error handling."""

from __future__ import annotations

import functools
import json
import sys
from typing import Any, Callable, Optional, Set, TypeVar

import typer
from rich.console import Console
from rich.markup import escape

from ..jobs import JobError
from ..runtime.errors import MonarchError

app = typer.Typer(
    name="monarch",
    help="Reserve hosts once, then run torchrun-style SPMD jobs on them in a fraction of a second.",
    no_args_is_help=True,
    add_completion=True,  # --install-completion / --show-completion; costs ~nothing per command
    context_settings={"help_option_names": ["-h", "--help"]},
)
err = Console(stderr=True, highlight=False, soft_wrap=True)
out = Console(highlight=False, soft_wrap=True)
F = TypeVar("F", bound=Callable[..., Any])

StateOpt = typer.Option(None, "--state", help="Job state file (default: $MONARCH_STATE, else .monarch/job_state.pkl "
                                              "here or in the nearest parent directory that has a .monarch/).")
JsonOpt = typer.Option(False, "--json", help="Print one JSON object for scripts and agents.")
CmdArg = typer.Argument(None, help="The command, after `--`.", show_default=False)


def fail(message: str, code: int = 2) -> None:
    err.print(f"[bold red]monarch: error:[/] {escape(message)}")
    raise typer.Exit(code)


def friendly(fn: F) -> F:
    """Expected failures become one clear line and a non-zero exit, never a traceback."""

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return fn(*args, **kwargs)
        except (JobError, MonarchError, ValueError, PermissionError, FileNotFoundError) as e:
            fail(str(e))
        except KeyboardInterrupt:
            err.print("[yellow]interrupted[/]")
            raise typer.Exit(130)

    return wrapper  # type: ignore[return-value]


def emit_json(data: Any) -> None:
    sys.stdout.write(json.dumps(data, indent=2, default=str) + "\n")


def parse_ranks(text: Optional[str]) -> Optional[Set[int]]:
    if text is None:
        return None
    ranks: Set[int] = set()
    try:
        for part in text.split(","):
            if "-" in part:
                lo, hi = part.split("-")
                ranks.update(range(int(lo), int(hi) + 1))
            elif part.strip():
                ranks.add(int(part))
    except ValueError:
        raise JobError(f"--ranks takes numbers and ranges like 0,2-3, not {text!r}") from None
    return ranks



