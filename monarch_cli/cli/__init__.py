"""The ``monarch`` command: parse, call the library, render with rich. Nothing else lives here.

One module per group of commands; each registers itself on the shared Typer app.
"""

from . import debug, jobs, slurm, version  # noqa: F401 - register their commands on the app
from .common import app


def main() -> None:
    app(prog_name="monarch")  # also under `python -m monarch_cli`: help and completion say `monarch`


__all__ = ["app", "main"]
