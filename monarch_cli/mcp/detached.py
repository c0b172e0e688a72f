"""A run the MCP server starts, in a process of its own that outlives the server.

``python -m monarch_cli.mcp.detached`` reads the run's spec (JSON) on stdin, forks
once more so that the server's process tree no longer holds it, prints the runner's pid,
and the runner then drives the run exactly as ``monarch run-spmd`` does (``Job.run_spmd``,
in its main thread, so SIGTERM ends the run as torchrun would and SIGINT as Ctrl-C does).

Why a process and not a thread of the server: an agent's tool call may time out, and agent
clients restart their MCP servers (a reconnect, a new conversation, a crash); the stdio
client kills the server's process tree when it leaves. A run in the server would die with
it. This one keeps going; its record (``<state dir>/mcp/runs/<run-id>.json``: pid, state,
exit or error), the rank logs and the telemetry store say how it went, and any later server
(``wait_run``) picks it up. ``cancel_run`` or ``stop`` end it.

Standard library only until the run starts: this module is also the runner's ``__main__``.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import sys
import time
from pathlib import Path
from typing import Any

RECORD_DIR = ("mcp", "runs")


def record_dir(state_dir: Path) -> Path:
    return state_dir.joinpath(*RECORD_DIR)


def record_path(state_dir: Path, run_id: str) -> Path:
    """A detached run's record; ``run_id`` must be one ``new_run_id()`` made (never a path)."""
    import re

    from .tools import RUN_ID_PATTERN

    if not re.fullmatch(RUN_ID_PATTERN, run_id):
        from ..errors import UserError

        raise UserError(f"{run_id!r} is not a run id (they look like 20261127-233922471-49a9)")
    return record_dir(state_dir) / f"{run_id}.json"


def write_record(path: Path, record: dict[str, Any]) -> None:
    """Atomically, readable by its owner only."""
    path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        json.dump(record, f)
    os.replace(tmp, path)


def read_record(path: Path) -> dict[str, Any] | None:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def main() -> int:
    spec = json.loads(sys.stdin.read())
    if os.fork():  # the parent tells the server the runner's pid through the pipe and leaves
        return 0
    os.setsid()  # its own session: not in the server's process group or session
    signal.signal(signal.SIGTERM, _cancelled)  # cancel_run before the run's own handling is in place
    state_dir = Path(spec["state_dir"])
    path = record_path(state_dir, spec["run_id"])
    out = os.open(path.with_suffix(".out"), os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    null = os.open(os.devnull, os.O_RDWR)
    from ..jobs.run_owner import process_start  # (standard library only)

    record = {
        "run_id": spec["run_id"],
        "pid": os.getpid(),
        "start": process_start(os.getpid()),  # with the host: which process is the runner, for good
        "host": socket.gethostname(),
        "started_at": time.time(),
        "command": spec["command"],
        "state": "starting",
    }
    write_record(path, record)
    sys.stdout.write(f"{os.getpid()}\n")
    sys.stdout.flush()
    os.dup2(null, 0)
    os.dup2(out, 1)  # notices (a rank paused, a host started cold...) and anything printed
    os.dup2(out, 2)
    os.close(null)
    os.close(out)
    try:
        record.update(_run(spec, path, record))
    except BaseException as e:  # noqa: BLE001 - every ending is recorded, as one line
        record.update(_failure(e))
    record["ended_at"] = time.time()
    write_record(path, record)
    return 0


def _run(spec: dict[str, Any], path: Path, record: dict[str, Any]) -> dict[str, Any]:
    from ..jobs import job_load

    def say(message: str) -> None:
        sys.stderr.write(f"monarch: {message}\n")
        sys.stderr.flush()

    job = job_load(spec["state"])
    record["state"] = "running"
    write_record(path, record)
    with open(os.devnull, "wb") as sink:  # every rank's output is in its log already
        result = job.run_spmd(
            spec["command"],
            cold=spec.get("cold", False),
            keep_ranks=spec.get("keep_ranks", False),
            stdout=sink,
            stderr=sink,
            on_event=say,
            post_mortem=spec.get("post_mortem", False),
            env=spec.get("env") or {},
            sync=spec.get("sync", True),
            run_id=spec["run_id"],
        )
    return {"state": "finished", "exit_code": result.exit_code}


def _cancelled(sig: int, frame: Any) -> None:
    raise KeyboardInterrupt


def _failure(e: BaseException) -> dict[str, Any]:
    from ..cli.console import describe_error, internal_message

    known = describe_error(e)
    if isinstance(e, KeyboardInterrupt):
        known = ("cancelled before its ranks started", "interrupted", 130)
    if known is None:
        known = (internal_message(e, "see the server's log"), "internal", 70)
    return {"state": "error", "error": known[0], "kind": known[1]}


if __name__ == "__main__":
    sys.exit(main())
