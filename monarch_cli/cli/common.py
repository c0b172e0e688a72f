"""What every command shares: the app, consoles, common options, error handling."""

from __future__ import annotations

import functools
import json
import os
import sys
import tempfile
import threading
import time
import traceback
from pathlib import Path
from typing import Any, Callable, Optional, Set, TypeVar

import typer
from rich.console import Console

from .click_compat import click
from rich.markup import escape

from ..errors import MonarchError, UserError
from ..jobs.console import CLOSED_PIPE_EXIT, silence

app = typer.Typer(
    name="monarch",
    no_args_is_help=True,
    add_completion=True,  # --install-completion / --show-completion; costs ~nothing per command
    context_settings={"help_option_names": ["-h", "--help"]},
)


class _Console(Console):
    def on_broken_pipe(self) -> None:
        """Its reader left (`| head`): quiet from now on; the main thread exits as a closed pipe says."""
        silence(sys.stdout)
        silence(sys.stderr)
        self.quiet = True
        if threading.current_thread() is threading.main_thread():
            raise SystemExit(CLOSED_PIPE_EXIT)


err = _Console(stderr=True, highlight=False, soft_wrap=True)
out = _Console(highlight=False, soft_wrap=True)
F = TypeVar("F", bound=Callable[..., Any])

StateOpt = typer.Option(None, "--state", help="Job state file (default: $MONARCH_STATE, else .monarch/job_state.pkl "
                                              "here or in the nearest parent directory that has a .monarch/).")
JsonOpt = typer.Option(False, "--json", help="Print one JSON object for scripts and agents.")
CmdArg = typer.Argument(None, help="The command, after `--`.", show_default=False)


#: Exit status of an internal error (a bug): sysexits' EX_SOFTWARE.
INTERNAL_ERROR = 70
_debug = {"on": bool(os.environ.get("MONARCH_DEBUG"))}


def set_debug(on: bool) -> None:
    """``monarch --debug``: show the traceback of an internal error (the root callback calls this)."""
    if on:
        _debug["on"] = True


def fail(message: str, code: int = 2, kind: str = "user", as_json: bool = False) -> None:
    """One line on stderr (or ``{"error", "kind"}`` on stdout with --json) and exit ``code``."""
    if as_json:
        emit_json({"error": message, "kind": kind})
    else:
        err.print(f"[bold red]monarch: error:[/] {escape(message)}")
    raise typer.Exit(code)


def _wants_json(kwargs: Any) -> bool:
    if kwargs.get("as_json"):
        return True
    ctx = kwargs.get("ctx")  # commands that parse their own options (sbatch)
    args = getattr(ctx, "args", None) or []
    return "--json" in args[: args.index("--") if "--" in args else len(args)]


def internal_error(e: BaseException, as_json: bool = False) -> None:
    """A bug, not a user mistake: say so, keep the traceback in a file, show it with --debug."""
    text = "".join(traceback.format_exception(type(e), e, e.__traceback__))
    where = _save_traceback(text)
    saved = f"traceback in {where}" if where else "the traceback could not be saved"
    message = f"internal error: {type(e).__name__}: {e} (a bug in monarch-cli; {saved}; rerun with --debug to see it)"
    if _debug["on"]:
        sys.stderr.write(text)
    fail(" ".join(message.split()), INTERNAL_ERROR, "internal", as_json)


def _save_traceback(text: str) -> Optional[str]:
    directory = Path(tempfile.gettempdir()) / f"monarch-{os.getuid()}" / "errors"
    try:
        directory.mkdir(mode=0o700, parents=True, exist_ok=True)
        path = directory / f"error-{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}.txt"
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)  # may quote paths and arguments
        with os.fdopen(fd, "w") as f:
            f.write(f"monarch {' '.join(sys.argv[1:])}\n\n{text}")
        return str(path)
    except OSError:
        return None


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
        except BrokenPipeError:  # `monarch ... | head`: the reader left; stop quietly, as Unix tools do
            silence(sys.stdout)
            silence(sys.stderr)
            raise typer.Exit(CLOSED_PIPE_EXIT) from None
        except MonarchError as e:
            if _debug["on"] and not isinstance(e, UserError):
                traceback.print_exc()
            fail(" ".join(str(e).split()) if isinstance(e, UserError) else str(e), 2 if isinstance(e, UserError) else 1,
                 e.kind, as_json)
        except OSError as e:  # the machine said no (permissions, a missing file): not a bug
            fail(f"{e.strerror or e}: {e.filename}" if e.filename else str(e), 2, "os", as_json)
        except KeyboardInterrupt:
            if as_json:
                emit_json({"error": "interrupted", "kind": "interrupted"})
            else:
                err.print("[yellow]interrupted[/]")
            raise typer.Exit(130)
        except Exception as e:
            internal_error(e, as_json)

    return wrapper  # type: ignore[return-value]


def emit_json(data: Any) -> None:
    sys.stdout.write(json.dumps(data, indent=2, default=str) + "\n")


def parse_ranks(text: Optional[str]) -> Optional[Set[int]]:
    """``--ranks``: the same syntax as ``monarch debug`` (``0,2-3``, ``0:8:2``), without a known size."""
    if text is None:
        return None
    from ..jobs.ranks import parse_rank_list

    return parse_rank_list(text, None, "--ranks")



