"""The tools an agent sees: names, descriptions written for an agent, JSON input schemas, hints.

Plain data (no MCP import): ``server.py`` turns it into the SDK's ``Tool`` objects, and
checks every call's arguments against the schema before a handler runs (jsonschema), so a
wrong argument is one line naming it, never a traceback.
"""

from __future__ import annotations

import dataclasses
from typing import Any

INSTRUCTIONS = """\
monarch serves a reservation of hosts and runs torchrun-style SPMD jobs on it in seconds.
Typical session: `status` (is something served?), `serve` (reserve hosts once, with the
training command), `run_spmd` (run it; returns within wait_s with the run's state), then
`wait_run` until state is final. On a failure: the result names the first failing rank and
its last lines; `logs` (rank, tail, grep) gives more, `diagnose` names the rank that
differs in a hung or slow run, `stack` shows every live rank's Python stack, `sql` answers
anything else from the telemetry store (`sql` with schema=true lists the tables). Edit the
code, `run_spmd` again (your edits are picked up every time). `stop` releases the hosts.
Results are JSON objects (the same as `monarch CMD --json` prints) with a short text;
long output is cut and says what was left out and how to get it."""

_COMMAND = {
    "type": ["string", "array"],
    "items": {"type": "string"},
    "description": "A command line as one string (split as a shell would, no shell features) or as a list "
    "of words, e.g. 'torchrun --nproc-per-node=2 train.py --epochs 5'.",
}
#: What ``new_run_id()`` makes (``20261127-233922471-49a9``): a run id names files, so nothing else
#: (``../``) is taken.
RUN_ID_PATTERN = r"^[0-9]{8}-[0-9]{9}-[0-9a-f]{4}$"
_RUN_ID = {
    "type": "string",
    "pattern": RUN_ID_PATTERN,
    "description": "A run id, as run_spmd returned it (default: the latest run).",
}
_WAIT = {
    "type": "number",
    "minimum": 0,
    "maximum": 3600,
    "default": 60,
    "description": "Block at most this many seconds for the run to end (progress is notified meanwhile). "
    "If it is still running then, you get its progress and it keeps going: call wait_run.",
}
_TAIL = {
    "type": "integer",
    "minimum": 0,
    "maximum": 200,
    "default": 20,
    "description": "How many of the last output lines to include (of the first failing rank, else rank 0).",
}
_OPTIONS = {
    "type": "object",
    "additionalProperties": {"type": ["string", "integer", "boolean", "array"], "items": {"type": "string"}},
    "description": 'Backend options by name, e.g. {"partition": "gpu", "time": "01:00:00"} for slurm '
    "(a bad name or value is refused with the backend's list).",
}


@dataclasses.dataclass(frozen=True)
class ToolSpec:
    name: str
    title: str
    description: str
    properties: dict[str, Any]
    required: tuple[str, ...] = ()
    read_only: bool = False
    destructive: bool = False
    idempotent: bool = False

    @property
    def input_schema(self) -> dict[str, Any]:
        schema: dict[str, Any] = {"type": "object", "properties": self.properties, "additionalProperties": False}
        if self.required:
            schema["required"] = list(self.required)
        return schema


TOOLS = [
    ToolSpec(
        "serve",
        "Reserve hosts",
        "Reserve hosts for SPMD runs and leave a host agent on each; reuses the current reservation when it "
        "can serve the request (replace=true releases one that cannot). Give the training command here "
        "(e.g. 'torchrun --nproc-per-node=2 train.py') so that run_spmd runs it by default, in this server's "
        "directory. hosts is a count (local, slurm, kubernetes, skypilot) or host names (ssh). dry_run=true "
        "returns the plan and starts nothing. Returns the reservation's status (hosts, agents, last run).",
        {
            "command": _COMMAND,
            "hosts": {
                "type": ["integer", "string", "array"],
                "items": {"type": "string"},
                "description": "How many hosts (default 1), or for ssh their names ('gpu1,gpu2' or a list).",
            },
            "scheduler": {
                "type": "string",
                "default": "local",
                "description": "local (this machine), slurm, ssh, kubernetes or skypilot.",
            },
            "options": _OPTIONS,
            "preload": {"type": "string", "description": "Modules warm ranks import up front (default: torch)."},
            "replace": {"type": "boolean", "default": False},
            "dry_run": {"type": "boolean", "default": False},
        },
        idempotent=True,
        destructive=True,  # replace=true releases a reservation and ends its run
    ),
    ToolSpec(
        "run_spmd",
        "Run the job",
        "Run the served command (or `command`) on every host of the reservation, as torchrun would: one "
        "process per rank, RANK/WORLD_SIZE/MASTER_* set, your latest edits picked up. Blocks up to wait_s; "
        "returns the run id and its state: 'finished' with exit_code, the exit status of each group of ranks "
        "(rank_groups), the first failing rank and the tail of its output; or 'running' with its progress "
        "(ranks exited, lines so far, latest lines), in which case the run keeps going (also if this call "
        "times out) and wait_run picks it up. Full logs: logs; a rank stuck or slow: diagnose, stack.",
        {
            "command": _COMMAND,
            "wait_s": _WAIT,
            "tail": _TAIL,
            "env": {
                "type": "object",
                "additionalProperties": {"type": "string"},
                "description": "Extra environment variables for every rank.",
            },
            "cold": {"type": "boolean", "default": False, "description": "Start ranks in fresh interpreters."},
            "keep_ranks": {
                "type": "boolean",
                "default": False,
                "description": "Keep the rank processes for the next keep_ranks run (imports, CUDA context, "
                "compiled graphs survive; globals, process group, seeds, logging are reset).",
            },
            "post_mortem": {
                "type": "boolean",
                "default": False,
                "description": "Keep a rank that raises paused in pdb at the failing frame (see debug_list).",
            },
            "sync": {
                "type": "boolean",
                "default": True,
                "description": "Mirror this directory to hosts that do not share its filesystem first.",
            },
        },
        destructive=True,  # any command, on every host
    ),
    ToolSpec(
        "wait_run",
        "Wait for a run",
        "Wait up to wait_s for a run to end (default: the latest run), with progress notifications; returns "
        "the same object as run_spmd: 'finished' with its result, 'running' with its progress (call again), "
        "'error' (it could not start: the message says why) or 'lost' (its process died). Works for runs "
        "started by an earlier server or from a terminal too.",
        {"run_id": _RUN_ID, "wait_s": _WAIT, "tail": _TAIL, "rank": {"type": "integer", "minimum": 0}},
        read_only=True,
    ),
    ToolSpec(
        "cancel_run",
        "Cancel a run",
        "End a run this server started: its ranks get SIGTERM and, after torchrun's shutdown timeout (30 s), "
        "SIGKILL; with force=true they are killed at once. Waits up to wait_s for the end and returns the "
        "run as wait_run does.",
        {
            "run_id": _RUN_ID,
            "force": {"type": "boolean", "default": False},
            "wait_s": {**_WAIT, "default": 40},
            "tail": _TAIL,
        },
        destructive=True,
    ),
    ToolSpec(
        "logs",
        "Read a run's output",
        "Read a run's per-rank output (default: the latest run, every rank): the last `tail` lines of each "
        "rank, or with grep (a Python regular expression) the last `tail` matching lines, each with its "
        "line number. Counts say how many lines were left out; at most 1000 lines a call. Also returns the "
        "log files' paths and the run's result once it ended (as `monarch logs --json`).",
        {
            "run_id": _RUN_ID,
            "rank": {"type": "integer", "minimum": 0, "description": "Only this rank."},
            "tail": {"type": "integer", "minimum": 1, "maximum": 1000, "default": 100},
            "grep": {"type": "string", "description": "Only lines matching this regular expression."},
        },
        read_only=True,
    ),
    ToolSpec(
        "status",
        "Reservation status",
        "Is a reservation served here, and is it healthy: scheduler, hosts with agent liveness and running "
        "ranks, the default command, the last run. Cheap; call it first.",
        {},
        read_only=True,
    ),
    ToolSpec(
        "sql",
        "Query telemetry",
        "One read-only SQLite query of the reservation's telemetry store: tables runs, ranks, logs (every "
        "output line), hosts, events, samples (CPU, memory, GPU per rank per second), steps (optimizer step "
        "times), stacks. schema=true returns the tables, their columns and example queries. Anything but a "
        "read is refused. At most `limit` rows are returned (the count of the rest is given).",
        {
            "query": {"type": "string", "description": "One SELECT statement."},
            "schema": {"type": "boolean", "default": False},
            "limit": {"type": "integer", "minimum": 1, "maximum": 500, "default": 200},
        },
        read_only=True,
    ),
    ToolSpec(
        "stack",
        "Python stacks of live ranks",
        "Capture every live rank's Python stack (py-spy, without stopping it) and group identical ones: "
        "'3 ranks (0-1,3): barrier <- train.py:20' next to '1 rank (2): load <- data.py:7' shows who is "
        "stuck where. Needs a run in progress.",
        {
            "ranks": {"type": "string", "description": "Only these ranks, e.g. '0,2-3'."},
            "native": {"type": "boolean", "default": False, "description": "Include C/C++ frames."},
        },
        read_only=True,
    ),
    ToolSpec(
        "diagnose",
        "Which rank is wrong",
        "One verdict on the current (or last) run: healthy, suspect (which rank differs from the rest and "
        "why: it failed first, went silent, is slower, stuck elsewhere) or unknown, with the evidence "
        "(stacks grouped, step times, output ages). Use it on a failure or a hang before reading logs.",
        {
            "silence": {
                "type": "number",
                "minimum": 0,
                "default": 60,
                "description": "Seconds without output that make a rank suspect.",
            }
        },
        read_only=True,
    ),
    ToolSpec(
        "exec",
        "Shell command on every host",
        "Run a shell command on every host of the reservation (in this directory, or its mirror) and return "
        "each host's exit status and last lines; e.g. 'nvidia-smi -L' or 'pip list | grep torch'. For short "
        "commands: it blocks until every host is done.",
        {"command": _COMMAND},
        required=("command",),
        destructive=True,
    ),
    ToolSpec(
        "debug_list",
        "Ranks paused in pdb",
        "The ranks paused in breakpoint()/pdb (or post-mortem) of the newest run that has any: rank, host, "
        "file:line, function, state.",
        {"run_id": _RUN_ID},
        read_only=True,
    ),
    ToolSpec(
        "debug_cast",
        "pdb command to paused ranks",
        "Send one pdb command to paused ranks and return each rank's answer: 'p loss', 'bt', 'where', "
        "'p tensor.shape'; 'c' lets them run on. ranks: '*' (default), '0,3', '2-5', '0:8:2'.",
        {
            "command": {"type": "string", "description": "The pdb command."},
            "ranks": {"type": "string", "default": "*"},
            "run_id": _RUN_ID,
        },
        required=("command",),
        destructive=True,
    ),
    ToolSpec(
        "warm",
        "Warm processes",
        "Each host's warm process (it forks ranks with torch and what your script imported already loaded): "
        "modules held, learned from past runs, memory. forget=true drops what it learned.",
        {"forget": {"type": "boolean", "default": False}},
        idempotent=True,
    ),
    ToolSpec(
        "stop",
        "Release the reservation",
        "Release the reservation: every agent, warm process and rank on its hosts ends; a run in progress "
        "ends with exit status 254. Nothing to stop is not an error. options: the backend's stop options "
        "(skypilot: keep_cluster). force=true also clears an unreadable state file.",
        {"options": _OPTIONS, "force": {"type": "boolean", "default": False}},
        destructive=True,
        idempotent=True,
    ),
]

BY_NAME = {t.name: t for t in TOOLS}
