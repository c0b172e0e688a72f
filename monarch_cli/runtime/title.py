"""Readable process titles (``monarch rank 3: train.py``) for ``ps``, ``top`` and ``htop``.

setproctitle rewrites the process's argv area (what ``/proc/PID/cmdline`` shows) portably;
ctypes ``prctl(PR_SET_NAME)`` alone would only change the 15-character ``comm``.
"""

from __future__ import annotations

import shlex


def set_title(title: str) -> None:
    """``title`` for ``ps``; the 15-character ``comm`` gets a name without spaces.

    Tools that parse ``/proc/PID/stat`` naively (Slurm's proctrack/linuxproc among them) lose
    track of a process whose ``comm`` has spaces: Slurm then never kills it and drains the node
    ("Kill task failed"). So ``comm`` is ``monarch-agent``, ``monarch-rank``, ``monarch-warm``...
    """
    try:
        from setproctitle import setproctitle, setthreadtitle
    except ImportError:  # a host without the dependency keeps its plain command line
        return
    setproctitle(title)
    setthreadtitle(comm_name(title))  # the main thread's name is the process's comm


def comm_name(title: str) -> str:
    return "-".join(title.replace(":", "").split()[:2])[:15]


def rank_title(rank: int, mode: str, program: list[str]) -> str:
    """``monarch rank 3: train.py --lr 1`` (``-m pkg.mod`` for a module)."""
    words = list(program)
    if mode == "script" and words:
        words[0] = words[0].rsplit("/", 1)[-1]
    elif mode == "module":
        words = ["-m", *words]
    return f"monarch rank {rank}: {shlex.join(words)}"
