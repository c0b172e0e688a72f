"""The dashboard's web app: FastAPI routes over :class:`~.views.Views`, a token check, live updates (SSE).

Every route (page, static file, API, event stream, OpenAPI schema) needs the token: in the URL
(``?token=``) or the ``X-Monarch-Token`` header. Anything else gets 403. No cookie: a cookie for
127.0.0.1 would go to every port of this machine, other users' servers included.
The Host header must name the loopback address the server listens on (no DNS rebinding).
What one client can ask for is bounded: a series answer holds a bounded number of points, and at most
:data:`MAX_STREAMS` event streams are open at once.
"""

from __future__ import annotations

import asyncio
import functools
import json
import secrets
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any, TypeVar
from urllib.parse import parse_qs

from fastapi import FastAPI, HTTPException, Query, Request
from fastapi.responses import FileResponse, HTMLResponse, StreamingResponse
from starlette.types import ASGIApp, Receive, Scope, Send

from . import models as m
from .views import MAX_LINES, MAX_SERIES_ROWS, DashboardError, Views

STATIC = Path(__file__).parent / "static"
#: How often the event stream looks at the store for new rows (one cheap statement).
POLL_S = 0.5
#: A keep-alive comment this often, so proxies and the browser keep the stream open.
KEEPALIVE_S = 15.0
#: Event streams one server holds at once (each holds a connection and reads the store twice a
#: second); one more is refused with 429 until one closes.
MAX_STREAMS = 16

_T = TypeVar("_T")


#: On every answer: the page loads only its own files and talks only to its own server, no other
#: site may frame it, and the token in its URL is never sent on as a Referer.
SECURITY_HEADERS = [
    (
        b"content-security-policy",
        b"default-src 'self'; script-src 'self'; style-src 'self' 'unsafe-inline'; img-src 'self' data:; "
        b"connect-src 'self'; frame-ancestors 'none'; base-uri 'none'; form-action 'none'",
    ),
    (b"referrer-policy", b"no-referrer"),
    (b"x-content-type-options", b"nosniff"),
    (b"x-frame-options", b"DENY"),
]


class TokenGuard:
    """ASGI middleware: 403 unless the request carries the token and names a loopback Host; every
    answer carries :data:`SECURITY_HEADERS`."""

    def __init__(self, app: ASGIApp, token: str, hosts: set[str]) -> None:
        self.app, self.token, self.hosts = app, token, hosts

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        send = _with_security_headers(send)
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope.get("headers", [])}
        given = parse_qs(scope.get("query_string", b"").decode("latin-1")).get("token", [""])[0]
        given = given or headers.get("x-monarch-token", "")
        host_ok = not self.hosts or headers.get("host", "") in self.hosts
        if not (host_ok and given and secrets.compare_digest(given.encode(), self.token.encode())):
            await _plain(
                send, 403, "forbidden: open the dashboard with the URL (and token) `monarch dashboard` printed"
            )
            return
        await self.app(scope, receive, send)


class StreamLimit:
    """ASGI middleware: at most ``limit`` event streams at once, so open tabs or a script cannot pile
    up connections and store readers. A slot is freed when its response ends, however it ends (the
    client went away, the server stops)."""

    def __init__(self, app: ASGIApp, limit: int = MAX_STREAMS, path: str = "/api/events") -> None:
        self.app, self.limit, self.path, self.open = app, limit, path, 0

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope.get("path") != self.path:
            await self.app(scope, receive, send)
            return
        if self.open >= self.limit:  # one event loop: no lock needed between the check and the count
            await _plain(send, 429, f"too many live streams ({self.limit} open): close another dashboard tab")
            return
        self.open += 1
        try:
            await self.app(scope, receive, send)
        finally:
            self.open -= 1


async def _plain(send: Send, status: int, text: str) -> None:
    """A one-line plain-text answer (refusals: no token, too many streams)."""
    body = (text + "\n").encode()
    headers = [(b"content-type", b"text/plain; charset=utf-8"), (b"content-length", str(len(body)).encode())]
    if status == 429:
        headers.append((b"retry-after", b"5"))
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})


def _with_security_headers(send: Send) -> Send:
    async def sending(message: Any) -> None:
        if message["type"] == "http.response.start":
            message = {**message, "headers": [*message.get("headers", []), *SECURITY_HEADERS]}
        await send(message)

    return sending


def _answer(call: Callable[[], _T]) -> _T:
    try:
        return call()
    except DashboardError as e:
        raise HTTPException(404, str(e)) from None


def create_app(views: Views, token: str, hosts: set[str] | None = None) -> ASGIApp:
    """The ASGI app for one reservation; ``hosts``: the Host header values accepted (empty: any)."""
    app = FastAPI(
        title="monarch dashboard",
        version="1",
        description="Every page of `monarch dashboard`, as JSON. Each request needs the token "
        "(`?token=` or the header `X-Monarch-Token`).",
        docs_url=None,  # Swagger UI loads from a CDN; the schema itself is at /openapi.json
        redoc_url=None,
    )

    @app.get("/", response_class=HTMLResponse, include_in_schema=False)
    def index() -> HTMLResponse:
        # the page's own static files carry the token too (it is URL-safe base64)
        return HTMLResponse((STATIC / "index.html").read_text().replace("{{token}}", token))

    @app.get("/static/{name}", include_in_schema=False)
    def static(name: str) -> FileResponse:
        path = STATIC / name
        if "/" in name or name.startswith(".") or not path.is_file():
            raise HTTPException(404, "no such file")
        return FileResponse(path)

    # The views answer plain dicts: each API route names its model as response_model, which FastAPI
    # validates the dict against and documents in /openapi.json.
    @app.get(
        "/api/hosts",
        response_model=m.Hosts,
        summary="Hosts: agent liveness, warm state, CPUs/GPUs, their ranks' CPU/RSS/GPU",
    )
    def hosts_api() -> dict[str, Any]:
        return _answer(views.hosts)

    @app.get("/api/runs", response_model=list[m.Run], summary="Run history, newest first")
    def runs_api(limit: int = Query(50, ge=1, le=1000)) -> list[dict[str, Any]]:
        return _answer(lambda: views.runs(limit))

    @app.get(
        "/api/runs/{run_id}",
        response_model=m.RunDetail,
        summary="One run ('latest' for the newest): its row, exit table, events, hosts",
    )
    def run_api(run_id: str) -> dict[str, Any]:
        return _answer(lambda: views.run(run_id))

    @app.get(
        "/api/runs/{run_id}/logs",
        response_model=m.LogPage,
        summary="Output lines, oldest first, filtered by rank and text",
    )
    def logs_api(
        run_id: str,
        after: int | None = Query(None, description="lines after this id (for following)"),
        before: int | None = Query(None, description="the lines just before this id (the tail when neither)"),
        ranks: str | None = Query(None, description="ranks, e.g. 0,2-3"),
        q: str | None = Query(None, description="only lines containing this text (case-insensitive)"),
        limit: int = Query(1000, ge=1, le=MAX_LINES),
    ) -> dict[str, Any]:
        return _answer(lambda: views.logs(run_id, after=after, before=before, ranks=_ranks(ranks), text=q, limit=limit))

    @app.get(
        "/api/runs/{run_id}/series",
        response_model=m.Series,
        summary="Plot points after the cursors: samples, step times, key=value numbers",
    )
    def series_api(
        run_id: str,
        samples: int = 0,
        steps: int = 0,
        logs: int = 0,
        limit: int = Query(MAX_SERIES_ROWS, ge=1, le=MAX_SERIES_ROWS, description="rows of each table at most"),
    ) -> dict[str, Any]:
        return _answer(lambda: views.series(run_id, samples, steps, logs, limit))

    @app.get(
        "/api/runs/{run_id}/stacks",
        response_model=m.Stacks,
        summary="The newest stored stack capture of a run, grouped",
    )
    def stored_stacks_api(run_id: str) -> dict[str, Any]:
        return _answer(lambda: views.stored_stacks(run_id))

    @app.post(
        "/api/stacks",
        response_model=m.Stacks,
        summary="Capture every live rank's stack now (like `monarch stack`), grouped",
    )
    def capture_api(ranks: str | None = None) -> dict[str, Any]:
        try:
            return views.capture_stacks(set(_ranks(ranks) or []) or None)
        except DashboardError as e:
            raise HTTPException(409, str(e)) from None
        except Exception as e:  # noqa: BLE001 - JobError from the agents: one line for the page
            raise HTTPException(409, f"cannot capture stacks: {e}") from None

    @app.get("/api/diagnose", response_model=m.Diagnosis, summary="The `monarch diagnose` verdict")
    def diagnose_api(silence: float = Query(60.0, gt=0)) -> dict[str, Any]:
        return views.diagnose(silence)

    @app.get("/api/top", response_model=m.Top, summary="The `monarch top` rows of the newest run")
    def top_api() -> dict[str, Any]:
        try:
            return views.top()
        except Exception as e:  # noqa: BLE001 - no reservation or agents gone: one line
            raise HTTPException(409, str(e)) from None

    @app.get(
        "/api/queries",
        response_model=dict[str, m.Query],
        summary="The SQL behind each view (run it yourself with `monarch sql`)",
    )
    def queries_api() -> dict[str, dict[str, str]]:
        from ..telemetry import QUERIES

        return {name: {"description": what, "sql": sql} for name, (what, sql) in QUERIES.items()}

    @app.get(
        "/api/events",
        summary="Server-sent events: `runs` when a run starts or ends, `logs` (new lines of `run`, filtered), "
        f"`series` (new plot points). At most {MAX_STREAMS} streams at once; one more gets 429",
    )
    async def events_api(
        request: Request,
        run: str | None = None,
        after: int | None = Query(None, description="logs cursor: send lines after this id"),
        ranks: str | None = None,
        q: str | None = None,
        series: bool = False,
        samples: int = 0,
        steps: int = 0,
        logs: int = 0,
    ) -> StreamingResponse:
        stream = _events(views, request.is_disconnected, run, after, _ranks(ranks), q, series, [samples, steps, logs])
        return StreamingResponse(stream, media_type="text/event-stream", headers={"Cache-Control": "no-store"})

    return TokenGuard(StreamLimit(app), token, hosts or set())


def _ranks(text: str | None) -> list[int] | None:
    if not text or not text.strip():
        return None
    out: set[int] = set()
    try:
        for part in text.split(","):
            lo, _, hi = part.strip().partition("-")
            out.update(range(int(lo), int(hi or lo) + 1))
    except ValueError:
        raise HTTPException(422, f"ranks: {text!r} is not like 0,2-3") from None
    return sorted(out)


def _event(kind: str, data: Any) -> bytes:
    return f"event: {kind}\ndata: {json.dumps(data, separators=(',', ':'))}\n\n".encode()


async def _events(
    views: Views,
    gone: Callable[[], Awaitable[bool]],
    run: str | None,
    after: int | None,
    ranks: list[int] | None,
    text: str | None,
    series: bool,
    cursor: list[int],
) -> AsyncIterator[bytes]:
    """Deltas only: each tick reads the store's cursors (one statement) and sends what is new."""
    last: dict[str, Any] = {}
    quiet = 0.0
    pending = False  # more new rows than one event holds: send the next batch without waiting for a change
    yield b": connected\n\n"
    while not await gone():
        try:
            now = await asyncio.to_thread(views.cursors)
        except DashboardError:
            now = {}
        if now != last or pending:
            if (now.get("run"), now.get("open_runs"), now.get("events")) != (
                last.get("run"),
                last.get("open_runs"),
                last.get("events"),
            ):
                yield _event("runs", {"runs": await asyncio.to_thread(views.runs, 50), "cursors": now})
            more = False
            if run is not None and after is not None and (pending or now.get("logs") != last.get("logs")):
                page = await asyncio.to_thread(
                    functools.partial(views.logs, run, after=after, ranks=ranks, text=text, limit=MAX_LINES)
                )
                more = page["more"]
                if page["lines"]:
                    after = page["lines"][-1]["id"]
                    yield _event("logs", page)
            if run is not None and series:
                delta = await asyncio.to_thread(views.series, run, *cursor)
                if delta["samples"] or delta["steps"] or delta["numbers"]:
                    yield _event("series", delta)
                c = delta["cursors"]
                cursor = [c["samples"], c["steps"], c["logs"]]
                more = more or delta["more"]
            last, quiet, pending = now, 0.0, more
        else:
            quiet += POLL_S
            if quiet >= KEEPALIVE_S:
                yield b": keep-alive\n\n"
                quiet = 0.0
        await asyncio.sleep(POLL_S)
