"""The ``monarch`` command: parse, call the library, render with rich. Nothing else lives here.

One module per group of commands; each registers itself on the shared Typer app. A command
named first on the line loads only its own module (``run-spmd`` is re-run all day: it does
not pay for the debugger's or telemetry's commands); help, completion and anything else load
them all. ``monarch sql`` is answered before any of them is imported (standard library only:
a query is a whole process in a few tens of milliseconds).
"""

import sys
from typing import Any


def main() -> None:
    argv = sys.argv[1:]
    if argv[:1] == ["sql"] and not {"-h", "--help"} & set(argv):
        from .sql import fast_main

        sys.exit(fast_main(argv[1:]))
    _app(_only_module(argv))(prog_name="monarch")  # under `python -m monarch_cli` too: help says `monarch`


#: Which module registers each command (tests/test_cli.py checks this against the full app).
COMMAND_MODULES = {
    **dict.fromkeys(["serve", "run-spmd", "sync", "exec", "status", "warm", "stop", "logs", "demo"], "jobs"),
    "debug": "debug", "sbatch": "slurm", "version": "version",
    **dict.fromkeys(["sql", "stack", "diagnose", "top"], "telemetry"),
}
_ALL = ("debug", "jobs", "slurm", "telemetry", "version")


def _only_module(argv: "list[str]") -> "str | None":
    if not argv or {"-h", "--help"} & set(argv) or any(a.startswith("--install-completion") or
                                                       a.startswith("--show-completion") for a in argv):
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
