"""``monarch --version`` and ``monarch version``: what to quote in a bug report."""

from __future__ import annotations

import platform
import sys
from typing import Any

import typer

from .. import __version__
from ..config import from_environment, settings_text
from .common import JsonOpt, app, emit_json, out, set_debug


def _print_version(value: bool) -> None:
    if value:
        sys.stdout.write(f"monarch-cli {__version__}\n")
        raise typer.Exit()


@app.callback()
def _root(
    version: bool = typer.Option(
        False, "--version", is_eager=True, callback=_print_version, help="Print the version and exit."
    ),
    debug: bool = typer.Option(False, "--debug", help="Show the traceback of an internal error."),
) -> None:
    """Reserve hosts once, then run torchrun-style SPMD jobs on them in a fraction of a second."""
    set_debug(debug)


@app.command("version")
def version_cmd(
    as_json: bool = JsonOpt,
    show_settings: bool = typer.Option(
        False, "--settings", help="Also list every MONARCH_* setting: its value and whether the environment set it."
    ),
) -> None:
    """monarch-cli's version, the Python it runs on and the torch installed there (not imported).

    ``--json`` always holds ``settings`` (what a bug report needs); secrets show as ``<redacted>``."""
    info: dict[str, Any] = {
        "monarch_cli": __version__,
        "python": platform.python_version(),
        "executable": sys.executable,
        "torch": _installed("torch"),
    }
    if as_json:
        emit_json({**info, "settings": from_environment()})
        return
    out.print(
        f"monarch-cli {info['monarch_cli']}\npython {info['python']} ({info['executable']})\n"
        f"torch {info['torch'] or '(not installed)'}",
        markup=False,
    )
    if show_settings:
        out.print(settings_text(), markup=False)


def _installed(distribution: str) -> str | None:
    from importlib import metadata  # 8 ms: only for this command, not for every `monarch` start

    try:
        return metadata.version(distribution)
    except metadata.PackageNotFoundError:
        return None
