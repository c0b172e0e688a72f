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
from typing import Any, Dict, Tuple

from .forwarding import pipe

# A forward refused once its agent has gone (ZeroMQ reconnecting) is expected, not news for the
# console: without this, logging's last-resort handler prints paramiko's "channel open FAILED".
logging.getLogger("paramiko").addHandler(logging.NullHandler())


class Forward:
    """Listens on 127.0.0.1 (a free port); each connection becomes a ``direct-tcpip`` channel to
    ``remote`` as the host sees it, over ``client`` (a connected ``paramiko.SSHClient``, kept open)."""

    def __init__(self, client: Any, remote: Tuple[str, int]) -> None:
        self.client = client
        self.remote = remote
        self._listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._listener.bind(("127.0.0.1", 0))
        self._listener.listen(16)
        self.port = self._listener.getsockname()[1]
        threading.Thread(target=self._accept, name=f"monarch-ssh-forward-{self.port}", daemon=True).start()

    @property
    def address(self) -> str:
        return f"tcp://127.0.0.1:{self.port}"

    def _accept(self) -> None:
        while True:
            try:
                conn, peer = self._listener.accept()
            except OSError:
                return
            try:
                channel = self.client.get_transport().open_channel("direct-tcpip", self.remote, peer)
            except Exception:  # noqa: BLE001 - the SSH connection is gone: refuse, the runtime reports the host
                conn.close()
                continue
            threading.Thread(target=pipe, args=(conn, channel), daemon=True).start()

    def close(self) -> None:
        self._listener.close()
        self.client.close()


_FORWARDS: Dict[Tuple[str, str], Forward] = {}
_LOCK = threading.Lock()


def forward(key: Tuple[str, str], connect: Any, remote: Tuple[str, int]) -> str:
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
