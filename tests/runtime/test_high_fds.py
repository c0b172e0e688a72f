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
