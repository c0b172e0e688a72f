"""Requests (and a few one-way messages) from a client to a host agent."""

from __future__ import annotations

from typing import NamedTuple

from .base import CLIENT_AGENT, CLIENT_PROC, PROC_AGENT, _message

__all__ = [
    "Heartbeat",
    "HEARTBEAT_ACK",
    "Ping",
    "ReservePort",
    "ReleasePort",
    "RunRanks",
    "ForgetPreload",
    "WarmHints",
    "LearnedModules",
    "ProbePeers",
    "FanOut",
    "FAN_OUT_KINDS",
    "OutputCredit",
    "SignalRanks",
    "Stopping",
    "SpawnProcs",
    "RelayToProc",
    "RelayToClient",
    "StopProcs",
    "ClientExit",
    "Shutdown",
    "SyncManifest",
    "SyncApplyRequest",
    "TelemetrySample",
    "TelemetryStacks",
    "DebugList",
    "DebugAttach",
    "DebugDetach",
    "DebugInput",
    "DebugCast",
    "DebugContinue",
    "DebugDap",
    "DebugDapData",
    "DebugDapEnd",
]


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


@_message("warm_hints", CLIENT_AGENT)
class WarmHints(NamedTuple):
    """Module names this reservation's runs are expected to import (read from the served script,
    or learned by earlier reservations of its workspace): the warm process imports those that
    are installed code here before the first run. Answered with how many were new."""

    cid: int
    reply_to: str
    modules: list[str]


@_message("learned_modules", CLIENT_AGENT)
class LearnedModules(NamedTuple):
    """What this reservation's warm process holds beyond the explicit preload (names, in import
    order), for the client to hint to the next reservation of its workspace."""

    cid: int
    reply_to: str


@_message("fan_out", CLIENT_AGENT)
class FanOut(NamedTuple):
    """Ask ``targets`` (other agents of the reservation) the request ``inner`` (its header, with
    any ``cid`` and ``reply_to``: the relaying agent puts its own) and answer with one list, in
    ``targets``' order: ``None`` for a target that did not answer within ``timeout``, else
    ``(ok, frames)``, the target's answer as it sent it (the client decodes it). A client of
    thousands of hosts links ~√N agents and asks each for its share, instead of a CURVE
    handshake and a request per host (docs/architecture.md, "At scale"). Only the kinds in
    :data:`FAN_OUT_KINDS` are passed on; the body goes with each."""

    cid: int
    reply_to: str
    targets: list[str]
    timeout: float
    inner: tuple


#: What a relaying agent passes on: questions, whose answers it need not understand.
FAN_OUT_KINDS = frozenset({"ping", "telemetry_stacks", "telemetry_sample", "forget_preload", "warm_hints"})


@_message("probe_peers", CLIENT_AGENT)
class ProbePeers(NamedTuple):
    """Can this host reach the other hosts' agents (a TCP connect each)? Answered with
    ``{address: ""}`` for a peer reached, else a few words on how it failed: a partition
    between hosts (their ranks hang in a collective) shows here while every agent answers."""

    cid: int
    reply_to: str
    peers: list[str]
    timeout: float


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
    """Fork procs; the body is ``(specs [(proc_id, ready cid)], client settings, import context)``.
    ``relay``: the client cannot reach this host, nor the host it: the procs talk to it through
    this agent (:class:`RelayToProc`, :class:`RelayToClient`)."""

    cid: int
    reply_to: str
    relay: bool


@_message("relay_to_proc", CLIENT_AGENT)
class RelayToProc(NamedTuple):
    """A message for a proc of this host (at ``inbox``) that the client cannot reach: the body is
    that message's frames, which the agent passes on as they are (never unpickled). Only to a
    proc this agent forked and that is still alive (else its owner has a ``proc_exit``)."""

    proc_id: str
    inbox: str


@_message("relay_to_client", PROC_AGENT)
class RelayToClient(NamedTuple):
    """A relayed proc's message for its client (a reply, an event): the body is that message's
    frames, which the agent sends as they are on the connection the client opened to it."""

    client: str


@_message("stop_procs", CLIENT_AGENT)
class StopProcs(NamedTuple):
    cid: int
    reply_to: str
    proc_ids: list[str]
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
    """Body: a ``SyncCheck`` (:mod:`..agent.sync`); answered with a ``SyncStatus``."""

    cid: int
    reply_to: str


@_message("sync_apply", CLIENT_AGENT)
class SyncApplyRequest(NamedTuple):
    """Body: a ``SyncApply`` (:mod:`..agent.sync`); answered with a ``SyncApplied``."""

    cid: int
    reply_to: str


@_message("telemetry_sample", CLIENT_AGENT)
class TelemetrySample(NamedTuple):
    cid: int
    reply_to: str
    run_id: str | None


@_message("telemetry_stacks", CLIENT_AGENT)
class TelemetryStacks(NamedTuple):
    cid: int
    reply_to: str
    run_id: str | None
    ranks: list[int] | None
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
