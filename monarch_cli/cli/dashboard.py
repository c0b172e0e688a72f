"""``monarch dashboard``: serve the reservation's web dashboard on the loopback address."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import typer

from .common import JsonOpt, StateOpt, app, err, fail, friendly, out

#: What ``--open`` hands the browser: a local page that goes on to the URL with the token.
_OPENER = """<!DOCTYPE html>
<html><head><meta charset="utf-8"><meta name="referrer" content="no-referrer">
<meta http-equiv="refresh" content="0; url={url}"><title>monarch dashboard</title></head>
<body><p>Opening <a href="{url}">the monarch dashboard</a>...</p></body></html>
"""


@app.command("dashboard")
@friendly
def dashboard_cmd(
    port: int = typer.Option(0, "--port", "-p", min=0, max=65535, help="Port on 127.0.0.1 (default: a free one)."),
    open_browser: bool = typer.Option(
        False,
        "--open",
        help="Open the page in the default browser (via a private local file: no token on its command line).",
    ),
    state: Path | None = StateOpt,
    as_json: bool = JsonOpt,
) -> None:
    """Hosts, runs, live output per rank, plots over time, stacks and diagnosis in a browser tab (until Ctrl-C).

    The URL carries a random token, printed once; without it every request gets 403. Needs the
    'dashboard' extra. The page's data is also a JSON API: /openapi.json (with the token) describes it.
    --open hands the browser a private local file that leads to the URL, never the token itself.
    """
    from ..dashboard import Dashboard, DashboardError

    try:
        dash = Dashboard(state, port)
    except DashboardError as e:
        fail(str(e), as_json=as_json)
        return

    def ready() -> None:
        if as_json:
            info = {"url": dash.url, "port": dash.port, "openapi": f"{dash.base}openapi.json?token={dash.token}"}
            sys.stdout.write(json.dumps(info) + "\n")  # one line: a script reads it while the server runs
        else:
            out.print(f"monarch dashboard: [bold]{dash.url}[/]  (Ctrl-C to stop)", soft_wrap=True, highlight=False)
        sys.stdout.flush()
        if open_browser:
            opened.append(_open_browser(dash.url))

    opened: list[Path | None] = []
    try:
        dash.serve(ready)
    except KeyboardInterrupt:  # the way to stop it: not an error
        return
    finally:
        for page in opened:
            if page is not None:
                page.unlink(missing_ok=True)


def _open_browser(url: str) -> Path | None:
    """Open the default browser on a 0600 page that redirects to ``url``; returns that page.

    The browser's command line, which ``ps`` shows every local user, names only this file: the
    token is in the file, which only this user can read (Jupyter opens its server the same way).
    """
    import html
    import tempfile
    import webbrowser

    from ..sysutil import private_dirs

    base = os.environ.get("XDG_RUNTIME_DIR") or tempfile.gettempdir()
    directory = Path(base) / f"monarch-{os.getuid()}" / "dashboard"
    try:
        private_dirs(directory, base)  # refuses a directory another user made or can write
        fd, name = tempfile.mkstemp(prefix="open-", suffix=".html", dir=directory)  # new, mode 0600
        with os.fdopen(fd, "w") as f:
            f.write(_OPENER.format(url=html.escape(url, quote=True)))
    except OSError as e:  # (UnsafePath too) never fall back to the token on a command line
        err.print(f"monarch dashboard: not opening a browser: {e}; open the URL above", markup=False, soft_wrap=True)
        return None
    page = Path(name)
    webbrowser.open(page.as_uri())
    return page
