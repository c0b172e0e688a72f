"""The ``monarch`` command: parse, call the library, render with rich. Nothing else lives here.

One module per group of commands; each registers itself on the shared Typer app. A command
named first on the line loads only its own module (``run-spmd`` is re-run all day: it does
not pay for the debugger's or telemetry's commands); help, completion and anything else load
them all. ``monarch sql`` is answered before any of them is imported (standard library only:
a query is a whole process in a few tens of milliseconds), and so, for the command lines
``cli/fast.py`` understands, are ``run-spmd`` and ``exec`` (they run often).
"""

import os
import sys
from typing import Any

from ..config import COMPLETE_ENV
from ..errors import UserError


def main() -> None:
    try:
        _main(sys.argv[1:])
    except UserError as e:  # raised while a command's modules import: a bad MONARCH_* value read then
        print(f"monarch: error: {e}", file=sys.stderr)
        _exit(2)


def _main(argv: "list[str]") -> None:
    if argv[:1] == ["sql"] and not {"-h", "--help"} & set(argv):
        from .sql import fast_main

        sys.exit(fast_main(argv[1:]))
    if argv[:1] in (["run-spmd"], ["exec"]) and COMPLETE_ENV not in os.environ:
        from . import fast

        code = fast.main(argv)
        if code is not None:
            _exit(code)
    status: str | int | None = 0
    try:
        _app(_only_module(argv))(prog_name="monarch")  # under `python -m monarch_cli` too: help says `monarch`
    except SystemExit as e:
        status = e.code
    if isinstance(status, str):  # sys.exit("message"), as the interpreter prints it
        print(status, file=sys.stderr)
        status = 1
    _exit(status or 0)


def _exit(code: int) -> None:
    """Exit as the interpreter would (threads joined, atexit handlers run, output flushed), without
    tearing down every module one by one: ~20-30 ms of a run-spmd's whole process here.

    Every command ends this way, not only the fast path's: a command that drove agents through
    forwards (a Kubernetes port-forward, an ssh tunnel) leaves daemon threads that are still
    ending their streams, and the interpreter's own finalization, which stops such threads
    wherever they are, killed ``monarch stop`` with SIGABRT once (CI, not reproduced in 25 tries)
    after its work was done and printed. What a command must leave behind is written before it
    returns (the suite checks each command's files and exit status through this path)."""
    if sys.getprofile() is not None or sys.gettrace() is not None:  # cProfile, a debugger: let them finish
        sys.exit(code)
    from ..shutdown import run_exit_steps

    run_exit_steps()
    os._exit(code)


#: Which module registers each command (tests/test_cli.py checks this against the full app).
COMMAND_MODULES = {
    **dict.fromkeys(["serve", "run-spmd", "sync", "exec", "status", "warm", "stop", "logs", "demo"], "jobs"),
    "debug": "debug",
    "sbatch": "slurm",
    "version": "version",
    "mcp": "mcp",
    **dict.fromkeys(["sql", "stack", "diagnose", "top"], "telemetry"),
    "dashboard": "dashboard",
}
_ALL = ("dashboard", "debug", "jobs", "mcp", "slurm", "telemetry", "version")


def _only_module(argv: "list[str]") -> "str | None":
    if (
        not argv
        or {"-h", "--help"} & set(argv)
        or any(a.startswith("--install-completion") or a.startswith("--show-completion") for a in argv)
    ):
        return None
    return COMMAND_MODULES.get(argv[0])


def _app(only: "str | None" = None) -> Any:
    import importlib

    for name in ("version", only) if only else _ALL:  # importing a module registers its commands
        importlib.import_module(f"{__name__}.{name}")
    from .common import app

    return app


def __getattr__(name: str) -> Any:
    if name == "app":
        return _app()
    raise AttributeError(f"module 'monarch_cli.cli' has no attribute {name!r}")


__all__ = ["app", "main"]
