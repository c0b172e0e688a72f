"""The backends' loopback forwards (ssh --tunnel, Kubernetes and SkyPilot port-forwards) carry
the reservation's agents to this client: another local user connecting to the loopback port is
closed on before anything is read or forwarded, and before a thread is started for it."""

from __future__ import annotations

import os
import socket
import subprocess
import threading
from typing import Any

import pytest

from monarch_cli.schedulers.forwarding import LoopbackListener

OTHER = "nobody"

CONNECT = """
import socket, sys
s = socket.create_connection(("127.0.0.1", int(sys.argv[1])), timeout=10)
s.sendall(b"hello from another user")
s.settimeout(10)
try:
    print("got", s.recv(100))
except OSError as e:
    print("error", type(e).__name__)
"""


class _Echo(LoopbackListener):
    def __init__(self) -> None:
        self.served: list[Any] = []
        self.seen = threading.Event()
        super().__init__("test-forward")

    def serve_connection(self, conn: socket.socket, peer: Any) -> None:
        self.served.append(peer)
        self.seen.set()
        conn.sendall(b"echo:" + conn.recv(100))
        conn.close()


@pytest.mark.skipif(os.geteuid() != 0, reason="acting as another user (runuser -u nobody) needs root")
def test_a_loopback_forward_serves_its_user_and_closes_on_another() -> None:
    listener = _Echo()
    port = int(listener.address.rsplit(":", 1)[1])
    try:
        other = subprocess.run(
            ["runuser", "-u", OTHER, "--", "/usr/bin/python3", "-c", CONNECT, str(port)],
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert other.stdout.strip() in ("got b''", "error ConnectionResetError"), other
        assert listener.served == []  # nothing served, no thread started for it
        with socket.create_connection(("127.0.0.1", port), timeout=10) as mine:
            mine.sendall(b"hi")
            assert mine.recv(100) == b"echo:hi"
        assert listener.seen.wait(10) and len(listener.served) == 1
    finally:
        listener.close()
