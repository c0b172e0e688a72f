"""Processes with more than 1024 fds open: an agent holding a few hundred ranks' pipes starts its
next fork server with the socket numbered above 1024, where ``select`` refuses to look at it."""

from __future__ import annotations

import os
import resource
import socket
from collections.abc import Iterator

import pytest

from monarch_cli.runtime.agent.forkserver import ForkServerHandle
from monarch_cli.sysutil import ready_fds

from ..conftest import run_python


@pytest.fixture
def fds_above_1024() -> Iterator[None]:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and hard < 2048:
        pytest.fail(f"this test needs a hard fd limit of 2048 or more (have {hard})")
    resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, 2048), hard))
    null = os.open(os.devnull, os.O_RDONLY)
    held = [os.dup(null) for _ in range(1100)]
    try:
        yield
    finally:
        for fd in [null, *held]:
            os.close(fd)
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


def test_a_fork_server_whose_socket_is_numbered_above_1024_serves(fds_above_1024: None) -> None:
    zygote = ForkServerHandle()
    try:
        assert zygote.sock.fileno() > 1024  # (the zygote gets its end with the same high number)
        zygote.sock.close()  # the agent is gone: a serving zygote sees EOF and exits 0
        assert zygote.process.wait(timeout=120) == 0, "the fork server crashed instead of serving"
    finally:
        if zygote.process.poll() is None:
            zygote.process.kill()


def test_ready_fds_sees_sockets_numbered_above_1024(fds_above_1024: None) -> None:
    a, b = socket.socketpair()
    with a, b:
        assert a.fileno() > 1024
        assert ready_fds([a], [a], timeout=0) == ([], [a])
        b.sendall(b"x")
        assert ready_fds([a, b], timeout=30) == ([a], [])
        b.close()
        assert ready_fds([a], timeout=30)[0] == [a]  # a closed peer reads as ready (EOF)


def test_an_agent_started_under_a_low_soft_fd_limit_takes_the_hard_one() -> None:
    """Hundreds of ranks on one host hold a few of the agent's fds each, and a relay holds a
    connection per host it forwards to: an agent started where the soft limit is 1,024 (a
    login shell's usual) raises it to the hard limit before it serves."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and hard < 2048:
        pytest.fail(f"this test needs a hard fd limit of 2048 or more (have {hard})")
    done = run_python(
        """
        import resource
        from monarch_cli.runtime.launch.start import launch_agent
        from monarch_cli.runtime.transport.keys import Keys
        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        resource.setrlimit(resource.RLIMIT_NOFILE, (1024, hard))  # what the agent inherits
        proc, _ = launch_agent(Keys.generate(), name="fds")
        try:
            limits = open(f"/proc/{proc.pid}/limits").read().splitlines()
            expected = 1 << 20 if hard == resource.RLIM_INFINITY else hard  # (an unlimited one is taken as 2**20)
            print(next(l for l in limits if l.startswith("Max open files")).split()[3:5], expected)
        finally:
            proc.stdin.close()
            proc.wait(30)
        """
    )
    assert done.returncode == 0, done.stderr
    limit = done.stdout.split()[-1]  # the hard limit there (2**20 for an unlimited one)
    assert done.stdout.strip() == f"['{limit}', '{limit}'] {limit}", done.stdout  # soft raised to it
