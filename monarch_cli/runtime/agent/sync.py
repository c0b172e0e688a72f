"""The agent's side of workspace sync: answer manifest checks, apply change sets to the mirror.

Requests arrive on the agent's authenticated inbox like every other request (so a backend
reached only through one forwarded port gets sync too):

* :class:`~..protocol.SyncManifest` with a :class:`SyncCheck` body: tells whether this host
  sees the client's workspace itself (one of its files at the same path with the same inode,
  size and mtime), and otherwise the mirror's directory and digest, plus its manifest when
  the client's digest differs.
* :class:`~..protocol.SyncApplyRequest` with a :class:`SyncApply` body: deletions and files (bytes
  out of band) written atomically into the mirror.

A mirror lives at ``$MONARCH_REMOTE_DIR/<reservation>/workspace/<name>`` (default
``~/.monarch-cli``): private to the reservation, removed with it.
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from ...config import env
from .. import protocol
from ..protocol.sync import SyncApplied, SyncApply, SyncCheck, SyncStatus  # noqa: F401 - the bodies this module answers
from ..transport import wire
from ..workspace import Mirror

if TYPE_CHECKING:
    from .core import AgentCore

_mirrors: dict[str, Mirror] = {}
_SAFE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")


def remote_root() -> str:
    return env.remote_dir or os.path.join(os.path.expanduser("~"), ".monarch-cli")


def mirror_dir(reservation: str, name: str) -> str:
    for part in (reservation, name):
        if not _SAFE.match(part):
            raise ValueError(f"bad mirror name {part!r}")
    return os.path.join(remote_root(), reservation, "workspace", name)


def _mirror(reservation: str, name: str) -> Mirror:
    directory = mirror_dir(reservation, name)
    mirror = _mirrors.get(directory)
    if mirror is None:
        mirror = _mirrors[directory] = Mirror(directory, remote_root())
    return mirror


def _shares_filesystem(check: SyncCheck) -> bool:
    """The same file at the same path with the same inode, size and ns mtime: the same filesystem.

    Nothing is written for this; a host's stale attribute cache can only make it answer "no"
    (the run then uses a mirror: slower, still right).
    """
    try:
        st = os.stat(os.path.join(check.workspace, check.probe))
    except OSError:
        return False
    return (st.st_ino, st.st_size, st.st_mtime_ns) == tuple(check.probe_stat)


def check(req: SyncCheck) -> SyncStatus:
    if _shares_filesystem(req):
        return SyncStatus(True, req.workspace, "", None)
    mirror = _mirror(req.reservation, req.name)
    files = None if not req.digest or mirror.digest == req.digest else mirror.files
    return SyncStatus(False, mirror.dir, mirror.digest, files)


def apply(req: SyncApply) -> SyncApplied:
    mirror = _mirror(req.reservation, req.name)
    if req.base and mirror.digest != req.base:  # changed since the client looked (another client syncing?)
        raise RuntimeError("the mirror changed during the sync; sync again")
    written, nbytes = mirror.apply(req.updates, req.deleted)
    return SyncApplied(written, nbytes, mirror.digest)


def handlers(agent: AgentCore) -> dict[type, Callable[[Any, list[Any]], None]]:
    """The messages this part of the agent answers."""
    return {
        protocol.SyncManifest: lambda msg, body: _answer(agent, msg, body, check),
        protocol.SyncApplyRequest: lambda msg, body: _answer(agent, msg, body, apply),
    }


def _answer(agent: AgentCore, msg: Any, body: list[Any], serve: Callable[[Any], Any]) -> None:
    """Answer one sync request; a failure is the caller's error naming this host."""
    try:
        value = serve(wire.loads(body))
    except Exception as e:  # noqa: BLE001 - a full disk or bad path must reach the client, not kill the agent
        agent.reply(msg.reply_to, msg.cid, False, f"workspace sync on {agent.host} failed: {type(e).__name__}: {e}")
        return
    agent.reply(msg.reply_to, msg.cid, True, value)
