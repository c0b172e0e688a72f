"""Every error monarch raises on purpose, in one tree, importable from any layer.

``MonarchError`` is the root: the CLI prints any of them as one line (or as
``{"error": ..., "kind": ...}`` with ``--json``). Anything else escaping our own code is a
bug and is reported as an internal error, with its traceback kept in a file.
"""

from __future__ import annotations

__all__ = ["MonarchError", "UserError", "JobError", "SchedulerError", "OptionError", "PlanError", "StoreError"]


class MonarchError(Exception):
    """Base of every error monarch raises on purpose (runtime, jobs, schedulers)."""

    #: What the CLI reports as the error's kind in ``--json`` output.
    kind = "error"


class UserError(MonarchError):
    """A user-correctable problem; ``str()`` is a single actionable line."""

    kind = "user"

    def __init__(self, message: str) -> None:
        # Collapse any embedded newlines/indentation so the CLI always prints one line.
        self.message = " ".join(str(message).split())
        super().__init__(self.message)

    def __str__(self) -> str:
        return self.message


class JobError(UserError):
    """A problem with a job or its reservation that the user can correct."""

    kind = "job"


class SchedulerError(UserError):
    """A scheduler backend refused or failed (its own words, on one line)."""

    kind = "scheduler"


class OptionError(UserError, ValueError):
    """A backend option is unknown or has a bad value (also a ValueError, as it always was)."""

    kind = "option"


class PlanError(UserError):
    """A reservation plan is malformed or does not match the backend that should carry it out."""

    kind = "plan"


class StoreError(UserError):
    """A query the telemetry store refuses or cannot answer (``monarch sql``, ``Job.sql``)."""

    kind = "store"
