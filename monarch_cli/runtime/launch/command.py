"""The host agent's command line, built and parsed in one place.

Every backend (and ``this_host()``) starts agents through :class:`AgentCommand`, and the
agent parses its arguments with :func:`parser`, so the two cannot disagree. Keys never
appear here: they travel on stdin or in a 0600 file named by ``$MONARCH_KEY_FILE``.
"""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ...config import AGENT_READY_PREFIX, EnvSettings

if TYPE_CHECKING:
    import argparse

AGENT_MODULE = "monarch_cli.runtime.agent"
#: What an agent writes (address file, ready fd, stdout) once it listens, before its address.
READY_PREFIX = AGENT_READY_PREFIX


@dataclasses.dataclass
class AgentCommand:
    """How to start one host agent."""

    python: str = dataclasses.field(default_factory=lambda: sys.executable)
    #: Host name to report (default: the hostname); several agents on one machine act as separate hosts.
    name: str | None = None
    #: Address to advertise to peers (default: ``$MONARCH_HOST`` or this host's IP).
    host: str | None = None
    #: Listen on this port (default: any free one); Kubernetes and clouds need a known port.
    port: int | None = None
    #: Keep every port the agent, its procs and its ranks open within [lo, hi].
    port_range: tuple[int, int] | None = None
    #: Comma-separated modules warm ranks import up front (None: torch if installed).
    preload: str | None = None
    #: Start the warm-rank zygote now, not at the first run.
    warm_up: bool = False
    #: Read the reservation keys from stdin's first line.
    keys_stdin: bool = False
    #: Exit (killing all procs) when stdin closes: the agent lives as long as its starter.
    exit_with_stdin: bool = False
    #: Write the ready line here once listening (atomically; discovery through a shared directory).
    address_file: str | None = None
    #: Write the ready line to this inherited fd.
    ready_fd: int | None = None
    #: The reservation's name, shown in ``ps`` (``monarch agent <reservation> host <name>``).
    reservation: str = ""
    #: The client's state file (local agents): the agent registers itself under it and exits
    #: once that file no longer records ``reservation``.
    state_file: str | None = None
    #: Exit unless a client holding the keys asks something within this many seconds of the start
    #: (hosts where the client's state file is not visible: a serve killed before it saved the
    #: reservation leaves no agent behind).
    lease: float | None = None

    def argv(self) -> list[str]:
        cmd = [self.python, "-m", AGENT_MODULE]
        if self.address_file is not None:
            cmd += ["--address-file", str(self.address_file)]
        if self.ready_fd is not None:
            cmd += ["--ready-fd", str(self.ready_fd)]
        if self.keys_stdin:
            cmd.append("--keys-stdin")
        if self.exit_with_stdin:
            cmd.append("--exit-with-stdin")
        if self.name:
            cmd += ["--name", self.name]
        if self.host:
            cmd += ["--host", self.host]
        if self.port is not None:
            cmd += ["--port", str(self.port)]
        if self.port_range is not None:
            cmd += ["--port-range", format_port_range(self.port_range)]
        if self.preload is not None:
            cmd += ["--preload", self.preload]
        if self.warm_up:
            cmd.append("--warm-up")
        if self.reservation:
            cmd += ["--reservation", self.reservation]
        if self.state_file:
            cmd += ["--state-file", self.state_file]
        if self.lease is not None:
            cmd += ["--lease", f"{self.lease:g}"]
        return cmd

    def to_json(self) -> dict[str, Any]:
        data = dataclasses.asdict(self)
        data["port_range"] = list(self.port_range) if self.port_range else None
        return data

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> AgentCommand:
        data = dict(data)
        if data.get("port_range") is not None:
            data["port_range"] = tuple(data["port_range"])
        return cls(**data)


def parse_port_range(text: str) -> tuple[int, int]:
    """``LO-HI`` (inclusive) as a pair; ValueError with a readable message otherwise."""
    lo, sep, hi = text.partition("-")
    try:
        pair = (int(lo), int(hi)) if sep else (-1, -1)
    except ValueError:
        pair = (-1, -1)
    if not (0 < pair[0] <= pair[1] < 65536):
        raise ValueError(f"a port range is LO-HI with 0 < LO <= HI < 65536, not {text!r}")
    return pair


def format_port_range(pair: tuple[int, int]) -> str:
    return f"{pair[0]}-{pair[1]}"


def parser() -> argparse.ArgumentParser:
    """The agent's argument parser (``python -m monarch_cli.runtime.agent``)."""
    import argparse  # (the agent's, not every client's: `run-spmd` imports this module)

    p = argparse.ArgumentParser(
        prog=f"python -m {AGENT_MODULE}", description="The host agent: one long-lived process per host."
    )
    p.add_argument("--address-file", type=Path, help="write the agent's address here once it listens")
    p.add_argument("--ready-fd", type=int, help="write the address to this inherited fd")
    p.add_argument("--keys-stdin", action="store_true", help="read the reservation keys from stdin's first line")
    p.add_argument("--exit-with-stdin", action="store_true", help="exit (killing all procs) when stdin closes")
    p.add_argument("--host", help=f"address to advertise to peers (default: ${EnvSettings.host.var} or this host's IP)")
    p.add_argument("--port", type=int, help="listen on this port (default: any free port)")
    p.add_argument(
        "--port-range",
        type=parse_port_range,
        metavar="LO-HI",
        help="keep every port the agent, its procs and ranks open within LO-HI",
    )
    p.add_argument("--preload", help="comma-separated modules warm ranks import up front (default: torch if installed)")
    p.add_argument("--warm-up", action="store_true", help="start the warm-rank zygote now, not at the first run")
    p.add_argument(
        "--name",
        help="host name to report (default: the hostname); lets several agents on one machine act as separate hosts",
    )
    p.add_argument("--reservation", default="", help="the reservation's name, shown in ps")
    p.add_argument(
        "--state-file",
        help="register under this client state file and exit once it no longer names --reservation (local agents)",
    )
    p.add_argument(
        "--lease",
        type=float,
        metavar="SECONDS",
        help="exit unless a client holding the keys asks something within SECONDS (a serve that died "
        "before it saved the reservation)",
    )
    return p


def is_agent_command(cmdline: str) -> bool:
    """Whether a process's command line (NULs as spaces) is a host agent: its title once it runs
    (``monarch agent <reservation> host <name>``), or ``-m monarch_cli.runtime.agent`` before it sets
    one. Not its fork server (``-m monarch_cli.runtime.agent.zygote``), which lives in the same package."""
    if cmdline.startswith("monarch agent "):
        return True
    words = cmdline.split()
    return any(a == "-m" and b == AGENT_MODULE for a, b in zip(words, words[1:]))


__all__ = [
    "AgentCommand",
    "AGENT_MODULE",
    "is_agent_command",
    "READY_PREFIX",
    "parser",
    "parse_port_range",
    "format_port_range",
]
