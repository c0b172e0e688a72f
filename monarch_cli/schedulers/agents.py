"""What every backend needs to bring agents up: discovery through address files, and waiting.

A backend starts its agents its own way (processes, an sbatch script, pods) and feeds
:func:`wait_for_agents` with its own discovery (a function returning ``{host: address}``)
and its own check for failures that make waiting pointless.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from pathlib import Path

from ..errors import SchedulerError
from ..runtime.launch.command import READY_PREFIX
from ..sysutil import source_address_towards
from .base import HostRecord, Progress

Discover = Callable[[], dict[str, str]]


def read_address_files(directory: Path, names: Iterable[str]) -> dict[str, str]:
    """``{name: address}`` for each agent that has written ``directory/<name>.addr`` completely."""
    found = {}
    for name in names:
        try:
            text = (directory / f"{name}.addr").read_text()
        except OSError:
            continue
        if text.startswith(READY_PREFIX) and text.endswith("\n"):
            found[name] = text[len(READY_PREFIX) :].strip()
    return found


def wait_for_agents(
    discover: Discover,
    names: list[str],
    progress: Progress,
    *,
    timeout: float,
    check: Callable[[], None] = lambda: None,
    label: str = "agents up",
    interval: float = 0.1,
) -> list[HostRecord]:
    """Wait until every agent of ``names`` is discovered; their records in ``names`` order.

    ``check`` raises when waiting is pointless (a process or job ended); after ``timeout``
    seconds the missing agents are named in a :class:`SchedulerError`.
    """
    deadline = time.monotonic() + timeout
    last = ""
    while True:
        found = discover()
        msg = f"{label}: {len(found)}/{len(names)}"
        if msg != last:
            progress(msg)
            last = msg
        if all(n in found for n in names):
            return [HostRecord(name=n, agent=found[n], pid=None, node_rank=i) for i, n in enumerate(names)]
        check()
        if time.monotonic() > deadline:
            missing = ", ".join(n for n in names if n not in found)
            raise SchedulerError(f"agents on {missing} did not come up within {timeout:.0f} s")
        time.sleep(interval)


def controller_host(agents: list[str]) -> str | None:
    """An address of this machine that remote agents can reach, when the default would not do.

    The controller's mailbox advertises ``$MONARCH_HOST`` or what this host's name resolves
    to; on many login nodes that is a loopback address, useless to agents on other hosts.
    Then the right address is the one the kernel routes towards the agents. None when the
    default is fine or nothing better is known.
    """
    from ..config import advertised_host, env, settings

    if settings().host or env.host or not advertised_host().startswith("127."):
        return None
    for address in agents:
        host = address.rpartition("//")[2].rpartition(":")[0]
        if not host or host.startswith("127.") or host in ("localhost", "*"):
            continue
        source = source_address_towards(host)
        if source is not None:
            return source
    return None


__all__ = ["read_address_files", "wait_for_agents", "controller_host"]
