"""The ``monarch`` command: parse, call the library, render with rich. Nothing else lives here.

One module per group of commands; each registers itself on the shared Typer app.
"""

from . import debug, jobs, slurm  # noqa: F401 - register their commands on the app
from .common import app


def main() -> None:
    app()


__all__ = ["app", "main"]
