"""What a command is to the job API: an argv list, a shell string, or a torchx AppDef (client side)."""

from __future__ import annotations

import os
import re
import shlex
from collections.abc import Sequence
from typing import Any

from .errors import JobError

Command = str | Sequence[str] | Any  # a command line, an argv list, or a torchx AppDef


def command_and_hosts(cmd: Command, hosts: int | None) -> tuple[list[str], int | None]:
    """Accept an argv list, a shell string, or a torchx AppDef (its first role).

    The host count is ``hosts`` if given, else the AppDef's replicas, else None (the
    scheduler decides).
    """
    if cmd is None:
        return [], hosts
    if isinstance(cmd, str):
        return shlex.split(cmd), hosts
    roles = getattr(cmd, "roles", None)
    if roles is not None:  # torchx.specs.AppDef
        if len(roles) != 1:
            raise JobError(
                f"AppDef {getattr(cmd, 'name', '')!r} has {len(roles)} roles; monarch runs exactly one SPMD role"
            )
        role = roles[0]
        argv = _unwrap_torchx_shell([role.entrypoint, *role.args])
        return argv, hosts or int(role.num_replicas)
    return [str(c) for c in cmd], hosts


_TORCHX_MACRO = re.compile(r"\$\{(\w+)(?::=([^}]*))?\}")


def _unwrap_torchx_shell(argv: list[str]) -> list[str]:
    """torchx's dist.ddp wraps torchrun in ``bash -c "..."`` with ``${macros}``: unwrap it.

    ``${app_id}`` becomes ``monarch`` (a run id is made per run anyway); ``${VAR:=default}``
    takes its default, as the shell would when VAR is unset. Its rendezvous flags are then
    served by the reservation itself.
    """
    if len(argv) == 3 and os.path.basename(argv[0]) in ("bash", "sh") and argv[1] == "-c":
        text = _TORCHX_MACRO.sub(lambda m: "monarch" if m.group(1) == "app_id" else (m.group(2) or ""), argv[2])
        inner = shlex.split(text)
        if inner and os.path.basename(inner[0]) in ("torchrun", "python", "python3"):
            return inner
    return argv
