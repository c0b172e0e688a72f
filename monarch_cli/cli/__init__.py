"""The ``monarch`` command: parse, call the library, render with rich. Nothing else lives here.

One module per group of commands; each registers itself on the shared Typer app.
"""

from . import jobs  # noqa: F401 - registers serve, run-spmd, exec, status, stop, logs, demo
from .common import app


def main() -> None:
    app()


__all__ = ["app", "main"]
