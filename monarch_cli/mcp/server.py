"""``monarch mcp``: the tools over MCP's stdio transport, on the official Python SDK's low-level server.

The low-level :class:`mcp.server.Server` rather than ``MCPServer`` (FastMCP): our schemas are
written for agents by hand (``tools.py``) instead of derived from Python signatures, and a
tool's result is built here, once, from what ``--json`` prints. Requests are served
concurrently by the SDK; every handler's blocking work runs in a worker thread, so
``status`` answers while ``run_spmd`` waits.

stdout carries MCP only: the SDK points fd 1 at stderr while it serves, so nothing a handler,
a library or a child process prints can corrupt the protocol; our own log goes to stderr
(or ``--log-file``).
"""

from __future__ import annotations

import json
import logging
import time
from pathlib import Path
from typing import Any

import anyio
import anyio.to_thread
import jsonschema
import mcp.types as types
from anyio.from_thread import run as from_thread_run
from mcp.server import Server, ServerRequestContext
from mcp.server.stdio import stdio_server

from .. import __version__
from ..cli.console import describe_error, internal_message
from . import handlers, runs
from .bounds import clip_text
from .handlers import Reply, Session
from .tools import BY_NAME, INSTRUCTIONS, TOOLS

log = logging.getLogger("monarch.mcp")
#: How often a blocked run_spmd/wait_run looks at the run (and notifies progress when it changed).
POLL_S = 0.5


class MonarchMcp:
    """The tools of one reservation (its state file), served to one client."""

    def __init__(self, state: Path | None) -> None:
        self.state = state
        self.validators = {t.name: jsonschema.Draft202012Validator(t.input_schema) for t in TOOLS}
        self.server: Server[Any] = Server(
            "monarch",
            version=__version__,
            title="monarch: SPMD jobs for PyTorch",
            instructions=INSTRUCTIONS,
            on_list_tools=self._list_tools,
            on_call_tool=self._call_tool,
        )

    # ------------------------------------------------------------------ MCP
    async def _list_tools(self, ctx: ServerRequestContext[Any], params: Any) -> types.ListToolsResult:
        return types.ListToolsResult(
            tools=[
                types.Tool(
                    name=t.name,
                    title=t.title,
                    description=t.description,
                    input_schema=t.input_schema,
                    annotations=types.ToolAnnotations(
                        title=t.title,
                        read_only_hint=t.read_only,
                        destructive_hint=t.destructive,
                        idempotent_hint=t.idempotent,
                        open_world_hint=not t.read_only,
                    ),
                )
                for t in TOOLS
            ]
        )

    async def _call_tool(self, ctx: ServerRequestContext[Any], params: types.CallToolRequestParams) -> Any:
        name, args = params.name, dict(params.arguments or {})
        started = time.monotonic()
        try:
            reply = await self._dispatch(ctx, name, args)
        except BaseException as e:  # noqa: BLE001 - every failure is a result; the server lives on
            if isinstance(e, anyio.get_cancelled_exc_class()):
                raise
            reply = _error_reply(e)
        log.info("%s -> %s in %.2f s", name, "error" if reply.error else "ok", time.monotonic() - started)
        return self._result(reply)

    async def _dispatch(self, ctx: ServerRequestContext[Any], name: str, args: dict[str, Any]) -> Reply:
        spec = BY_NAME.get(name)
        if spec is None:
            return _refusal(f"no tool {name!r}; the tools: {', '.join(BY_NAME)}", "user")
        problem = _first_error(self.validators[name], args)
        if problem:
            return _refusal(f"{name}: {problem}", "user")
        progress = _Progress(ctx)
        session = Session(self.state, progress=progress.from_thread)
        if name in ("run_spmd", "wait_run", "cancel_run"):
            return await getattr(self, f"_{name}")(session, args, progress)
        return await anyio.to_thread.run_sync(handlers.HANDLERS[name], session, args, abandon_on_cancel=True)

    def _result(self, reply: Reply) -> types.CallToolResult:
        text = self._scrub(clip_text(reply.text))
        data = json.loads(self._scrub(json.dumps(reply.data, default=str)))
        return types.CallToolResult(
            content=[types.TextContent(text=text)], structured_content=data, is_error=reply.error
        )

    def _scrub(self, text: str) -> str:
        """The reservation's keys never leave: none of our results holds them; this makes sure."""
        for secret in _key_strings(self.state):
            text = text.replace(secret, "<redacted>")
        return text

    # ------------------------------------------------------------------ runs
    async def _run_spmd(self, s: Session, a: dict[str, Any], progress: _Progress) -> Reply:
        command = handlers._command(a.get("command"))
        options = {
            "cold": a.get("cold", False),
            "keep_ranks": a.get("keep_ranks", False),
            "post_mortem": a.get("post_mortem", False),
            "env": a.get("env") or {},
            "sync": a.get("sync", True),
        }
        run_id = await anyio.to_thread.run_sync(s.runs.start, command, options)
        await progress.say(f"run {run_id} started")
        return await self._wait(s, run_id, a.get("wait_s", 60), a.get("tail", 20), None, progress)

    async def _wait_run(self, s: Session, a: dict[str, Any], progress: _Progress) -> Reply:
        run_id = await self._run_id(s, a)
        return await self._wait(s, run_id, a.get("wait_s", 60), a.get("tail", 20), a.get("rank"), progress)

    async def _cancel_run(self, s: Session, a: dict[str, Any], progress: _Progress) -> Reply:
        run_id = await self._run_id(s, a)
        how = await anyio.to_thread.run_sync(s.runs.cancel, run_id, a.get("force", False))
        await progress.say(f"run {run_id}: sent {how}")
        reply = await self._wait(s, run_id, a.get("wait_s", 40), a.get("tail", 20), None, progress)
        reply.data["cancel"] = how
        if reply.data.get("kind") == "interrupted":  # it ended before it began: what was asked
            reply.error = False
        return reply

    async def _run_id(self, s: Session, a: dict[str, Any]) -> str:
        """The run the call names, else the newest."""
        named: str | None = a.get("run_id")
        if named:
            return named
        return await anyio.to_thread.run_sync(s.runs.latest)

    async def _wait(
        self, s: Session, run_id: str, wait_s: float, tail: int, rank: int | None, progress: _Progress
    ) -> Reply:
        deadline = time.monotonic() + wait_s
        runs_ = s.runs
        pause = 0.05  # a re-run ends in a fraction of a second: look soon, then every POLL_S
        while True:
            snap = await anyio.to_thread.run_sync(runs_.snapshot, run_id, tail, rank)
            if runs.is_final(snap) or time.monotonic() >= deadline:
                break
            await progress.say(_progress_line(snap))
            await anyio.sleep(min(pause, max(0.0, deadline - time.monotonic())))
            pause = min(POLL_S, pause * 2)
        return _run_reply(snap)


class _Progress:
    """Progress notifications for one call (only when the client asked for them: the SDK checks),
    each one only when something changed, with a value that always grows."""

    def __init__(self, ctx: ServerRequestContext[Any]) -> None:
        self.ctx = ctx
        self.count = 0
        self.last = ""

    async def say(self, message: str) -> None:
        if message == self.last:
            return
        self.last = message
        self.count += 1
        try:
            await self.ctx.session.report_progress(self.count, None, message)
        except Exception:  # noqa: BLE001 - a client gone or confused: progress is best effort
            log.debug("progress not sent", exc_info=True)

    def from_thread(self, message: str) -> None:
        """From a handler's worker thread (serve's "reserving..." steps, a run's notices)."""
        try:
            from_thread_run(self.say, message)
        except Exception:  # noqa: BLE001 - best effort, as above
            log.debug("progress not sent", exc_info=True)


def _progress_line(snap: dict[str, Any]) -> str:
    parts = [f"run {snap['run_id']} {snap['state']}"]
    if snap.get("world_size"):
        parts.append(f"{snap.get('ranks_exited', 0)}/{snap['world_size']} ranks exited")
    elif snap.get("ranks_started"):
        parts.append(f"{snap['ranks_started']} ranks started")
    if snap.get("lines") is not None:
        parts.append(f"{snap['lines']} lines")
    failed = [g for g in snap.get("rank_groups", []) if g["status"] not in (None, 0)]
    if failed:
        parts.append(f"failed: ranks {failed[0]['ranks']} ({failed[0]['how']})")
    return ", ".join(parts)


def _run_reply(snap: dict[str, Any]) -> Reply:
    state = snap["state"]
    if state in (runs.ERROR, runs.LOST):
        return Reply(snap, snap["error"], error=True)  # our one line; run_id and state are in the data
    lines = []
    if state == runs.FINISHED:
        outcome = "ok" if snap["exit_code"] == 0 else f"exit status {snap['exit_code']}"
        lines.append(f"run {snap['run_id']} finished: {outcome} in {snap['duration']:.2f} s")
        if snap.get("ending"):
            lines.append(snap["ending"])
    else:
        lines.append(_progress_line(snap) + f" after {snap.get('elapsed') or 0:.0f} s; call wait_run to keep waiting")
    for g in snap.get("rank_groups", []):
        lines.append(f"  ranks {g['ranks']}: {g['how']}")
    tail = snap.get("tail")
    if tail and tail["lines"]:
        lines.append(f"last lines of rank {tail['rank']}:")
        lines += [f"  {l}" for l in tail["lines"]]
    for n in snap.get("notices", []):
        lines.append(n)
    return Reply(snap, "\n".join(lines))


def _first_error(validator: jsonschema.Draft202012Validator, args: dict[str, Any]) -> str:
    error = jsonschema.exceptions.best_match(validator.iter_errors(args))
    if error is None:
        return ""
    where = ".".join(str(p) for p in error.absolute_path)
    return f"{where}: {error.message}" if where else error.message


def _refusal(message: str, kind: str) -> Reply:
    return Reply({"error": message, "kind": kind}, message, error=True)


def _error_reply(e: BaseException) -> Reply:
    known = describe_error(e)
    if known is None:
        log.error("internal error", exc_info=e)
        return _refusal(internal_message(e, "see the server's log"), "internal")
    return _refusal(known[0], known[1])


def _key_strings(state: Path | None) -> list[str]:
    try:
        from ..jobs import job_load

        keys = job_load(state).keys
        return [keys.secret.decode(), keys.public.decode()]
    except Exception:  # noqa: BLE001 - nothing served (yet): no keys to keep out
        return []


async def serve_stdio(state: Path | None) -> None:
    app = MonarchMcp(state)
    async with stdio_server() as (read, write):
        await app.server.run(read, write, app.server.create_initialization_options())


def main(state: Path | None) -> None:
    """Serve until the client closes stdin."""
    anyio.run(serve_stdio, state)
