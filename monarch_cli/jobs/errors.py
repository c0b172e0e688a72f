"""Errors a user can cause while describing or managing a job.

The CLI prints ``str(error)`` as-is, so every message is one line that says what is
wrong and what to do about it; tracebacks are for bugs, not for user mistakes.
"""

from __future__ import annotations

__all__ = ["JobError"]


class JobError(Exception):
    """A user-correctable problem; ``str()`` is a single actionable line."""

    def __init__(self, message: str) -> None:
        # Collapse any embedded newlines/indentation so the CLI always prints one line.
        self.message = " ".join(str(message).split())
        super().__init__(self.message)

    def __str__(self) -> str:
        return self.message
