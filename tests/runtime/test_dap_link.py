"""The debugger's loopback ports admit this user's sockets only: tried by another user (`nobody`)."""

from __future__ import annotations

import os
import socket
import subprocess

import pytest

from monarch_cli.runtime.dap_link import DapFrames, accept_same_user, listen_loopback


def _as_nobody(code: str) -> subprocess.Popen:
    return subprocess.Popen(
        ["runuser", "-u", "nobody", "--", "/usr/bin/python3", "-c", code],
        cwd="/",
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


@pytest.mark.skipif(os.geteuid() != 0, reason="acting as another user (runuser -u nobody) needs root")
def test_only_this_users_sockets_are_accepted_and_an_orphaned_one_is_not_taken_for_root() -> None:
    listener = listen_loopback()
    port = listener.getsockname()[1]
    # Another user, connected and waiting for an answer: closed without a byte read or sent.
    other = _as_nobody(
        f"import socket; s = socket.create_connection(('127.0.0.1', {port})); s.sendall(b'x');"
        "s.settimeout(10); print(repr(s.recv(100)))"
    )
    conn, refused = accept_same_user(listener)
    assert conn is None and refused is not None and "uid 65534" in refused
    out, err = other.communicate(timeout=20)
    assert out.strip() == "b''" or "ConnectionResetError" in err
    # Another user that closes at once: its orphaned socket shows uid 0 in /proc, but no inode.
    subprocess.run(
        [
            "runuser",
            "-u",
            "nobody",
            "--",
            "/usr/bin/python3",
            "-c",
            f"import socket; s = socket.create_connection(('127.0.0.1', {port})); s.sendall(b'x'); s.close()",
        ],
        check=True,
        timeout=20,
        cwd="/",
    )
    conn, refused = accept_same_user(listener)
    assert conn is None and "unknown user" in (refused or "")
    # This user gets in.
    mine = socket.create_connection(("127.0.0.1", port))
    conn, refused = accept_same_user(listener)
    assert conn is not None and refused is None
    mine.sendall(b"hello")
    assert conn.recv(5) == b"hello"
    for s in (mine, conn, listener):
        s.close()


def test_dap_frames_are_whole_messages_and_garbage_is_refused() -> None:
    frames = DapFrames()
    one = b"Content-Length: 2\r\n\r\n{}"
    two = b'Content-Length: 7\r\n\r\n{"a":1}'
    stream = one + two
    got = []
    for i in range(len(stream)):  # a byte at a time: nothing torn comes out
        got += frames.feed(stream[i : i + 1])
    assert got == [one, two]
    with pytest.raises(ValueError, match="not a DAP stream"):
        DapFrames().feed(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
