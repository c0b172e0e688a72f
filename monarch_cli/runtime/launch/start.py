"""Starting host agents on this machine, with the keys on their stdin (never argv).

Schedulers use :func:`launch_agent`; a controller's ``this_host()`` uses
:func:`start_private_agent`, whose agent lives exactly as long as the controller.
"""

from __future__ import annotations

import dataclasses
import os
import subprocess
import time
from typing import Any

from ...sysutil import ready_fds
from ..transport.keys import Keys
from .command import READY_PREFIX, AgentCommand

_private: list[subprocess.Popen] = []


def launch_agent(
    keys: Keys,
    *,
    name: str | None = None,
    preload: str | None = None,
    warm_up: bool = False,
    reservation: str = "",
    state_file: str | None = None,
    command: AgentCommand | None = None,
    exit_with_parent: bool = True,
    detach: bool = False,
    env: dict[str, str] | None = None,
    stdout: Any = None,
    timeout: float = 30.0,
) -> tuple[subprocess.Popen, str]:
    """Start a host agent on this machine and return it with its address once it listens.

    The keys go through the agent's stdin, never its command line. With
    ``exit_with_parent`` the agent (and every proc it runs) exits when this process does;
    ``detach`` puts it in its own session so it outlives the terminal that started it.
    ``reservation`` names it in ``ps``; with ``state_file`` it registers itself and exits
    once that file no longer records the reservation. ``command`` (a backend's plan)
    replaces ``name``/``preload``/``warm_up``/``reservation``/``state_file``.
    """
    r, w = os.pipe()
    base = command or AgentCommand(
        name=name, preload=preload, warm_up=warm_up, reservation=reservation, state_file=state_file
    )
    cmd = dataclasses.replace(base, ready_fd=w, keys_stdin=True, exit_with_stdin=exit_with_parent).argv()
    proc = subprocess.Popen(
        cmd,
        stdin=subprocess.PIPE,
        stdout=stdout,
        stderr=stdout,
        pass_fds=[w],
        env=env,
        start_new_session=detach,
    )
    os.close(w)
    assert proc.stdin is not None
    proc.stdin.write(keys.encode().encode() + b"\n")
    proc.stdin.flush()
    if not exit_with_parent:
        proc.stdin.close()
    try:
        return proc, _read_ready(r, proc, timeout)
    finally:
        os.close(r)


def start_private_agent(keys: Keys, timeout: float = 30.0) -> str:
    """Start an agent that lives exactly as long as this process (its stdin is our pipe)."""
    proc, address = launch_agent(keys, timeout=timeout)
    _private.append(proc)
    return address


def _read_ready(fd: int, proc: subprocess.Popen, timeout: float) -> str:
    deadline = time.monotonic() + timeout
    buf = b""
    while b"\n" not in buf:
        left = deadline - time.monotonic()
        if left <= 0:
            proc.kill()
            raise TimeoutError(f"host agent did not start within {timeout} s")
        ready, _ = ready_fds([fd], timeout=left)
        if ready:
            chunk = os.read(fd, 4096)
            if not chunk:
                code = proc.wait()
                raise RuntimeError(f"host agent exited during start-up with code {code}")
            buf += chunk
    return buf.split(b"\n", 1)[0].decode().removeprefix(READY_PREFIX).strip()
