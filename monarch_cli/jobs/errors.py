"""Errors a user can cause while describing or managing a job (defined in :mod:`monarch_cli.errors`)."""

from __future__ import annotations

from ..errors import JobError

__all__ = ["JobError"]
