"""Runs on every node of a Slurm reservation (one srun task each) and becomes its host agent.

``python -m monarch_cli.schedulers.slurm.node --dir D [agent options]``: the agent is
named after the Slurm node, advertises an address the other nodes can reach, reads the
keys from ``$MONARCH_KEY_FILE`` and writes its address to ``D/agents/<node>.addr``, where
the client (:func:`monarch_cli.schedulers.agents.read_address_files`) finds it.
"""

from __future__ import annotations

import argparse
import os
import signal
import socket
import sys
from pathlib import Path

from ...config import KEY_FILE_ENV, EnvSettings
from ...runtime.launch.command import AgentCommand, parse_port_range
from ...sysutil import source_address_towards


def node_address(node: str) -> str:
    """The address other nodes reach this one at: the node name's, else any non-loopback one."""
    candidates: list[str] = []
    for name in (node, socket.gethostname()):
        try:
            # an AF_INET sockaddr is (host, port): the host is always a str
            candidates += [a[4][0] for a in socket.getaddrinfo(name, None, socket.AF_INET) if isinstance(a[4][0], str)]
        except OSError:
            pass
    for addr in candidates:
        if not addr.startswith("127."):
            return addr
    submit_host = os.environ.get("SLURM_SUBMIT_HOST")
    routed = source_address_towards(submit_host) if submit_host else None
    if routed is not None:
        return routed
    return candidates[0] if candidates else "127.0.0.1"


def agent_command(
    directory: Path, preload: str | None, port: int | None, port_range: tuple[int, int] | None
) -> AgentCommand:
    node = os.environ.get("SLURMD_NODENAME") or socket.gethostname()
    return AgentCommand(
        name=node,
        host=node_address(node),
        address_file=str(directory / "agents" / f"{node}.addr"),
        warm_up=True,
        preload=preload,
        port=port,
        port_range=port_range,
        reservation=f"slurm-{os.environ.get('SLURM_JOB_ID', '')}",
    )  # its title in ps


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m monarch_cli.schedulers.slurm.node", description=__doc__.splitlines()[0]
    )
    parser.add_argument("--dir", type=Path, required=True, help="the reservation's directory (shared filesystem)")
    parser.add_argument("--preload")
    parser.add_argument("--port", type=int)
    parser.add_argument("--port-range", type=parse_port_range)
    args = parser.parse_args(argv)
    if not os.environ.get(KEY_FILE_ENV):
        sys.exit(f"monarch slurm agent: ${KEY_FILE_ENV} is not set")
    # Slurm's --signal without B: signals every process of the job's steps: the agent must
    # not die of it. Ranks inherit the ignore and still get it (directly, from Slurm); a
    # script that installs a handler (the checkpoint pattern) is unaffected.
    for sig in (signal.SIGUSR1, signal.SIGUSR2):
        signal.signal(sig, signal.SIG_IGN)
    argv_ = agent_command(args.dir, args.preload, args.port, args.port_range).argv()
    os.environ.pop(EnvSettings.host.var, None)  # the submitter's, not this node's
    os.execv(argv_[0], argv_)
    return 0  # not reached


if __name__ == "__main__":
    sys.exit(main())
