"""The local backend: ``scheduler`` (host agents as child processes of this machine; no SDK, no forwarding)."""

from .scheduler import LocalScheduler

__all__ = ["LocalScheduler"]
