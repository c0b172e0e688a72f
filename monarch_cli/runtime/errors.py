"""Exceptions a caller of the runtime sees."""

from __future__ import annotations

import dataclasses
from typing import Any

from ..errors import MonarchError


class ActorError(MonarchError):
    """An endpoint raised. ``remote_traceback`` is the traceback in the actor's process."""

    def __init__(self, message: str, remote_traceback: str = "", exception: BaseException | None = None):
        super().__init__(message)
        self.remote_traceback = remote_traceback
        self.exception = exception

    def __str__(self) -> str:
        base = super().__str__()
        if self.remote_traceback:
            return f"{base}\n\nRemote traceback:\n{self.remote_traceback.rstrip()}"
        return base


def remote_error(value: Any) -> ActorError:
    """The :class:`ActorError` for an endpoint's ``(message, traceback, exception)`` answer. The
    exception is kept only when it arrived as one (a client withholds classes it cannot accept)."""
    try:
        message, tb, exc = value
    except (TypeError, ValueError):
        return ActorError(f"a malformed error answer: {type(value).__name__}")
    exc = exc if isinstance(exc, BaseException) else None
    return ActorError(str(message), tb if isinstance(tb, str) else "", exc)


@dataclasses.dataclass(frozen=True)
class Failure:
    """What died and how: handed to ``__supervise__`` and carried by :class:`SupervisionError`."""

    proc: str
    host: str
    pid: int | None
    exitcode: int | None = None
    signal: int | None = None
    reason: str = ""
    mesh: str | None = None

    def describe(self) -> str:
        if self.signal is not None:
            from .exit_status import signal_name

            name = signal_name(self.signal)
            how = f"killed by signal {self.signal}" + (f" ({name})" if name.startswith("SIG") else "")
        elif self.exitcode is not None:
            how = f"exited with code {self.exitcode}"
        else:
            how = self.reason or "was lost"
        where = f"proc {self.proc} (pid {self.pid}) on host {self.host}"
        if self.reason and (self.signal is not None or self.exitcode is not None):
            how = f"{how}: {self.reason}"
        return f"{where} {how}"


class SupervisionError(ActorError):
    """The proc hosting an actor died or became unreachable."""

    def __init__(self, failure: Failure, actor: str | None = None):
        self.failure = failure
        self.actor = actor
        who = f"actor {actor!r}: " if actor else ""
        super().__init__(f"{who}{failure.describe()}")


class RelayLost(ActorError):
    """A request went through a relay (another host's agent, for a client of many hosts) that
    stopped answering before it was answered; ``relay`` is that agent's address."""

    def __init__(self, relay: str):
        self.relay = relay
        super().__init__(f"the relay agent {relay} that carried this request stopped answering")


class CallTimeout(MonarchError, TimeoutError):
    """A future was not resolved within the requested timeout."""
