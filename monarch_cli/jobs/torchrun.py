"""Parse torchrun-style command lines and reproduce torchrun's per-rank environment.

Users already have working ``torchrun ...`` / ``python train.py`` command lines; accepting
them verbatim makes ``monarch run-spmd`` a drop-in replacement.  Every torchrun flag is
either honoured, explicitly ignored (documented below), or rejected with a
:class:`JobError` -- never silently dropped, because a silently ignored flag changes what
the user's job does.  The flag list mirrors ``torch/distributed/run.py`` (torch 2.13).
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from sys import intern
from typing import Any

from .argscan import OptionScanner
from .errors import JobError

__all__ = ["SpmdSpec", "parse_command", "resolve_nproc", "rank_environment"]

_TOOL = "monarch run-spmd"
_TORCHRUN_MODULES = frozenset({"torch.distributed.run", "torchrun"})
_PYTHON_RE = re.compile(r"^python[0-9.]*t?$")
_NPROC_WORDS = frozenset({"gpu", "cpu", "auto"})
_STD_RE = re.compile(r"^(?:[0-3]|\d+:[0-3](?:,\d+:[0-3])*)$")


@dataclass
class SpmdSpec:
    """What to run on every rank, and how many ranks, as a torchrun command described it.

    ``nnodes`` is None when the command did not say (use every reserved host); a
    ``MIN:MAX`` range sets ``nnodes=MAX`` and ``nnodes_min=MIN`` (``nnodes_min`` is None
    for a plain count).  ``python_args`` are interpreter flags placed before the script
    or ``-m module``; torchrun itself always launches workers with ``python -u``.
    """

    nnodes: int | None = None
    nnodes_min: int | None = None
    nproc_per_node: int | str = 1
    program: list[str] = field(default_factory=list)
    mode: str = "script"
    standalone: bool = False
    master_addr: str | None = None
    master_port: int | None = None
    rdzv_backend: str | None = None
    rdzv_endpoint: str | None = None
    rdzv_id: str | None = None
    rdzv_conf: str | None = None
    local_ranks_filter: set[int] | None = None
    tee: str | None = None
    redirects: str | None = None
    log_dir: str | None = None
    role: str = "default"
    max_restarts: int = 0
    node_rank: int | None = None
    python_args: list[str] = field(default_factory=list)
    shutdown_timeout: int | None = None  # seconds from a forwarded SIGTERM to SIGKILL

    def moot_flags(self) -> list[str]:
        """Flags given that the reservation makes moot: its agents do torchrun's rendezvous."""
        return [flag for flag, attr in _MOOT if getattr(self, attr) is not None]


# Accepted so that multi-node torchrun commands (torchx's dist.ddp among them) run as they are.
_MOOT = (
    ("--rdzv-backend", "rdzv_backend"),
    ("--rdzv-endpoint", "rdzv_endpoint"),
    ("--rdzv-conf", "rdzv_conf"),
    ("--node-rank", "node_rank"),
)


def _int(value: str, flag: str, minimum: int = 0) -> int:
    try:
        number = int(value)
    except ValueError:
        raise JobError(f"{flag}={value!r} is not an integer; pass a whole number") from None
    if number < minimum:
        raise JobError(f"{flag}={number} is out of range; it must be >= {minimum}")
    return number


def _nnodes(value: str, flag: str) -> tuple[int, int | None]:
    parts = value.split(":")
    if len(parts) > 2:
        raise JobError(f"{flag}={value!r} is not N or MIN:MAX; pass e.g. {flag}=2 or {flag}=1:4")
    low, high = _int(parts[0], flag, 1), _int(parts[-1], flag, 1)
    if low > high:
        raise JobError(f"{flag}={value}: MIN {low} is larger than MAX {high}; swap them")
    return high, (low if len(parts) == 2 else None)


def _nproc(value: str, flag: str) -> int | str:
    if value in _NPROC_WORDS:
        return value
    if not re.fullmatch(r"\s*[-+]?\d+\s*", value):
        why = f"is not supported by {_TOOL}" if value == "xpu" else "is not valid"
        raise JobError(f"{flag}={value!r} {why}; pass a number, gpu, cpu or auto")
    return _int(value, flag, 1)


def _port(value: str, flag: str) -> int:
    port = _int(value, flag)
    if port > 65535:
        raise JobError(f"{flag}={port} is not a TCP port; pass a number in 0..65535")
    return port


def _ranks_filter(value: str, flag: str) -> set[int] | None:
    if value == "":
        return None  # torchrun treats an empty filter as "show every rank"
    if not re.fullmatch(r"\d+(,\d+)*", value.replace(" ", "")):
        raise JobError(f"{flag}={value!r} is not a comma-separated list of ranks, e.g. 0,1,2")
    return {int(item) for item in value.split(",")}


def _std(value: str, flag: str) -> str:
    if not _STD_RE.match(value):
        raise JobError(f"{flag}={value!r} is not valid; pass 0-3 (none/out/err/both) or a per-rank map like 0:1,1:2")
    return value


def _interval(value: str, flag: str) -> None:
    """Accepted and ignored: monarch supervises ranks by events, not by polling."""
    try:
        float(value)
    except ValueError:
        raise JobError(f"{flag}={value!r} is not a number of seconds") from None


def _start_method(value: str, flag: str) -> None:
    """Accepted and ignored: the host agent starts ranks, so the method has no effect."""
    if value not in ("spawn", "fork", "forkserver"):
        raise JobError(f"{flag}={value!r} is not valid; pass spawn, fork or forkserver")


def _nonempty(value: str, flag: str) -> str:
    if not value:
        raise JobError(f"{flag} is empty; give it a value")
    return value


def _text(value: str, flag: str) -> str:
    return value


# canonical flag -> (SpmdSpec attribute or None when ignored, converter)
_VALUE_FLAGS: dict[str, tuple[str | None, Callable[[str, str], Any]]] = {
    "--nnodes": ("nnodes", _nnodes),
    "--nproc-per-node": ("nproc_per_node", _nproc),
    "--rdzv-backend": ("rdzv_backend", _text),
    "--rdzv-endpoint": ("rdzv_endpoint", _text),
    "--rdzv-id": ("rdzv_id", _text),
    "--rdzv-conf": ("rdzv_conf", _text),
    "--max-restarts": ("max_restarts", _int),
    "--monitor-interval": (None, _interval),
    "--start-method": (None, _start_method),
    "--role": ("role", _text),  # torchx passes --role ''; torchrun takes it
    "--log-dir": ("log_dir", _nonempty),
    "--redirects": ("redirects", _std),
    "--tee": ("tee", _std),
    "--local-ranks-filter": ("local_ranks_filter", _ranks_filter),
    "--node-rank": ("node_rank", _int),
    "--master-addr": ("master_addr", _nonempty),
    "--master-port": ("master_port", _port),
    "--shutdown-timeout": ("shutdown_timeout", _int),
}
_BOOL_FLAGS = {
    "--standalone": "standalone",
    "--module": "module",
    "--no-python": "no_python",
    "--run-path": "run_path",
}
_SHORT = {"-m": "--module", "-r": "--redirects", "-t": "--tee"}
_UNSUPPORTED = {
    "--logs-specs": "custom LogsSpecs plugins run inside torchrun's agent, which monarch replaces",
    "--local-addr": "monarch reaches hosts through their agent addresses",
    "--event-log-handler": "torchelastic event handlers run inside torchrun's agent",
    "--numa-binding": "NUMA binding of ranks is not implemented yet",
    "--signals-to-handle": "monarch forwards its own fixed set of signals to ranks",
    "--virtual-local-rank": "per-rank CUDA_VISIBLE_DEVICES remapping is not implemented yet",
    "--duplicate-stdout-filters": "log duplication filters are not implemented",
    "--duplicate-stderr-filters": "log duplication filters are not implemented",
}
_KNOWN = sorted({*_VALUE_FLAGS, *_BOOL_FLAGS, *_UNSUPPORTED})


def _unknown_flag(written: str) -> JobError:
    probe = written.replace("_", "-")
    # torchrun's argparse accepts unique prefixes (--nnode); we do not, but we suggest the flag.
    prefixed = [known for known in _KNOWN if known.startswith(probe)] if len(probe) > 3 else []
    import difflib  # (only when a flag is unknown)

    guess = prefixed or difflib.get_close_matches(probe, _KNOWN, n=1)
    hint = f"did you mean {guess[0]}?" if guess else "see `torchrun --help` for the flags it takes"
    return JobError(f"unknown torchrun flag {written}; {hint} (flags meant for your program go after the script)")


def _parse_torchrun(args: list[str]) -> SpmdSpec:
    """Parse the arguments after ``torchrun`` (or ``python -m torch.distributed.run``)."""
    values: dict[str, Any] = {}
    flags: dict[str, bool] = {}
    scan = OptionScanner(args, short_equals=True)  # argparse's rule: -r=3 is -r 3
    for option in scan:
        written = option.flag
        canonical = "--" + written[2:].replace("_", "-") if written.startswith("--") else _SHORT.get(written, written)
        attached = option.value
        if canonical in _UNSUPPORTED:
            raise JobError(f"torchrun flag {written} is not supported by {_TOOL}: {_UNSUPPORTED[canonical]}; remove it")
        if canonical in _BOOL_FLAGS:
            if attached is not None:
                raise JobError(f"torchrun flag {written} takes no value; remove '{attached}'")
            flags[_BOOL_FLAGS[canonical]] = True
        elif canonical in _VALUE_FLAGS:
            if attached is None:
                attached = scan.take_value()
                if attached is None:
                    raise JobError(f"torchrun flag {written} needs a value, e.g. {written}=VALUE")
            attr, convert = _VALUE_FLAGS[canonical]
            converted = convert(attached, written)
            if attr is not None:
                values[attr] = converted
        else:
            raise _unknown_flag(option.token.partition("=")[0])
    rest = scan.rest
    if not rest or not rest[0]:
        raise JobError("torchrun command names no script; add e.g. `train.py` after the flags")
    return _build_torchrun_spec(values, flags, rest[0], rest[1:])


def _build_torchrun_spec(values: dict[str, Any], flags: dict[str, bool], target: str, rest: list[str]) -> SpmdSpec:
    """Apply torchrun's cross-flag rules once every flag has been read."""
    nnodes, nnodes_min = values.pop("nnodes", (None, None))
    standalone = flags.get("standalone", False)
    if standalone:
        if nnodes is not None and nnodes > 1:
            raise JobError(
                f"--standalone runs a single node but --nnodes asks for up to {nnodes}; drop --standalone or --nnodes"
            )
        nnodes = 1
    if flags.get("no_python") and flags.get("module") and not flags.get("run_path"):
        raise JobError("--no-python and --module cannot be used together; pick one")
    mode = "module" if flags.get("module") else "no_python" if flags.get("no_python") else "script"
    if flags.get("run_path"):
        mode = "script"  # torchrun: --run-path takes precedence over --no-python/--module
    return SpmdSpec(
        nnodes=nnodes,
        nnodes_min=nnodes_min,
        program=[target, *rest],
        mode=mode,
        standalone=standalone,
        python_args=[] if mode == "no_python" else ["-u"],
        **values,
    )


_PY_NOARG = set("bBdEIOPqsSuvx")
_PY_ARG = set("WX")


def _python_error(option: str) -> JobError:
    return JobError(
        f"python option {option} is not supported in a {_TOOL} command; "
        "put the code in a script file (or package module) and run that"
    )


def _parse_python(args: list[str]) -> SpmdSpec:
    """Parse the arguments after a python interpreter, following CPython's option rules."""
    python_args: list[str] = []
    i = 0
    while i < len(args) and args[i].startswith("-") and args[i] != "--":
        token, i = args[i], i + 1
        if token == "-" or token.startswith("--"):
            raise _python_error(token)
        for j, char in enumerate(token[1:], start=1):
            if char == "m":
                attached = token[j + 1 :]
                module = attached or (args[i] if i < len(args) else "")
                python_args += [token[:j]] if j > 1 else []
                return _python_module(module, args[i if attached else i + 1 :], python_args)
            if char in _PY_ARG:
                python_args.append(token)
                if j + 1 == len(token):  # value is the next word, as in `-W ignore`
                    if i >= len(args):
                        raise JobError(f"python option -{char} needs a value, e.g. -{char} VALUE")
                    python_args.append(args[i])
                    i += 1
                break
            if char not in _PY_NOARG:
                raise _python_error(f"-{char}")
        else:
            python_args.append(token)
    i += 1 if i < len(args) and args[i] == "--" else 0
    if i >= len(args) or not args[i]:
        raise JobError("python command names no script; add e.g. `train.py` or `-m package.module`")
    return SpmdSpec(program=args[i:], mode="script", python_args=python_args)


def _python_module(module: str, rest: list[str], python_args: list[str]) -> SpmdSpec:
    """Handle ``python [flags] -m MODULE ...``: torchrun itself, or a user module."""
    if not module:
        raise JobError("`python -m` names no module; add one, e.g. `python -m package.train`")
    if module in _TORCHRUN_MODULES:
        # Interpreter flags here apply to the launcher; torchrun starts workers with `python -u`.
        return _parse_torchrun(rest)
    if module == "torch.distributed.launch":
        raise JobError(
            "torch.distributed.launch is deprecated and not supported; "
            "use `torchrun` (or `python -m torch.distributed.run`) with the same flags"
        )
    return SpmdSpec(program=[module, *rest], mode="module", python_args=python_args)


def parse_command(argv: list[str]) -> SpmdSpec:
    """Turn a torchrun / python / bare-script command line into an :class:`SpmdSpec`."""
    if not argv:
        raise JobError("empty command; give one, e.g. `torchrun --nproc-per-node=2 train.py`")
    args = [str(arg) for arg in argv]
    head = os.path.basename(args[0])
    first_word = os.path.basename(args[0].split()[0]) if args[0].strip() else ""
    if " " in args[0] and (first_word == "torchrun" or _PYTHON_RE.match(first_word)):
        raise JobError(f"{args[0]!r} looks like a whole command in one argument; split it into words")
    if head == "torchrun":
        return _parse_torchrun(args[1:])
    if _PYTHON_RE.match(head):
        return _parse_python(args[1:])
    if head.endswith(".py"):
        return SpmdSpec(program=args, mode="script")
    if "=" in head and head.split("=", 1)[0].isidentifier():
        raise JobError(
            f"environment assignment {head!r} before the command is not supported; export the variable instead"
        )
    raise JobError(
        f"cannot tell how to run {args[0]!r}; start the command with torchrun, python "
        "or a .py script, or use `torchrun --no-python PROGRAM` for other executables"
    )


def resolve_nproc(value: int | str, gpus_available: int, cpus_available: int) -> int:
    """Turn ``--nproc-per-node`` into a count, with torchrun's meaning of gpu/cpu/auto."""
    if isinstance(value, str):
        value = _nproc(value, "--nproc-per-node")
    if isinstance(value, str):
        if value == "gpu" and gpus_available < 1:
            raise JobError("--nproc-per-node=gpu but the host has no GPUs; pass a number or cpu")
        use_gpus = value == "gpu" or (value == "auto" and gpus_available > 0)
        return gpus_available if use_gpus else max(1, cpus_available)
    if isinstance(value, bool) or value < 1:
        raise JobError(f"--nproc-per-node={value!r} is out of range; it must be a number >= 1")
    return value


def rank_environment(
    spec: SpmdSpec,
    *,
    node_rank: int,
    nnodes: int,
    local_rank: int,
    nproc_per_node: int,
    master_addr: str,
    master_port: int,
    run_id: str,
    restart_count: int = 0,
    cpus_on_host: int,
    environ: Mapping[str, str] | None = None,
) -> dict[str, str]:
    """The environment torchrun's agent gives one worker, so unmodified scripts just work.

    ``environ`` is the environment the rank process inherits (default ``os.environ``):
    like torchrun, an inherited ``OMP_NUM_THREADS`` or ``TORCH_NCCL_ASYNC_ERROR_HANDLING``
    wins.  ``OMP_NUM_THREADS=1`` is returned only when torchrun would set it (more than
    one rank per node and not inherited); torchrun does not scale it by ``cpus_on_host``,
    so neither do we.  ``TORCHELASTIC_USE_AGENT_STORE`` is "False" because no agent-side
    TCPStore exists: rank 0 hosts the store at MASTER_ADDR:MASTER_PORT.  NODE_RANK is an
    extra (torchrun does not set it) equal to GROUP_RANK.
    """
    if not (0 <= node_rank < nnodes) or not (0 <= local_rank < nproc_per_node):
        raise ValueError(
            f"rank out of range: node_rank={node_rank} of {nnodes}, local_rank={local_rank} of {nproc_per_node}"
        )
    env = os.environ if environ is None else environ
    rank = node_rank * nproc_per_node + local_rank
    # One string object for each value many ranks share (interned): 32,768 ranks' environments
    # held by a client otherwise carry ~8 copies of the same digits each.
    rank_s, node_s, world_s = str(rank), intern(str(node_rank)), intern(str(nnodes * nproc_per_node))
    result = {
        "RANK": rank_s,
        "LOCAL_RANK": intern(str(local_rank)),
        "WORLD_SIZE": world_s,
        "LOCAL_WORLD_SIZE": intern(str(nproc_per_node)),
        "GROUP_RANK": node_s,
        "GROUP_WORLD_SIZE": intern(str(nnodes)),
        "ROLE_RANK": rank_s,
        "ROLE_WORLD_SIZE": world_s,
        "ROLE_NAME": spec.role,
        "MASTER_ADDR": master_addr,
        "MASTER_PORT": intern(str(master_port)),
        "NODE_RANK": node_s,
        "TORCHELASTIC_RUN_ID": run_id,
        "TORCHELASTIC_RESTART_COUNT": intern(str(restart_count)),
        "TORCHELASTIC_MAX_RESTARTS": intern(str(spec.max_restarts)),
        "TORCHELASTIC_USE_AGENT_STORE": "False",
        "TORCH_NCCL_ASYNC_ERROR_HANDLING": env.get("TORCH_NCCL_ASYNC_ERROR_HANDLING", "1"),
    }
    if nproc_per_node > 1 and "OMP_NUM_THREADS" not in env:
        result["OMP_NUM_THREADS"] = "1"
    return result
