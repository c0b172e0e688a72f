"""``ssh -L`` in this process: a loopback port whose connections go over an SSH connection to a host.

The ssh backend's ``--tunnel`` reaches each agent's one port this way, so a client that the hosts
cannot route to, and that cannot reach the agents' ports itself, still drives the reservation:
the agent answers on the connection the client opened. The loopback port carries only CURVE
traffic (the agent accepts nobody without the reservation's keys), so another local user who
connects to it gets no further than without it. Forwards live as long as this process.
"""

from __future__ import annotations

import logging
import socket
import threading
from typing import Any

from ..forwarding import LoopbackListener, pipe

# A forward refused once its agent has gone (ZeroMQ reconnecting) is expected, not news for the
# console: without this, logging's last-resort handler prints paramiko's "channel open FAILED".
logging.getLogger("paramiko").addHandler(logging.NullHandler())


class Forward(LoopbackListener):
    """A loopback port whose each connection becomes a ``direct-tcpip`` channel to ``remote`` as
    the host sees it, over ``client`` (a connected ``paramiko.SSHClient``, kept open)."""

    def __init__(self, client: Any, remote: tuple[str, int]) -> None:
        self.client = client
        self.remote = remote
        super().__init__(f"monarch-ssh-forward-{remote[0]}:{remote[1]}")

    def serve_connection(self, conn: socket.socket, peer: Any) -> None:
        try:
            channel = self.client.get_transport().open_channel("direct-tcpip", self.remote, peer)
        except Exception:  # noqa: BLE001 - the SSH connection is gone: refuse, the runtime reports the host
            conn.close()
            return
        pipe(conn, channel)

    def close(self) -> None:
        super().close()
        self.client.close()


_FORWARDS: dict[tuple[str, str], Forward] = {}
_LOCK = threading.Lock()


def forward(key: tuple[str, str], connect: Any, remote: tuple[str, int]) -> str:
    """The loopback address forwarding to ``remote`` for ``key`` (made once per process, with
    ``connect()`` giving the SSH client); a forward whose SSH connection dropped is made again."""
    with _LOCK:
        fwd = _FORWARDS.get(key)
        transport = fwd.client.get_transport() if fwd is not None else None
        if fwd is None or transport is None or not transport.is_active():
            if fwd is not None:
                fwd.close()
            fwd = _FORWARDS[key] = Forward(connect(), remote)
        return fwd.address


__all__ = ["Forward", "forward"]
