"""What the backends' loopback forwards share (ssh ``--tunnel``, Kubernetes port-forwards): a
loopback listener whose connections each get a thread, and the byte pump between a local
connection and the stream that carries it to a host."""

from __future__ import annotations

import os
import socket
import threading
from collections.abc import Callable
from typing import Any

from ..runtime.dap_link import peer_uid
from ..sysutil import ready_fds

CHUNK = 1 << 16


def pipe(conn: socket.socket, other: Any, end_other: Callable[[Any], None] | None = None) -> None:
    """Copy bytes both ways between ``conn`` and ``other`` (a paramiko channel, a port-forward
    stream: anything with ``recv``/``sendall``/``fileno``) until either side ends, then close
    both; ``end_other`` ends ``other`` its own way (default: ``close()``)."""
    try:
        while True:
            readable, _ = ready_fds([conn, other])
            if conn in readable:
                data = conn.recv(CHUNK)
                if not data:
                    break
                other.sendall(data)
            if other in readable:
                data = other.recv(CHUNK)
                if not data:
                    break
                conn.sendall(data)
    except OSError:
        pass
    finally:
        conn.close()
        (end_other or _close)(other)


def _close(stream: Any) -> None:
    stream.close()


class LoopbackListener:
    """Listens on 127.0.0.1 (a free port) for as long as this process lives or until closed; each
    connection from this user is handed to :meth:`serve_connection` on a thread of its own.

    Any local user can connect to a loopback port: a connection whose peer is another user (or
    cannot be told) is closed before a byte is read or a thread is started, as the debugger's
    listeners do (``runtime.dap_link.peer_uid``)."""

    def __init__(self, name: str) -> None:
        self._listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._listener.bind(("127.0.0.1", 0))
        self._listener.listen(16)
        self.address = f"tcp://127.0.0.1:{self._listener.getsockname()[1]}"
        threading.Thread(target=self._accept, name=name, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                conn, peer = self._listener.accept()
            except OSError:  # closed
                return
            if peer_uid(conn) != os.getuid():
                conn.close()
                continue
            threading.Thread(target=self.serve_connection, args=(conn, peer), daemon=True).start()

    def serve_connection(self, conn: socket.socket, peer: Any) -> None:
        raise NotImplementedError

    def close(self) -> None:
        self._listener.close()
