"""``kubectl port-forward`` in this process: a loopback port per pod, relayed to the agent's port
in the pod over the Kubernetes API, for a client outside the cluster (pod IPs unreachable).

Each connection accepted on a loopback port opens one port-forward websocket
(``pods/<name>/portforward``, ``v4.channel.k8s.io``, through the ``kubernetes`` client) and
relays bytes both ways. An agent answers on the connection a client opened, so its one port
is all a client needs; rank-to-rank traffic stays in the cluster. The kubelet connects to the
port on the pod's localhost, which is why the pods' agents also listen there
(``MONARCH_LISTEN_HOST``). The loopback port carries only CURVE traffic that the agent checks,
so another local user who connects gets no further than without it. Forwards live as long as
this process: each command opens its own (listeners at once, a websocket per connection).
"""

from __future__ import annotations

import socket
import threading
import time
from typing import Any

from ..forwarding import CHUNK, LoopbackListener, pipe

#: After a forward could not be opened (the pod is gone, no RBAC), refuse for a while without
#: asking the API server again: ZeroMQ reconnects every 100 ms.
RETRY_AFTER = 1.0
#: How long a stream may take to end once this side is done with it.
_END_TIMEOUT = 5.0


def open_stream(core: Any, namespace: str, pod: str, port: int) -> tuple[Any, Any]:
    """A connected socket to ``port`` on the pod's localhost, and the client's ``PortForward`` (for its error)."""
    from kubernetes import client
    from kubernetes.stream import portforward

    # portforward() swaps the ApiClient's call_api while it connects: an ApiClient of its own
    # keeps REST calls of other threads off the websocket path.
    own = client.CoreV1Api(client.ApiClient(core.api_client.configuration))
    forwarded = portforward(own.connect_get_namespaced_pod_portforward, pod, namespace, ports=str(port))
    return forwarded.socket(port), forwarded


def agent_answers(core: Any, namespace: str, pod: str, port: int, timeout: float = 2.0) -> tuple[bool, str]:
    """Whether something listens on ``port`` in the pod and speaks first (an agent sends its ZeroMQ
    greeting as soon as it accepts); else why not (the kubelet's error, or the API server's)."""
    try:
        sock, forwarded = open_stream(core, namespace, pod, port)
    except Exception as e:  # noqa: BLE001 - ApiException (status 0: the websocket handshake), connection errors
        return False, " ".join(str(getattr(e, "reason", None) or e).split())[:300]
    try:
        sock.settimeout(timeout)
        first = sock.recv(1)
    except OSError:
        first = b""
    end_stream(sock)
    return bool(first), (forwarded.error(port) or "").strip() if not first else ""


def end_stream(stream: Any) -> None:
    """End a port-forward stream as its proxy thread expects: half-close, read to its end, close
    (closing with unread data would reset the client's socket pair, and its thread would die with a traceback)."""
    try:
        stream.shutdown(socket.SHUT_WR)
        stream.settimeout(_END_TIMEOUT)
        while stream.recv(CHUNK):
            pass
    except OSError:
        pass
    finally:
        stream.close()


class PodForward(LoopbackListener):
    """A loopback port whose each connection becomes a port-forward to ``port`` of ``pod``."""

    def __init__(self, core: Any, namespace: str, pod: str, port: int) -> None:
        self.core, self.namespace, self.pod, self.port = core, namespace, pod, port
        self._refused_until = 0.0
        super().__init__(f"monarch-k8s-forward-{pod}")

    def serve_connection(self, conn: socket.socket, _peer: Any) -> None:
        if time.monotonic() < self._refused_until:
            conn.close()
            return
        try:
            remote, _ = open_stream(self.core, self.namespace, self.pod, self.port)
        except Exception:  # noqa: BLE001 - the pod is gone or forwarding is refused: the runtime reports the host
            self._refused_until = time.monotonic() + RETRY_AFTER
            conn.close()
            return
        pipe(conn, remote, end_stream)


_FORWARDS: dict[tuple[str, str], PodForward] = {}
_LOCK = threading.Lock()


def forward(core: Any, namespace: str, pod: str, port: int) -> str:
    """The loopback address of this process that forwards to ``port`` of ``pod`` (made once per process)."""
    key = (namespace, pod)
    with _LOCK:
        fwd: PodForward | None = _FORWARDS.get(key)
        if fwd is None or fwd.port != port:
            fwd = _FORWARDS[key] = PodForward(core, namespace, pod, port)
        return fwd.address


__all__ = ["PodForward", "forward", "agent_answers", "open_stream", "end_stream"]
