"""The reservation as a torchx ``AppDef``, and torchx's run options as ours.

Everything torchx-specific that is plain data lives here: the one role whose replicas are
our host agents, the run config (``-o`` values, then ``.torchxconfig``, as ``torchx run``
applies them), and the mapping from a torchx scheduler's ``runopts`` to our
:class:`~monarch_cli.schedulers.base.Option` so that ``monarch serve --help`` lists what
torchx itself declares. torchx is imported here only inside functions: the registry can
name this backend without importing it.
"""

from __future__ import annotations

import dataclasses
import shlex
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ...errors import OptionError, SchedulerError
from ..base import Option

if TYPE_CHECKING:
    from torchx.runner import Runner
    from torchx.specs import AppDef

#: The third-party package this backend needs (torchx's own, continuously released build, which is what
#: Monarch itself depends on; the 0.7 release pins urllib3<1.27, which the kubernetes client cannot share).
PACKAGE = "torchx-nightly>=2026.10"
INSTALL_HINT = f"the torchx backends need torchx: pip install '{PACKAGE}'"
#: The role every replica of the reservation's app plays.
ROLE = "monarch-agent"
#: Options of ours beside the torchx scheduler's runopts (prefixed so they never shadow one of torchx's).
OWN_OPTIONS: tuple[Option, ...] = (
    Option(
        "agent_python",
        str,
        None,
        "the interpreter on the hosts (default: this one on a shared filesystem, else python3, which gets our bundle)",
    ),
    Option("agent_image", str, None, "the role's image (container schedulers; default: torchx's own default)"),
    Option("agent_cpu", int, None, "CPUs to request per host (default: torchx's; Slurm: none asked)"),
    Option("agent_gpu", int, None, "GPUs to request per host"),
    Option("agent_mem_mb", int, None, "memory to request per host, in MB"),
    Option(
        "agent_shared_fs",
        bool,
        None,
        "the replicas see this machine's filesystem (keys and monarch-cli come from it); on for local_cwd and slurm",
    ),
    Option(
        "agent_ship_bundle",
        bool,
        None,
        "ship our zero-install bundle to a stock interpreter on the replicas even where the filesystem is shared "
        "(always done where it is not)",
    ),
    Option("agent_wheelhouse", str, None, "where the bundle's wheels come from (default: this client's cache/index)"),
)
#: torchx schedulers whose replicas share the client's filesystem (Slurm: the cluster's shared home, as
#: the native slurm backend assumes too).
SHARED_FILESYSTEM = ("local_cwd", "slurm")
#: Local torchx schedulers run every replica on this machine: agents then need their own names and ports.
LOCAL_SCHEDULERS = ("local_cwd", "local_docker")


def import_torchx() -> None:
    """A missing extra is one line that names the package, never an ImportError."""
    try:
        import torchx.runner  # noqa: F401 - only to find out whether the extra is installed
    except ImportError:
        raise SchedulerError(INSTALL_HINT) from None


def torchx_schedulers() -> list[str]:
    """Every scheduler torchx knows here: its built-ins and those other packages register."""
    import_torchx()
    from torchx.schedulers import get_scheduler_factories

    return sorted(get_scheduler_factories())


def runopts_of(scheduler: str) -> Any:
    """torchx's own declaration of ``scheduler``'s run options."""
    import_torchx()
    from torchx.runner import get_runner

    if scheduler not in torchx_schedulers():
        raise SchedulerError(f"torchx knows no scheduler {scheduler!r}; it knows: {', '.join(torchx_schedulers())}")
    with get_runner() as runner:
        return runner.scheduler_run_opts(scheduler)


def options_of(scheduler: str) -> tuple[Option, ...]:
    """The torchx scheduler's runopts as our options, help text read from torchx (never copied)."""
    ours: list[Option] = []
    for name, opt in runopts_of(scheduler):
        kind: type = bool if opt.opt_type is bool else int if opt.opt_type is int else str
        required = " (required)" if opt.is_required else ""
        default = "" if opt.default in (None, "", [], {}) else f" [torchx default: {opt.default}]"
        ours.append(Option(_our_name(name), kind, None, f"torchx {scheduler}: {opt.help}{required}{default}"))
    return (*ours, *OWN_OPTIONS)


def run_config(scheduler: str, options: dict[str, Any], config_dirs: Sequence[Path]) -> dict[str, Any]:
    """The run config torchx will get: ``-o`` values cast by torchx, then ``.torchxconfig`` for what
    is unset (as ``torchx run`` does), validated and defaulted by torchx's ``resolve``."""
    from torchx.runner import config as torchx_config
    from torchx.specs.api import InvalidRunConfigException

    declared = runopts_of(scheduler)
    own = {o.name for o in OWN_OPTIONS}
    cfg: dict[str, Any] = {}
    for key, value in options.items():
        if key in own:
            continue
        key = next((n for n, _ in declared if _our_name(n) == key), key)  # back to torchx's spelling
        opt = declared.get(key)
        if opt is None:  # (check_options already refused unknown names; belt and braces)
            raise OptionError(f"torchx {scheduler} has no run option {key!r}")
        try:
            cfg[key] = opt.cast_to_type(value) if isinstance(value, str) else value
        except ValueError as e:
            raise OptionError(f"-o {key}=: {e}") from None
    torchx_config.apply(scheduler=scheduler, cfg=cfg, dirs=[str(d) for d in config_dirs])
    try:
        resolved = declared.resolve(cfg)
    except InvalidRunConfigException as e:
        raise OptionError(f"torchx {scheduler}: {str(e).splitlines()[0]}") from None
    return {k: v for k, v in resolved.items() if v is not None}


def _our_name(torchx_name: str) -> str:
    """torchx spells some run options with dashes (``mail-user``); ours are identifiers (``mail_user``)."""
    return torchx_name.replace("-", "_")


@dataclasses.dataclass
class AgentRole:
    """The one role of the reservation's app, as plain data (it goes into the plan's JSON)."""

    app_name: str
    replicas: int
    python: str
    agent_args: list[str]
    port_base: int
    env: dict[str, str]
    image: str | None = None
    cpu: int | None = None
    gpu: int | None = None
    mem_mb: int | None = None
    #: Agents get ``--name host<replica id>`` (all replicas on one machine) instead of their hostname.
    named: bool = False
    #: Where the replica's bootstrap unzips the bundle the client ships (None: the agent runs from the
    #: shared filesystem as it is); may hold ``${replica_id}``.
    bundles_dir: str | None = None
    #: Read-only bind mounts ``{"src", "dst"}`` (torchx's BindMount: the key file on local_docker).
    mounts: list[dict[str, str]] = dataclasses.field(default_factory=list)

    def shell_line(self, bootstrap_script: str = "...") -> str:
        """What each replica runs: the agent on ``port_base + replica id`` (torchx substitutes the id), or
        the stdlib-only bootstrap on that port that execs the agent once the client shipped the bundle."""
        port = f"$(({self.port_base} + ${{replica_id}}))"
        if self.bundles_dir is None:
            line = shlex.join([self.python, *self.agent_args])
        else:
            line = f"{shlex.join([self.python, '-c', bootstrap_script])} {port} {shlex.quote(self.bundles_dir)} "
            line += shlex.join(self.agent_args)
        if self.named:
            line += " --name host${replica_id}"
        return f"exec {line} --port {port}"

    def to_appdef(self) -> AppDef:
        from torchx import specs

        resource = specs.Resource(
            cpu=self.cpu if self.cpu is not None else -1,
            gpu=self.gpu if self.gpu is not None else -1,
            memMB=self.mem_mb if self.mem_mb is not None else -1,
        )
        role = specs.Role(
            name=ROLE,
            image=self.image or "",
            entrypoint="/bin/sh",
            args=["-c", self.shell_line(_bootstrap_script())],
            env=dict(self.env),
            num_replicas=self.replicas,
            resource=resource,
            max_retries=0,
            mounts=[specs.BindMount(m["src"], m["dst"], read_only=True) for m in self.mounts],
        )
        return specs.AppDef(name=self.app_name, roles=[role])


def _bootstrap_script() -> str:
    from ..bootstrap import BOOTSTRAP

    return BOOTSTRAP.strip() + "\n"


def dryrun(runner: Runner, role: AgentRole, scheduler: str, cfg: dict[str, Any]) -> Any:
    """torchx's own dry run of exactly this AppDef (the request it would submit)."""
    try:
        return runner.dryrun(role.to_appdef(), scheduler, cfg=cfg)
    except (ValueError, TypeError, RuntimeError) as e:  # torchx's validation: one line, not its traceback
        raise SchedulerError(f"torchx {scheduler} refused the app: {str(e).splitlines()[0]}") from None


__all__ = [
    "AgentRole",
    "INSTALL_HINT",
    "LOCAL_SCHEDULERS",
    "OWN_OPTIONS",
    "PACKAGE",
    "SHARED_FILESYSTEM",
    "ROLE",
    "dryrun",
    "import_torchx",
    "options_of",
    "run_config",
    "runopts_of",
    "torchx_schedulers",
]
