"""Placing a run's ranks on a reservation's hosts, and the environment each one gets (client side).

``plan_spmd`` turns a torchrun command into one :class:`~.model.Launch` per rank (torchrun's
whole environment contract; a host's ranks share one plan, from which each rank's spec is
built as it is sent); ``plan_exec`` is one shell per host for ``monarch exec``. What of this
machine's environment a rank inherits is decided here too.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

from ..config import KEY_FILE_ENV, KEYS_ENV
from ..runtime import protocol
from .errors import JobError
from .model import FixedSpec, HostSet, Launch
from .telemetry import enabled as telemetry_enabled
from .torchrun import SpmdSpec, rank_environment, resolve_nproc

_HOST_SPECIFIC = {"HOSTNAME", "PWD", "OLDPWD", "SHLVL", "_", KEYS_ENV, KEY_FILE_ENV, "TERM_SESSION_ID"}


def user_environment() -> dict[str, str]:
    """The caller's environment as ranks should see it (host-specific entries left out)."""
    return {k: v for k, v in os.environ.items() if k not in _HOST_SPECIFIC and not k.startswith("SLURM_")}


#: What reaches ranks on a host that does not share this machine's filesystem (a synced host)
#: without ``-e``: the client's PATH, HOME, PYTHONPATH or VIRTUAL_ENV would be wrong there.
FORWARDED_PREFIXES = (
    "TORCH_",
    "TORCHINDUCTOR_",
    "PYTORCH_",
    "NCCL_",
    "GLOO_",
    "OMP_",
    "MKL_",
    "HF_",
    "WANDB_",
    "TOKENIZERS_",
    "LOGLEVEL",
)
FORWARDED_NAMES = (
    "PYTHONUNBUFFERED",
    "PYTHONHASHSEED",
    "PYTHONFAULTHANDLER",
    "CUBLAS_WORKSPACE_CONFIG",
    "LANG",
    "LC_ALL",
)


def remote_environment() -> dict[str, str]:
    """The caller's variables that ranks on a synced host get by default (see docs/sync.md)."""
    return {k: v for k, v in os.environ.items() if k.startswith(FORWARDED_PREFIXES) or k in FORWARDED_NAMES}


def parse_env_flags(items: Sequence[str]) -> dict[str, str]:
    """``-e NAME=VALUE`` sets, ``-e NAME`` forwards this shell's value; an unset NAME is an error."""
    out: dict[str, str] = {}
    for item in items:
        name, eq, value = item.partition("=")
        if not name or not (name[0].isalpha() or name[0] == "_") or not all(c.isalnum() or c == "_" for c in name):
            raise JobError(f"-e takes NAME or NAME=VALUE, not {item!r}")
        if not eq:
            if name not in os.environ:
                raise JobError(f"-e {name}: {name} is not set here; give a value with -e {name}=VALUE")
            value = os.environ[name]
        out[name] = value
    return out


def warm_capable(spec: SpmdSpec) -> bool:
    """A forked warm rank cannot take interpreter flags (``-O``, ``-X``, ``-W``...); ``-u`` it can."""
    return spec.mode != "no_python" and all(a == "-u" for a in spec.python_args)


def plan_exec(
    command: list[str],
    hostset: HostSet,
    environ: dict[str, str] | None = None,
    node_cwd: dict[int, str] | None = None,
    node_environ: dict[int, dict[str, str]] | None = None,
) -> list[Launch]:
    """One shell per host for ``monarch exec``; GROUP_RANK/NODE_RANK tell the hosts apart."""
    env = dict(environ if environ is not None else user_environment())
    shell = command if len(command) > 1 else ["/bin/sh", "-c", command[0]]
    return [
        Launch(
            node,
            host.name,
            node,
            0,
            FixedSpec(
                {
                    "rank": node,
                    "env": {**(node_environ or {}).get(node, env), "GROUP_RANK": str(node), "NODE_RANK": str(node)},
                    "cwd": (node_cwd or {}).get(node, os.getcwd()),
                    "mode": "no_python",
                    "program": shell,
                    "python_args": [],
                    "warm": False,
                    "host_store": False,
                }
            ),
        )
        for node, host in enumerate(hostset.hosts)
    ]


def plan_spmd(
    spec: SpmdSpec,
    hostset: HostSet,
    run_id: str,
    *,
    cold: bool,
    master_port: int | None,
    restart_count: int = 0,
    environ: dict[str, str] | None = None,
    post_mortem: bool = False,
    keep: bool = False,
    cwd: str | None = None,
    node_cwd: dict[int, str] | None = None,
    node_environ: dict[int, dict[str, str]] | None = None,
) -> list[Launch]:
    """Place ranks on hosts and build each one's environment and program (run in ``cwd``, default here).

    ``node_cwd``/``node_environ`` override both for some hosts (those that run in a synced mirror).
    """
    hosts = hostset.hosts
    nnodes = spec.nnodes or len(hosts)
    if spec.nnodes_min is not None:  # elastic MIN:MAX, as torchrun: as many of the reserved hosts as MAX allows
        if spec.nnodes_min > len(hosts):
            raise JobError(
                f"--nnodes {spec.nnodes_min}:{spec.nnodes} needs at least {spec.nnodes_min} hosts; "
                f"{len(hosts)} are reserved"
            )
        nnodes = min(nnodes, len(hosts))
    if nnodes > len(hosts):
        raise JobError(f"--nnodes {nnodes} asks for more hosts than the {len(hosts)} reserved; serve more hosts first")
    per_node = [resolve_nproc(spec.nproc_per_node, i["gpus"], i["cpus"]) for i in hostset.infos[:nnodes]]
    if len(set(per_node)) != 1:
        raise JobError(
            f"--nproc-per-node={spec.nproc_per_node} gives different counts per host ({per_node}); give a number"
        )
    nproc = per_node[0]
    base = dict(environ if environ is not None else user_environment())
    base.setdefault("PYTHONUNBUFFERED", "1")  # live output, as a user watching ranks expects
    master_addr = spec.master_addr or hostset.infos[0]["addr"]
    host_store = spec.master_port is None
    port = spec.master_port if spec.master_port is not None else master_port
    if port is None:
        raise JobError("no master port")
    launches = []
    cwd = cwd or os.getcwd()
    telemetry_on = telemetry_enabled()
    warm = not cold and warm_capable(spec)
    for node in range(nnodes):
        # One dict for the host's ranks (as the base environment is), not one per rank.
        node_telemetry = (
            {
                "run_id": run_id,
                "agent_pid": hostset.infos[node].get("pid"),
                "dir": hostset.infos[node].get("telemetry_dir"),
            }
            if telemetry_on
            else None
        )
        plan = _SpmdHostRanks(
            spec,
            node,
            nnodes,
            nproc,
            master_addr,
            port,
            spec.rdzv_id or run_id,
            restart_count,
            hostset.infos[node]["cpus"],
            (node_environ or {}).get(node, base),
            (node_cwd or {}).get(node, cwd),
            warm,
            host_store,
            post_mortem,
            node_telemetry,
            keep and warm,
        )
        for local in range(nproc):
            rank = node * nproc + local
            launches.append(Launch(rank, f"rank{rank}", node, local, plan))
    return launches


class _SpmdHostRanks:
    """What one host's ranks share; a rank's spec is built from it as it is sent (:class:`HostRanks`).
    A plain class: a dataclass would cost every ``run-spmd`` ~1.5 ms to define at import."""

    __slots__ = (
        "command",
        "node",
        "nnodes",
        "nproc",
        "master_addr",
        "port",
        "rdzv_id",
        "restart_count",
        "cpus",
        "env_base",
        "cwd",
        "warm",
        "host_store",
        "post_mortem",
        "telemetry",
        "keep",
    )

    def __init__(
        self,
        command: SpmdSpec,
        node: int,
        nnodes: int,
        nproc: int,
        master_addr: str,
        port: int,
        rdzv_id: str,
        restart_count: int,
        cpus: int,
        env_base: dict[str, str],
        cwd: str,
        warm: bool,
        host_store: bool,
        post_mortem: bool,
        telemetry: dict[str, Any] | None,
        keep: bool = False,
    ) -> None:
        self.command = command
        self.node = node
        self.nnodes = nnodes
        self.nproc = nproc
        self.master_addr = master_addr
        self.port = port
        self.rdzv_id = rdzv_id
        self.restart_count = restart_count
        self.cpus = cpus
        self.env_base = env_base
        self.cwd = cwd
        self.warm = warm
        self.host_store = host_store
        self.post_mortem = post_mortem
        self.telemetry = telemetry
        self.keep = keep

    def spec(self, local: int) -> protocol.RankSpec:
        # Only what differs from the host's base: the base is one dict shared by its ranks
        # (pickled once per host), which the agent merges under this.
        env = rank_environment(
            self.command,
            node_rank=self.node,
            nnodes=self.nnodes,
            local_rank=local,
            nproc_per_node=self.nproc,
            master_addr=self.master_addr,
            master_port=self.port,
            run_id=self.rdzv_id,
            restart_count=self.restart_count,
            cpus_on_host=self.cpus,
            environ=self.env_base,
        )
        rank = self.node * self.nproc + local
        if self.host_store:
            env["TORCHELASTIC_USE_AGENT_STORE"] = "True"  # rank 0 serves the store we reserved
        out: protocol.RankSpec = {
            "rank": rank,
            "env": env,
            "env_base": self.env_base,
            "cwd": self.cwd,
            "mode": self.command.mode,
            "program": self.command.program,
            "python_args": self.command.python_args,
            "warm": self.warm,
            "host_store": self.host_store and rank == 0,
            "post_mortem": self.post_mortem,
        }
        if self.telemetry is not None:  # lets the rank's agent trace it, dump its stack, time its steps
            out["telemetry"] = self.telemetry
        if self.keep:
            out["keep"] = True
        return out
