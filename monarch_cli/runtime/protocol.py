"""Every message between the runtime's processes, defined once.

A message is a :class:`typing.NamedTuple` whose class carries its ``KIND``. On the wire it
travels as a plain tuple ``(KIND, *fields)`` (:func:`header`): a plain tuple pickles to a
few bytes more than its fields, while a NamedTuple would pickle its class by reference and
cost a global lookup on every receipt. The receiver rebuilds the typed message with
:func:`decode` (``_make``, one tuple allocation) and reads fields by name. A message's large
payload (rank output, a pickled request body) travels as the body frames beside the header
(see :mod:`.wire`), never in it.

Conventions, which the agent relies on to answer a message it does not know:

* a **request** has ``cid`` and ``reply_to`` as its first two fields, and is answered with
  one :class:`Result` (``cid`` 0: no answer is awaited);
* an **event** is sent unasked; events of one run carry its ``run_id``, by which the client
  routes them to that run's subscription (:mod:`.mailbox_events`).

The zygote's socketpair carries the same header tuples, pickled whole. The rank's debugger
channel carries JSON objects (``{"type": ...}``); they are typed here as :class:`TypedDict`.
The per-rank spec and a proc's boot record are dicts (the zygote adds to them) typed the
same way.
"""

from __future__ import annotations

from typing import Any, Callable, Dict, List, NamedTuple, Optional, Tuple, Type, TypeVar, TypedDict, Union

from .errors import Failure

M = TypeVar("M", bound=Type[Any])

#: Every message class by its kind (what :func:`decode` looks up).
MESSAGES: Dict[str, Type[Any]] = {}
#: Which process sends each kind to which (the table in docs/architecture.md follows it).
ROUTES: Dict[str, str] = {}


def _message(kind: str, route: str) -> Callable[[M], M]:
    def register(cls: M) -> M:
        if kind in MESSAGES:
            raise RuntimeError(f"message kind {kind!r} is defined twice")
        cls.KIND = kind
        MESSAGES[kind] = cls
        ROUTES[kind] = route
        return cls

    return register


def header(msg: Any) -> Tuple[Any, ...]:
    """The plain tuple a message travels as: ``(KIND, *fields)``."""
    return (msg.KIND, *msg)


def decode(head: Tuple[Any, ...]) -> Any:
    """The typed message of a received header; ``KeyError`` for a kind this side does not know,
    ``TypeError`` for a known kind with the wrong number of fields."""
    return MESSAGES[head[0]]._make(head[1:])


def answer_to(head: Tuple[Any, ...]) -> Optional[Tuple[int, str]]:
    """``(cid, reply_to)`` of a header of any kind, known or not, that asks for an answer (by
    the convention above); None when it asks for none. Lets a receiver refuse a kind it does
    not know (a newer sender) with an error instead of leaving the sender to time out."""
    if len(head) >= 3 and type(head[1]) is int and head[1] > 0 and isinstance(head[2], str):
        return head[1], head[2]
    return None


def not_understood(head: Tuple[Any, ...], who: str) -> str:
    """The error for a message ``who`` cannot read: an unknown kind, or a known one with other fields."""
    kind = head[0] if head else None
    if kind not in MESSAGES:
        return f"{who} does not understand {kind!r} messages (is it older than this client? start it again)"
    return (f"{who} cannot read a {kind!r} message of {len(head) - 1} fields (it expects "
            f"{', '.join(MESSAGES[kind]._fields) or 'none'}; are both sides the same version?)")


CLIENT_AGENT = "client → agent"
AGENT_CLIENT = "agent → client"
CLIENT_PROC = "client → proc"
PROC_CLIENT = "proc → owner"
AGENT_ZYGOTE = "agent → zygote"
ZYGOTE_AGENT = "zygote → agent"
ANY = "any → requester"


# ---------------------------------------------------------------------------- answers
@_message("result", ANY)
class Result(NamedTuple):
    """The answer to a request; the body is the value, or ``(message, traceback, exception)`` if not ``ok``."""

    cid: int
    ok: bool


# ------------------------------------------------------------------ client → agent
@_message("heartbeat", CLIENT_AGENT)
class Heartbeat(NamedTuple):
    """Answered with the raw frame :data:`HEARTBEAT_ACK` on the connection it came on."""

    client: str


HEARTBEAT_ACK = b"ack"


@_message("ping", CLIENT_AGENT + ", " + CLIENT_PROC)
class Ping(NamedTuple):
    """Host info from an agent (a dict), the pid from a proc."""

    cid: int
    reply_to: str


@_message("reserve_port", CLIENT_AGENT)
class ReservePort(NamedTuple):
    """Bind and hold rank 0's rendezvous port for a run; answered with the port."""

    cid: int
    reply_to: str
    run_id: str


@_message("release_port", CLIENT_AGENT)
class ReleasePort(NamedTuple):
    cid: int
    reply_to: str
    run_id: str


@_message("run_ranks", CLIENT_AGENT)
class RunRanks(NamedTuple):
    """Start a run's ranks on this host; the body is a list of :class:`RankSpec`."""

    cid: int
    reply_to: str
    run_id: str
    heartbeat_timeout: float


@_message("forget_preload", CLIENT_AGENT)
class ForgetPreload(NamedTuple):
    cid: int
    reply_to: str


@_message("output_credit", CLIENT_AGENT)
class OutputCredit(NamedTuple):
    """The client has printed ``nbytes`` more of the run's output (flow control, no answer)."""

    run_id: str
    nbytes: int


@_message("signal_ranks", CLIENT_AGENT)
class SignalRanks(NamedTuple):
    cid: int
    reply_to: str
    run_id: str
    signal: int


@_message("stopping", CLIENT_AGENT)
class Stopping(NamedTuple):
    """The reservation is being released by ``who``: running runs are told so."""

    cid: int
    reply_to: str
    who: str


@_message("spawn_procs", CLIENT_AGENT)
class SpawnProcs(NamedTuple):
    """Fork procs; the body is ``(specs [(proc_id, ready cid)], client settings, import context)``."""

    cid: int
    reply_to: str


@_message("stop_procs", CLIENT_AGENT)
class StopProcs(NamedTuple):
    cid: int
    reply_to: str
    proc_ids: List[str]
    grace: float


@_message("client_exit", CLIENT_AGENT)
class ClientExit(NamedTuple):
    client: str


@_message("shutdown", CLIENT_AGENT)
class Shutdown(NamedTuple):
    cid: int
    reply_to: str


@_message("sync_manifest", CLIENT_AGENT)
class SyncManifest(NamedTuple):
    """Body: a ``SyncCheck`` (:mod:`.agent_sync`); answered with a ``SyncStatus``."""

    cid: int
    reply_to: str


@_message("sync_apply", CLIENT_AGENT)
class SyncApplyRequest(NamedTuple):
    """Body: a ``SyncApply`` (:mod:`.agent_sync`); answered with a ``SyncApplied``."""

    cid: int
    reply_to: str


@_message("telemetry_sample", CLIENT_AGENT)
class TelemetrySample(NamedTuple):
    cid: int
    reply_to: str
    run_id: Optional[str]


@_message("telemetry_stacks", CLIENT_AGENT)
class TelemetryStacks(NamedTuple):
    cid: int
    reply_to: str
    run_id: Optional[str]
    ranks: Optional[List[int]]
    native: bool


# The debugger: ``monarch debug`` (a client) to the agent holding the rank's session.
@_message("debug_list", CLIENT_AGENT)
class DebugList(NamedTuple):
    cid: int
    reply_to: str
    everything: bool


@_message("debug_attach", CLIENT_AGENT)
class DebugAttach(NamedTuple):
    cid: int
    reply_to: str
    run_id: str
    rank: int
    holder_name: str
    heartbeat_timeout: float


@_message("debug_detach", CLIENT_AGENT)
class DebugDetach(NamedTuple):
    cid: int
    reply_to: str
    run_id: str
    rank: int


@_message("debug_input", CLIENT_AGENT)
class DebugInput(NamedTuple):
    cid: int
    reply_to: str
    run_id: str
    rank: int
    line: str


@_message("debug_cast", CLIENT_AGENT)
class DebugCast(NamedTuple):
    """A pdb command whose output is the answer (not streamed to a holder)."""

    cid: int
    reply_to: str
    run_id: str
    rank: int
    line: str


@_message("debug_continue", CLIENT_AGENT)
class DebugContinue(NamedTuple):
    cid: int
    reply_to: str
    run_id: str
    rank: int


@_message("debug_dap", CLIENT_AGENT)
class DebugDap(NamedTuple):
    """Bind the rank's debugpy to this client; answered once it is connected."""

    cid: int
    reply_to: str
    run_id: str
    rank: int
    heartbeat_timeout: float


@_message("debug_dap_data", CLIENT_AGENT)
class DebugDapData(NamedTuple):
    """One whole DAP message from the IDE (``cid`` 0: no answer)."""

    cid: int
    reply_to: str
    run_id: str
    rank: int
    message: bytes


@_message("debug_dap_end", CLIENT_AGENT)
class DebugDapEnd(NamedTuple):
    cid: int
    reply_to: str
    run_id: str
    rank: int


# ------------------------------------------------------------ agent → client events
@_message("output", AGENT_CLIENT)
class Output(NamedTuple):
    """Raw bytes (the body) of one rank's stream (1 stdout, 2 stderr), in order."""

    run_id: str
    rank: int
    stream: int


@_message("rank_exit", AGENT_CLIENT)
class RankExited(NamedTuple):
    """A rank ended, after both its pipes did; ``exitcode`` and ``signal`` are None when it never
    started (``cause`` says why), ``cause`` is set when it ended by no doing of its own."""

    run_id: str
    rank: int
    exitcode: Optional[int]
    signal: Optional[int]
    duration: float
    pid: Optional[int]
    cause: str


@_message("rank_paused", AGENT_CLIENT)
class RankPaused(NamedTuple):
    """A rank stopped in a breakpoint (``where``: file, line, function, reason), told to its run's owner."""

    run_id: str
    rank: int
    host: str
    where: Dict[str, Any]


@_message("reservation_stopped", AGENT_CLIENT)
class ReservationStopped(NamedTuple):
    run_id: str
    agent: str
    who: str


@_message("telemetry", AGENT_CLIENT)
class Telemetry(NamedTuple):
    """A host's resource samples and the ranks' step records, pushed to the run's owner."""

    run_id: str
    host: str
    samples: List[Any]
    steps: List[Any]


@_message("debug_output", AGENT_CLIENT)
class DebugOutput(NamedTuple):
    run_id: str
    rank: int
    data: str


@_message("debug_state", AGENT_CLIENT)
class DebugState(NamedTuple):
    """``state`` is running, paused (``detail``: where) or exited (``detail``: how)."""

    run_id: str
    rank: int
    state: str
    detail: Any


@_message("debug_dap_to_ide", AGENT_CLIENT)
class DebugDapToIde(NamedTuple):
    """One whole DAP message from the rank's debugpy."""

    run_id: str
    rank: int
    message: bytes


@_message("debug_dap_closed", AGENT_CLIENT)
class DebugDapClosed(NamedTuple):
    run_id: str
    rank: int
    why: str


@_message("proc_exit", AGENT_CLIENT)
class ProcExited(NamedTuple):
    proc_id: str
    failure: Failure
    expected: bool


# ------------------------------------------------------------------- client → proc
@_message("call", CLIENT_PROC)
class Call(NamedTuple):
    """Call an endpoint; the body is ``(args, kwargs)``; ``cid`` None: a broadcast, no answer."""

    cid: Optional[int]
    reply_to: str
    key: str
    method: str


@_message("spawn", CLIENT_PROC)
class Spawn(NamedTuple):
    """Construct an actor; the body is ``(class, args, kwargs)``."""

    cid: int
    reply_to: str
    key: str
    name: str
    point: Any


@_message("stop_actor", CLIENT_PROC)
class StopActor(NamedTuple):
    cid: int
    reply_to: str
    key: str


@_message("stop", CLIENT_PROC)
class Stop(NamedTuple):
    cid: int
    reply_to: str


@_message("unhandled", PROC_CLIENT)
class Unhandled(NamedTuple):
    """A failure in a mesh this proc owns that no ``__supervise__`` handled."""

    proc_id: str
    failure: Failure


@_message("endpoint_error", PROC_CLIENT)
class EndpointError(NamedTuple):
    """A broadcast (no answer awaited) failed: said on the caller's stderr."""

    message: str


# ---------------------------------------------------------------- agent ↔ zygote
@_message("fork", AGENT_ZYGOTE)
class Fork(NamedTuple):
    """Fork a child (``kind``: proc, rank or cold); fds ride along (``SCM_RIGHTS``)."""

    req_id: int
    kind: str
    boot: Dict[str, Any]


@_message("forked", ZYGOTE_AGENT)
class Forked(NamedTuple):
    req_id: int
    pid: int


@_message("exit", ZYGOTE_AGENT)
class ChildExited(NamedTuple):
    pid: int
    status: int  # a wait status


@_message("ready", ZYGOTE_AGENT)
class WarmReady(NamedTuple):
    """A warm-rank zygote imported what ranks were seen to import (its report file says what)."""


# ---------------------------------------------------------- rank spec, proc boot
class RankSpec(TypedDict, total=False):
    """One rank, as the client plans it (:mod:`monarch_cli.jobs.spmd`); the agent completes
    it (``env``, ``warm``, ``cwd``, ``fd_roles``, ``module_report``) and the zygote hands it
    to :mod:`.rank_start`."""

    rank: int
    env: Dict[str, str]
    cwd: str
    mode: str  # script | module | no_python
    program: List[str]
    python_args: List[str]
    warm: bool
    host_store: bool  # rank 0 serves the rendezvous store on the port the agent held
    post_mortem: bool
    telemetry: Dict[str, Any]  # run_id, agent_pid, dir
    module_report: str  # (agent) where a warm rank writes what it imported
    _fd_roles: Dict[str, int]  # (agent) listen / debug: index into the fds passed with the fork
    _zygote_pid: int  # (zygote)


#: What a forked proc needs to start (built by the agent, read by :mod:`.proc`); ``import`` is
#: the spawner's import context (sys.path, cwd), ``pid`` and ``_zygote_pid`` are added on the way.
ProcBoot = TypedDict("ProcBoot", {
    "keys": str, "proc_id": str, "ready_call_id": int, "owner": str, "agent": str, "host": str,
    "settings": Dict[str, Any], "import": Dict[str, Any], "pid": int, "_zygote_pid": int,
}, total=False)


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


RankDebugMessage = Union[DebuggerOutput, DebuggerPaused, DebuggerResumed, DapReady, DapFailed]
AgentDebugMessage = Union[DebuggerInput, DapConnect]
#: The debugger channel's message types by their ``type`` (for docs and the table test).
DEBUGGER_CHANNEL: Dict[str, str] = {
    "output": "rank → agent", "paused": "rank → agent", "resumed": "rank → agent",
    "dap_ready": "rank → agent", "dap_error": "rank → agent", "input": "agent → rank", "dap": "agent → rank",
}
