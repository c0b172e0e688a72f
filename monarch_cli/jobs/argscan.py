"""The options before a command, read one way for ``monarch run-spmd``'s own flags (:mod:`monarch_cli.cli.fast`)
and for torchrun's (:mod:`.torchrun`): ``--name``, ``--name=value``, ``--name value``, ``-xvalue``; the options end
at ``--`` (dropped) or at the first word that is not one, where the command begins. What each flag means and which
errors to give stay with the caller. Imports nothing heavy: the CLI's fast path uses it before anything else loads.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import NamedTuple


class Option(NamedTuple):
    """One option as typed."""

    token: str  # the whole word ("--nproc-per-node=2", "-eX=1")
    flag: str  # the option itself ("--nproc-per-node", "-e")
    value: str | None  # what was attached to it ("2", "X=1"; "" for "--name="), None when nothing was


class OptionScanner:
    """Iterate to get each option in turn; :meth:`take_value` reads an option's value from the next word, and
    :attr:`rest` is what follows the options. ``short_equals``: ``-x=1`` gives ``1`` (argparse, torchrun) rather
    than ``=1`` (click, Typer)."""

    def __init__(self, args: list[str], *, short_equals: bool = False) -> None:
        self.args = args
        self.pos = 0
        self.short_equals = short_equals
        #: The options ended at ``--`` (so the command may start with anything, even ``-``).
        self.dashes = False

    def __iter__(self) -> Iterator[Option]:
        while self.pos < len(self.args):
            token = self.args[self.pos]
            if token == "--":
                self.pos += 1
                self.dashes = True
                return
            if not token.startswith("-") or token == "-":
                return
            self.pos += 1
            yield self.split(token)

    def split(self, token: str) -> Option:
        if token.startswith("--"):
            flag, eq, value = token.partition("=")
            return Option(token, flag, value if eq else None)
        attached = token[2:]
        if self.short_equals and attached.startswith("="):
            attached = attached[1:]
        return Option(token, token[:2], attached or None)

    def take_value(self) -> str | None:
        """The next word, as the value of the option just read; None when there is none."""
        if self.pos >= len(self.args):
            return None
        self.pos += 1
        return self.args[self.pos - 1]

    @property
    def rest(self) -> list[str]:
        """The words after the options: the command."""
        return self.args[self.pos :]


__all__ = ["Option", "OptionScanner"]
