"""Records that are dicts on purpose (the agent and zygote complete them), and the JSON
messages of a rank's debugger channel."""

from __future__ import annotations

from typing import Any, TypedDict

__all__ = [
    "RankSpec",
    "ProcBoot",
    "DebuggerOutput",
    "DebuggerPaused",
    "DebuggerResumed",
    "DapReady",
    "DapFailed",
    "DebuggerInput",
    "DapConnect",
    "RankDebugMessage",
    "AgentDebugMessage",
    "DEBUGGER_CHANNEL",
]


# ---------------------------------------------------------- rank spec, proc boot
class RankSpec(TypedDict, total=False):
    """One rank, as the client plans it (:mod:`monarch_cli.jobs.plan`); the agent completes
    it (``env``, ``warm``, ``cwd``, ``fd_roles``, ``module_report``) and the zygote hands it
    to :mod:`..rank.start`."""

    rank: int
    env: dict[str, str]
    #: Under ``env`` (which wins): the environment the rank's host shares with its other ranks, one
    #: object in the client and once in the pickle of the host's specs; the agent merges and drops it.
    env_base: dict[str, str]
    cwd: str
    mode: str  # script | module | no_python
    program: list[str]
    python_args: list[str]
    warm: bool
    host_store: bool  # rank 0 serves the rendezvous store on the port the agent held
    post_mortem: bool
    keep: bool  # --keep-ranks: the rank stays for the next run (runtime/rank/keep.py)
    telemetry: dict[str, Any]  # run_id, agent_pid, dir
    module_report: str  # (agent) where a warm rank writes what it imported
    _fd_roles: dict[str, int]  # (agent) listen / debug: index into the fds passed with the fork
    _zygote_pid: int  # (zygote)


#: What a forked proc needs to start (built by the agent, read by :mod:`..actor.proc`); ``import`` is
#: the spawner's import context (sys.path, cwd), ``pid`` and ``_zygote_pid`` are added on the way.
ProcBoot = TypedDict(
    "ProcBoot",
    {
        "keys": str,
        "proc_id": str,
        "ready_call_id": int,
        "owner": str,
        "agent": str,
        "host": str,
        "settings": dict[str, Any],
        "import": dict[str, Any],
        "relay": bool,
        "pid": int,
        "_zygote_pid": int,
    },
    total=False,
)


# ------------------------------------------------ rank ↔ agent: the debugger channel (JSON)
class DebuggerOutput(TypedDict):
    type: str  # "output"
    data: str


class DebuggerPaused(TypedDict):
    type: str  # "paused"
    file: str
    line: int
    function: str
    reason: str


class DebuggerResumed(TypedDict):
    type: str  # "resumed"


class DapReady(TypedDict):
    type: str  # "dap_ready"
    cwd: str


class DapFailed(TypedDict):
    type: str  # "dap_error"
    error: str


class DebuggerInput(TypedDict):
    """Agent → rank: a line for pdb."""

    type: str  # "input"
    line: str


class DapConnect(TypedDict):
    """Agent → rank: connect debugpy to the agent's loopback ``port`` (0: reuse the link)."""

    type: str  # "dap"
    port: int
    handoff: bool


RankDebugMessage = DebuggerOutput | DebuggerPaused | DebuggerResumed | DapReady | DapFailed
AgentDebugMessage = DebuggerInput | DapConnect
#: The debugger channel's message types by their ``type`` (for docs and the table test).
DEBUGGER_CHANNEL: dict[str, str] = {
    "output": "rank → agent",
    "paused": "rank → agent",
    "resumed": "rank → agent",
    "dap_ready": "rank → agent",
    "dap_error": "rank → agent",
    "input": "agent → rank",
    "dap": "agent → rank",
}
