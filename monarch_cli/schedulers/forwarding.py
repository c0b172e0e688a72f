"""What the backends' loopback forwards share (ssh ``--tunnel``, Kubernetes port-forwards): the
byte pump between a local connection and the stream that carries it to a host."""

from __future__ import annotations

import select
import socket
from typing import Any, Callable, Optional

CHUNK = 1 << 16


def pipe(conn: socket.socket, other: Any, end_other: Optional[Callable[[Any], None]] = None) -> None:
    """Copy bytes both ways between ``conn`` and ``other`` (a paramiko channel, a port-forward
    stream: anything with ``recv``/``sendall``/``fileno``) until either side ends, then close
    both; ``end_other`` ends ``other`` its own way (default: ``close()``)."""
    try:
        while True:
            readable, _, _ = select.select([conn, other], [], [])
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
