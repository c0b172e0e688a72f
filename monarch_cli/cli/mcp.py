"""``monarch mcp``: the whole tool as a Model Context Protocol server, for coding agents.

This module only registers the command; the server is :mod:`monarch_cli.mcp`, a front end beside
the dashboard. The MCP SDK (the ``mcp`` extra) is imported when the command runs, by
``mcp/server.py``, and by nothing else in the package (tests/test_layers.py).
"""

from __future__ import annotations

import logging
import os
import sys
from pathlib import Path

import typer

from ..errors import UserError
from .common import StateOpt, app, friendly


@app.command("mcp")
@friendly
def mcp_cmd(
    state: Path | None = StateOpt,
    log_file: Path | None = typer.Option(None, "--log-file", help="Write the server's log here instead of stderr."),
    verbose: bool = typer.Option(False, "--verbose", "-v", help="Log every tool call."),
) -> None:
    """Serve this reservation to a coding agent over MCP (stdio): serve, run_spmd, wait_run, logs, sql...

    Register it with your agent client as the command `monarch mcp`, started in your project's directory
    (or with --state). stdout carries MCP only. See docs/agents.md.
    """
    import importlib.util

    if importlib.util.find_spec("mcp") is None:  # the optional extra: say how to get it, in one line
        raise UserError("monarch mcp needs the MCP Python SDK: pip install 'mcp>=2.3,<3'")
    from ..jobs.state import state_path
    from ..mcp import main

    handler = logging.FileHandler(log_file) if log_file else logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("%(asctime)s monarch mcp %(levelname)s %(message)s"))
    root = logging.getLogger()
    root.addHandler(handler)
    root.setLevel(logging.INFO if verbose else logging.WARNING)
    main(state_path(state).absolute())
    handler.flush()
    sys.stderr.flush()
    # The client closed stdin: leave now. Threads of this process (a reservation's mailbox, a
    # command still waiting on its hosts) must not hold the exit; runs started here are
    # processes of their own and go on.
    os._exit(0)
