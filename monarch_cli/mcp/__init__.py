"""The MCP server: the whole tool as a Model Context Protocol server for coding agents, a front end beside the dashboard.

``monarch mcp`` (``cli/mcp.py``) calls :func:`main`. The tools (``tools.py``) call the same job API and
build the same objects as the CLI's ``--json`` (``cli/results.py``); a run started by an agent runs in
a process of its own (``detached.py``) that outlives the server. The MCP SDK (the ``mcp`` extra) is
imported by ``server.py`` alone, when the server starts: importing this package loads none of it.
"""

from __future__ import annotations

from pathlib import Path


def main(state: Path | None) -> None:
    """Serve the reservation of ``state`` (its state file) over MCP's stdio transport until the client closes it."""
    from .server import main as serve

    serve(state)


__all__ = ["main"]
