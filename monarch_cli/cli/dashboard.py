"""``monarch dashboard``: serve the reservation's web dashboard on the loopback address."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import typer

from .common import JsonOpt, StateOpt, app, fail, friendly, out


@app.command("dashboard")
@friendly
def dashboard_cmd(
    port: int = typer.Option(0, "--port", "-p", min=0, max=65535, help="Port on 127.0.0.1 (default: a free one)."),
    open_browser: bool = typer.Option(False, "--open", help="Open the page in the default browser."),
    state: Path | None = StateOpt,
    as_json: bool = JsonOpt,
) -> None:
    """Hosts, runs, live output per rank, plots over time, stacks and diagnosis in a browser tab (until Ctrl-C).

    The URL carries a random token, printed once; without it every request gets 403. Needs the
    'dashboard' extra. The page's data is also a JSON API: /openapi.json (with the token) describes it.
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
            import webbrowser

            webbrowser.open(dash.url)

    try:
        dash.serve(ready)
    except KeyboardInterrupt:  # the way to stop it: not an error
        return
