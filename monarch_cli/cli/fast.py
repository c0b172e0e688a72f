"""``monarch run-spmd`` and ``monarch exec`` answered without Typer.

A repeated ``run-spmd`` is the command users wait on all day; Typer, click and rich cost
~50 ms of its start on this project's machine (the run itself: ~0.1 s). So
:func:`parse` reads the command lines it fully understands, the common ones, exactly as
the Typer commands in ``cli/jobs.py`` would, and everything else (``--help``, an unknown or
repeated option, an odd value, a missing one) is left to Typer, which then prints its own
usage error or help: the two routes give the same result for every command line, and
tests/cli/test_fast_path.py checks it. Both routes run the same code afterwards
(``cli/runs.py``).
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from ..jobs.argscan import OptionScanner
from .console import explain

#: option -> (parameter, kind): "flag" (True), "unflag" (False), "value", "path", "many", "seconds"
_Options = dict[str, tuple[str, str]]
_RUN_SPMD: _Options = {
    "--state": ("state", "path"),
    "--ranks": ("ranks", "value"),
    "--cold": ("cold", "flag"),
    "--keep-ranks": ("keep_ranks", "flag"),
    "--color": ("color", "flag"),
    "--no-color": ("color", "unflag"),
    "--post-mortem": ("post_mortem", "flag"),
    "--env": ("env", "many"),
    "-e": ("env", "many"),
    "--workspace": ("workspace", "path"),
    "--no-sync": ("no_sync", "flag"),
    "--straggler-grace": ("straggler_grace", "seconds"),
    "--stall-timeout": ("stall_timeout", "seconds"),
    "--group": ("group", "flag"),
    "--no-group": ("group", "unflag"),
    "--json": ("as_json", "flag"),
}
_EXEC: _Options = {
    "--state": ("state", "path"),
    "--color": ("color", "flag"),
    "--no-color": ("color", "unflag"),
    "--json": ("as_json", "flag"),
}
_DEFAULTS: dict[str, dict[str, Any]] = {
    "run-spmd": {
        "command": None,
        "state": None,
        "ranks": None,
        "cold": False,
        "keep_ranks": False,
        "color": None,
        "post_mortem": False,
        "env": None,
        "workspace": None,
        "no_sync": False,
        "straggler_grace": 30.0,
        "group": None,
        "stall_timeout": None,
        "as_json": False,
    },
    "exec": {"command": None, "state": None, "color": None, "as_json": False},
}
_COMMANDS = {"run-spmd": _RUN_SPMD, "exec": _EXEC}
_SECONDS = re.compile(r"[0-9]+(\.[0-9]*)?|\.[0-9]+")  # what --straggler-grace takes here; Typer judges the rest


def parse(argv: list[str]) -> tuple[str, dict[str, Any]] | None:
    """``(command, its parameters)`` for ``argv`` (``["run-spmd", ...]``), or None: ask Typer."""
    if not argv or argv[0] not in _COMMANDS:
        return None
    name, options = argv[0], _COMMANDS[argv[0]]
    params = dict(_DEFAULTS[name])
    seen = set()
    scan = OptionScanner(argv[1:])  # click's rule: -e=X is the value "=X"
    for option in scan:
        if option.flag not in options:
            return None  # -h, --help, an unknown option: Typer's
        param, kind = options[option.flag]
        if kind in ("flag", "unflag"):
            if option.value is not None:
                return None  # a flag with a value: Typer's error
            value_given: Any = kind == "flag"
        else:
            value = option.value if option.value is not None else scan.take_value()
            if not value or value.startswith("-"):
                return None  # missing, or an option where its value should be
            if kind == "seconds":
                if not _SECONDS.fullmatch(value):
                    return None
                value_given = float(value)
            else:
                value_given = Path(value) if kind == "path" else value
        if kind == "many":
            params[param] = [*(params[param] or []), value_given]
            continue
        if param in seen:
            return None  # given twice: which one counts is Typer's business
        seen.add(param)
        params[param] = value_given
    if scan.rest[:1] == ["-"] and not scan.dashes:
        return None
    params["command"] = scan.rest or None
    return name, params


def main(argv: list[str]) -> int | None:
    """Run ``monarch run-spmd|exec ...`` if :func:`parse` understands it; its exit status, or None."""
    parsed = parse(argv)
    if parsed is None:
        return None
    name, params = parsed
    import sys

    from . import runs

    try:
        try:
            return runs.run_spmd(**params) if name == "run-spmd" else runs.exec_command(**params)
        finally:
            sys.stdout.flush()  # a closed pipe shows here, while we can still exit quietly
    except (Exception, KeyboardInterrupt) as e:  # noqa: BLE001
        return explain(e, params["as_json"])
