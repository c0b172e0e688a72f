"""A backend's options (data on its :class:`~monarch_cli.schedulers.Scheduler`) as flags of ``monarch serve``
and ``monarch stop``.

The generic commands know no backend: before parsing, :class:`BackendOptionsCommand`
looks up ``--scheduler`` in the arguments and adds that backend's options as flags (all
backends' in ``--help`` when none is named). ``stop`` learns the backend only from the state
file, after parsing: :class:`BackendStopOptionsCommand` adds every backend's stop options, and
the reservation's backend refuses those it does not declare. Their values reach the command
through :func:`backend_options`, merged with ``-o key=value``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import typer.core

from .click_compat import click

_PREFIX = "backend_opt__"
DEFAULT_SCHEDULER = "local"


def _named_scheduler(args: Sequence[str]) -> str | None:
    """The ``--scheduler``/``-s`` value among ``args`` (before ``--``), if any."""
    for i, word in enumerate(args):
        if word == "--":
            return None
        for flag in ("--scheduler", "-s"):
            if word == flag and i + 1 < len(args):
                return args[i + 1]
            if word.startswith(flag + "=") or (flag == "-s" and word.startswith("-s") and len(word) > 2):
                return word.split("=", 1)[1] if "=" in word else word[2:]
    return None


def _option_params(names: Sequence[str], taken: Sequence[str], kind: str = "options") -> list[click.Parameter]:
    from ..schedulers import scheduler_class

    params: list[click.Parameter] = []
    seen = set(taken)
    for name in names:
        try:
            cls = scheduler_class(name)
        except Exception:  # noqa: BLE001 - an unknown or broken backend: serve itself reports it
            continue
        panel = (
            f"{cls.name} options (or -o name=value)"
            if kind == "options"
            else f"{cls.name} reservations (or -o name=value)"
        )
        for opt in getattr(cls, kind):
            decls = [f for f in (opt.cli_flag, opt.short) if f and f not in seen]
            if opt.cli_flag in seen:
                continue
            seen.update(decls)
            kwargs: dict[str, Any] = {"help": opt.help, "rich_help_panel": panel}
            if opt.type is bool:
                kwargs.update(is_flag=True, default=False)
            elif opt.type is list:
                kwargs.update(multiple=True, type=click.types.STRING, default=(), metavar="<str>")
            else:
                kwargs.update(
                    type=click.types.INT if opt.type is int else click.types.STRING,
                    default=None,
                    metavar="<int>" if opt.type is int else "<str>",
                )
            params.append(
                typer.core.TyperOption(
                    param_decls=[*decls, _PREFIX + opt.name], expose_value=False, callback=_keep, **kwargs
                )
            )
    return params


def _keep(ctx: click.Context, param: click.Parameter, value: Any) -> Any:
    """Keep a backend option's value aside: the command's function has no parameter for it."""
    ctx.meta.setdefault(_PREFIX, {})[str(param.name)[len(_PREFIX) :]] = value
    return value


class BackendOptionsCommand(typer.core.TyperCommand):
    """``monarch serve``: the named backend's options become flags, and help lists them."""

    def parse_args(self, ctx: click.Context, args: list[str]) -> list[str]:
        base = [p for p in self.params if not (p.name or "").startswith(_PREFIX)]
        named = _named_scheduler(args)
        if named is not None:
            names = [named]
        elif any(a in ("-h", "--help") for a in args[: args.index("--") if "--" in args else len(args)]):
            from ..schedulers import available

            names = available()
        else:
            names = [DEFAULT_SCHEDULER]
        taken = [d for p in base for d in getattr(p, "opts", []) + getattr(p, "secondary_opts", [])]
        self.params = base + _option_params(names, taken)
        return super().parse_args(ctx, args)


class BackendStopOptionsCommand(typer.core.TyperCommand):
    """``monarch stop``: every backend's stop options are flags (the reservation's backend is known only later)."""

    def parse_args(self, ctx: click.Context, args: list[str]) -> list[str]:
        from ..schedulers import available

        base = [p for p in self.params if not (p.name or "").startswith(_PREFIX)]
        taken = [d for p in base for d in getattr(p, "opts", []) + getattr(p, "secondary_opts", [])]
        flags = {a.split("=", 1)[0] for a in args if a.startswith("-")}
        # Every backend's module is imported only when a flag is not stop's own (--help included).
        self.params = base + (_option_params(available(), taken, "stop_options") if flags - set(taken) else [])
        return super().parse_args(ctx, args)


def backend_options(
    ctx: click.Context, scheduler: str, pairs: Sequence[str] | None, kind: str = "options"
) -> dict[str, Any]:
    """The backend options (``kind``: ``options`` of serve or ``stop_options``) given as flags, then
    ``-o key=value`` (which wins; lists collect both)."""
    from ..schedulers import parse_option_pairs, scheduler_class

    values: dict[str, Any] = {}
    for key, value in ctx.meta.get(_PREFIX, {}).items():
        if value not in (None, False, ()):
            values[key] = list(value) if isinstance(value, tuple) else value
    if pairs:
        for key, value in parse_option_pairs(pairs, getattr(scheduler_class(scheduler), kind), scheduler).items():
            values[key] = [*values.get(key, []), *value] if isinstance(value, list) else value
    return values


__all__ = ["BackendOptionsCommand", "BackendStopOptionsCommand", "backend_options"]
