"""The CLI's consoles and its one way of reporting an error, without importing Typer or rich.

``monarch run-spmd`` is re-run all day, and on this project's machine importing rich costs
~25 ms of a ~0.2 s command. So a line that rich would print unstyled (the stream is not a
terminal and nothing forces colour) is written here as plain text; otherwise, and for
anything with a table or a spinner, the rich console is made on first use. Both routes print
the same characters: the test suite compares them (tests/cli/test_fast_path.py).

Errors: :func:`explain` turns what a command raised into one line (or ``{"error", "kind"}``
with ``--json``) and an exit status, for the Typer commands (``common.friendly``) and for the
commands answered without Typer (``fast.py``) alike.
"""

from __future__ import annotations

import json
import os
import sys
import threading
import time
from pathlib import Path
from typing import Any

from ..config import env
from ..errors import MonarchError, UserError
from ..jobs.console import CLOSED_PIPE_EXIT, silence

#: Exit status of an internal error (a bug): sysexits' EX_SOFTWARE.
INTERNAL_ERROR = 70
#: A piece of a line: plain text, or ``(rich style, text)``.
Piece = str | tuple[str, str]


def _debug_from_environment() -> bool:
    """``env.debug``; text that is no flag counts as on, as any text did before the setting had a type
    (an error here, before any command runs, could not be reported as one line)."""
    try:
        return env.debug
    except ValueError:
        return True


_debug = {"on": _debug_from_environment()}
_rich: dict[bool, Any] = {}  # stderr? -> the rich console, made on first use


def set_debug(on: bool) -> None:
    """``monarch --debug``: show the traceback of an internal error (the root callback calls this)."""
    if on:
        _debug["on"] = True


def rich_console(stderr: bool) -> Any:
    """The process's rich console for stderr or stdout (one each, shared by every command)."""
    console = _rich.get(stderr)
    if console is None:
        from rich.console import Console

        class _Console(Console):
            def on_broken_pipe(self) -> None:
                """Its reader left (`| head`): quiet from now on; the main thread exits as a closed pipe says."""
                _closed_pipe(self)

        console = _rich[stderr] = _Console(stderr=stderr, highlight=False, soft_wrap=True)
        if _streams[stderr].quiet:
            console.quiet = True
    return console


def _closed_pipe(console: Any) -> None:
    silence(sys.stdout)
    silence(sys.stderr)
    console.quiet = True
    if threading.current_thread() is threading.main_thread():
        raise SystemExit(CLOSED_PIPE_EXIT)


class LineConsole:
    """Prints lines made of styled pieces to stderr or stdout, the way the rich console would."""

    def __init__(self, stderr: bool) -> None:
        self.stderr = stderr
        self.quiet = False

    @property
    def file(self) -> Any:
        return sys.stderr if self.stderr else sys.stdout

    def line(self, *pieces: Piece) -> None:
        text = "".join(p if isinstance(p, str) else p[1] for p in pieces)
        if self.quiet:
            return
        if not self._plain(text):
            from rich.text import Text

            rich_console(self.stderr).print(Text.assemble(*(p if isinstance(p, str) else (p[1], p[0]) for p in pieces)))
            return
        try:
            self.file.write(text + "\n")
            self.file.flush()
        except BrokenPipeError:
            _closed_pipe(self)

    def _plain(self, text: str) -> bool:
        """True when rich would print ``text`` as it is: no terminal (and none forced), nothing
        it rewrites (tabs, control characters)."""
        if self.stderr in _rich or "FORCE_COLOR" in os.environ or "TTY_COMPATIBLE" in os.environ:
            return False
        try:
            if self.file.isatty():
                return False
        except (AttributeError, ValueError):
            return False
        return text.isprintable()


_streams = {True: LineConsole(stderr=True), False: LineConsole(stderr=False)}
err_lines = _streams[True]


def say(message: str) -> None:
    """A notice from a run (a rank paused, a host started cold...)."""
    err_lines.line(("yellow", "monarch:"), " " + message)


def report(message: str, kind: str = "user", as_json: bool = False) -> None:
    """One line on stderr (``monarch: error: ...``), or ``{"error", "kind"}`` on stdout with --json."""
    if as_json:
        emit_json({"error": message, "kind": kind})
    else:
        err_lines.line(("bold red", "monarch: error:"), " " + message)


def emit_json(data: Any) -> None:
    """Indented for a person at a terminal; one compact line for a script or an agent reading a
    pipe, as ``gh`` does. Python's JSON encoder is C only without ``indent``: 32,768 ranks' stacks
    took seconds to indent."""
    try:
        tty = sys.stdout.isatty()
    except (AttributeError, ValueError):  # replaced, or closed
        tty = False
    if tty:
        sys.stdout.write(json.dumps(data, indent=2, default=str) + "\n")
    else:
        sys.stdout.write(json.dumps(data, separators=(",", ":"), default=str) + "\n")


def explain(e: BaseException, as_json: bool) -> int:
    """Report what a command raised as the CLI does; returns the exit status. Re-raises what is
    not an error (SystemExit, GeneratorExit)."""
    if isinstance(e, BrokenPipeError):  # `monarch ... | head`: the reader left; stop quietly, as Unix tools do
        silence(sys.stdout)
        silence(sys.stderr)
        return CLOSED_PIPE_EXIT
    known = describe_error(e)
    if known is not None:
        if _debug["on"] and isinstance(e, MonarchError) and not isinstance(e, UserError):
            import traceback  # (here: a run that goes well never loads it)

            traceback.print_exception(type(e), e, e.__traceback__)
        report(*known[:2], as_json)
        return known[2]
    if isinstance(e, KeyboardInterrupt):
        if as_json:
            emit_json({"error": "interrupted", "kind": "interrupted"})
        else:
            err_lines.line(("yellow", "interrupted"))
        return 130
    if isinstance(e, Exception):
        return internal_error(e, as_json)
    raise e


def describe_error(e: BaseException) -> tuple[str, str, int] | None:
    """(one-line message, kind, exit status) of one of our errors or the machine's (OSError); None for
    anything else. The CLI prints it; the MCP server returns it as an error result."""
    if isinstance(e, MonarchError):
        return (
            (" ".join(str(e).split()) if isinstance(e, UserError) else str(e)),
            e.kind,
            (2 if isinstance(e, UserError) else 1),
        )
    if isinstance(e, OSError):  # the machine said no (permissions, a missing file): not a bug
        return (f"{e.strerror or e}: {e.filename}" if e.filename else str(e)), "os", 2
    return None


def internal_error(e: BaseException, as_json: bool = False) -> int:
    """A bug, not a user mistake: say so, keep the traceback in a file, show it with --debug."""
    report(internal_message(e), "internal", as_json)
    return INTERNAL_ERROR


def internal_message(e: BaseException, hint: str = "rerun with --debug to see it") -> str:
    """The one line for a bug; its traceback is saved in a private file (and shown with --debug)."""
    import traceback

    text = "".join(traceback.format_exception(type(e), e, e.__traceback__))
    where = _save_traceback(text)
    saved = f"traceback in {where}" if where else "the traceback could not be saved"
    if _debug["on"]:
        sys.stderr.write(text)
    return " ".join(f"internal error: {type(e).__name__}: {e} (a bug in monarch-cli; {saved}; {hint})".split())


def _save_traceback(text: str) -> str | None:
    import tempfile

    from ..sysutil import private_dirs

    directory = Path(tempfile.gettempdir()) / f"monarch-{os.getuid()}" / "errors"
    try:
        private_dirs(directory, tempfile.gettempdir())  # (another user may have made monarch-<uid> first)
        path = directory / f"error-{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}.txt"
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)  # may quote paths and arguments
        with os.fdopen(fd, "w") as f:
            f.write(f"monarch {' '.join(sys.argv[1:])}\n\n{text}")
        return str(path)
    except OSError:  # (UnsafePath too: a directory another user made is not written to)
        return None
