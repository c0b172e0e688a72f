"""``monarch dashboard``: the reservation's runs, ranks, output, plots, stacks and diagnosis in a browser tab.

A view over the same telemetry store and the same queries as ``monarch sql``/``top``/``stack``/``diagnose``
(:mod:`monarch_cli.telemetry.queries`). Needs the ``dashboard`` extra (FastAPI, uvicorn); nothing else in
monarch imports it. Listens on the loopback address only; every request needs the URL's random token.
"""

from __future__ import annotations

import secrets
import socket
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from .views import DashboardError, Views

if TYPE_CHECKING:  # the 'dashboard' extra: imported only when serving
    import uvicorn

    from .app import ASGIApp  # starlette's type: only app.py imports starlette (tests/test_layers.py)

__all__ = ["DashboardError", "Dashboard", "Views"]


class Dashboard:
    """A bound (not yet serving) dashboard: ``url`` is known before :meth:`serve` blocks."""

    def __init__(self, state: str | Path | None = None, port: int = 0, host: str = "127.0.0.1") -> None:
        try:
            import fastapi  # noqa: F401 - only to say what is missing, before binding anything
            import uvicorn  # noqa: F401
        except ImportError as e:
            raise DashboardError(
                f"monarch dashboard needs the 'dashboard' extra ({e.name} is not installed): "
                "pip install 'fastapi>=0.110' 'uvicorn>=0.29'"
            ) from None
        if host not in ("127.0.0.1", "::1", "localhost"):
            raise DashboardError(f"the dashboard listens on the loopback address only, not {host!r}")
        self.views = Views(state)
        if not self.views.db.exists() and not self.views.state_file.exists():
            raise DashboardError(
                f"no reservation at {self.views.state_file} and no telemetry store next to it: "
                "run `monarch serve` first (or give --state)"
            )
        self.token = secrets.token_urlsafe(24)
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        self.sock = socket.socket(family, socket.SOCK_STREAM)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            self.sock.bind((host, port))
        except OSError as e:
            self.sock.close()
            raise DashboardError(f"cannot listen on {host}:{port}: {e.strerror or e}") from None
        self.sock.listen(128)
        self.port = self.sock.getsockname()[1]
        shown = f"[{host}]" if ":" in host else host
        self.base = f"http://{shown}:{self.port}/"
        self.url = f"{self.base}?token={self.token}"
        self._server: uvicorn.Server | None = None

    def app(self) -> ASGIApp:
        from .app import create_app

        names = {f"{h}:{self.port}" for h in ("127.0.0.1", "localhost", "[::1]")}
        return create_app(self.views, self.token, names)

    def serve(self, on_ready: Callable[[], None] | None = None) -> None:
        """Serve until Ctrl-C (or :meth:`stop`)."""
        import uvicorn

        config = uvicorn.Config(
            self.app(),
            log_level="warning",
            access_log=False,
            lifespan="off",
            ws="none",  # no websocket routes: SSE only
            timeout_graceful_shutdown=1,
        )
        server = uvicorn.Server(config)
        self._server = server
        if on_ready is not None:
            on_ready()
        server.run(sockets=[self.sock])

    def stop(self) -> None:
        if self._server is not None:
            self._server.should_exit = True
