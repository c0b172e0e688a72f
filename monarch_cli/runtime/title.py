"""Readable process titles (``monarch rank 3: train.py``) for ``ps``, ``top`` and ``htop``.

setproctitle rewrites the process's argv area (what ``/proc/PID/cmdline`` shows) portably;
ctypes ``prctl(PR_SET_NAME)`` alone would only change the 15-character ``comm``.
"""

from __future__ import annotations

import shlex
from typing import List


def set_title(title: str) -> None:
    try:
        from setproctitle import setproctitle
    except ImportError:  # a host without the dependency keeps its plain command line
        return
    setproctitle(title)


def rank_title(rank: int, mode: str, program: List[str]) -> str:
    """``monarch rank 3: train.py --lr 1`` (``-m pkg.mod`` for a module)."""
    words = list(program)
    if mode == "script" and words:
        words[0] = words[0].rsplit("/", 1)[-1]
    elif mode == "module":
        words = ["-m", *words]
    return f"monarch rank {rank}: {shlex.join(words)}"
