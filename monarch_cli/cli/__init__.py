"""The ``monarch`` command: parse, call the library, render with rich. Nothing else lives here.

One module per group of commands; each registers itself on the shared Typer app. ``monarch
sql`` is answered before any of them is imported (standard library only: a query is a
whole process in a few tens of milliseconds).
"""

import sys
from typing import Any


def main() -> None:
    argv = sys.argv[1:]
    if argv[:1] == ["sql"] and not {"-h", "--help"} & set(argv):
        from .sql import fast_main

        sys.exit(fast_main(argv[1:]))
    _app()(prog_name="monarch")  # also under `python -m monarch_cli`: help and completion say `monarch`


def _app() -> Any:
    from . import debug, jobs, slurm, telemetry, version  # noqa: F401 - register their commands on the app
    from .common import app

    return app


def __getattr__(name: str) -> Any:
    if name == "app":
        return _app()
    raise AttributeError(f"module 'monarch_cli.cli' has no attribute {name!r}")


__all__ = ["app", "main"]
