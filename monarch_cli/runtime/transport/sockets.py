"""ZeroMQ sockets with CURVE authentication for every TCP (and IPC) endpoint.

Every process of a reservation holds one CURVE key pair (:class:`~.keys.Keys`). Servers
(ROUTER sockets) accept a connection only when a ZAP check proves the client holds that
same pair, so a process without the keys cannot deliver a single frame, let alone a
pickle. The ZAP check runs in a thread the caller already has (``serve_zap``), so it costs
no extra thread per process.
"""

from __future__ import annotations

import collections
import os
import tempfile
from typing import Any

import zmq
from zmq.utils import z85

from ...config import advertised_host, bind_port_candidates, listen_host, settings
from .keys import Keys

_ZAP_ENDPOINT = "inproc://zeromq.zap.01"
_SNDMORE = int(zmq.SNDMORE)
_DOMAIN = b"monarch"


def send_routed(sock: zmq.Socket, route: bytes, frames: list[Any]) -> None:
    """``send_multipart([route, *frames], copy=False)`` on a ROUTER, with plain-int flags (its enum
    ``|`` per frame was ~5 % of a 1,024-host run's I/O thread). An unroutable peer (a link not up
    yet, with ``router_mandatory``) raises EHOSTUNREACH on the routing frame, before anything is
    queued: the caller keeps the message and sends it again later."""
    sock.send(route, _SNDMORE)
    last = len(frames) - 1
    for i, frame in enumerate(frames):
        sock.send(frame, _SNDMORE if i < last else 0, copy=False)


def try_send_routed(sock: zmq.Socket, route: bytes, frames: list[Any]) -> bool:
    """:func:`send_routed`; False where the peer's connection is not up yet (nothing was sent)."""
    try:
        send_routed(sock, route, frames)
    except zmq.ZMQError as e:
        if e.errno != zmq.EHOSTUNREACH:
            raise
        return False
    return True


class RoutedSends:
    """Sends on a ROUTER (``router_mandatory``) to peers it connects to itself, keeping what a
    peer whose connection is not up yet cannot take, in order per peer, until :meth:`retry`
    gets it through: ZeroMQ's ROUTER drops or refuses a message for a peer it has not met, it
    does not queue it. The client's links and a relay's forwarding both send this way."""

    __slots__ = ("_unsent",)

    def __init__(self) -> None:
        self._unsent: dict[bytes, collections.deque[list[Any]]] = {}

    def __bool__(self) -> bool:
        """Something waits for a connection (the caller looks again soon)."""
        return bool(self._unsent)

    def send(self, sock: zmq.Socket, route: bytes, frames: list[Any]) -> None:
        queued = self._unsent.get(route)
        if queued is not None:  # behind what waits already: the order is kept
            queued.append(frames)
        elif not try_send_routed(sock, route, frames):
            self._unsent[route] = collections.deque([frames])

    def retry(self, sock: zmq.Socket) -> None:
        """Send what waits for connections that have come up since."""
        for route, queued in list(self._unsent.items()):
            while queued and try_send_routed(sock, route, queued[0]):
                queued.popleft()
            if not queued:
                del self._unsent[route]


class Transport:
    """Socket factory bound to one ZeroMQ context and one set of reservation keys."""

    def __init__(self, keys: Keys, zap: bool = True, link_thread: bool = False, max_sockets: int | None = None) -> None:
        """``max_sockets``: more than ZeroMQ's 1,023 per context (an agent relaying for thousands
        of hosts); it takes effect only before the context's first socket, so it is set here."""
        raise_fd_limit()
        self.keys = keys
        self.ctx = zmq.Context(io_threads=2 if link_thread else 1)
        if max_sockets is not None:
            self.ctx.set(zmq.MAX_SOCKETS, max_sockets)
        self._link_thread = link_thread
        if link_thread:
            # The links (to agents, heartbeats included) get a ZeroMQ I/O thread of their own and
            # every other socket the first: libzmq encrypts a message whole, in its I/O thread, so a
            # 1 GiB transfer to a proc would otherwise hold the heartbeats up for seconds.
            self.ctx.setsockopt(zmq.AFFINITY, 1)
        self._client_key = z85.decode(keys.public)
        # The ZAP handler must exist before any server socket binds, or libzmq lets
        # CURVE clients in without asking. A client-only context needs none.
        self.zap: zmq.Socket | None = None
        if zap:
            self.zap = self.ctx.socket(zmq.REP)
            self.zap.linger = 0
            self.zap.bind(_ZAP_ENDPOINT)

    def serve_zap(self) -> None:
        """Answer one pending ZAP request (call when ``self.zap`` is readable)."""
        assert self.zap is not None
        import hmac  # here: a client that only connects never loads it (and hashlib, ~4 ms per command)

        msg = self.zap.recv_multipart()
        version, request_id, _domain, _address, _identity, mechanism = msg[:6]
        creds = msg[6:]
        ok = mechanism == b"CURVE" and len(creds) == 1 and hmac.compare_digest(creds[0], self._client_key)
        status = (b"200", b"OK") if ok else (b"400", b"unknown key")
        self.zap.send_multipart([version, request_id, *status, b"", b""])

    def bind_router(self, port: int | None = None) -> tuple[zmq.Socket, str]:
        """A CURVE ROUTER on ``port``, else on a port of ``settings().port_range``, else any free one."""
        if self.zap is None:
            raise RuntimeError("a client-only transport cannot bind a server socket")
        sock = self.ctx.socket(zmq.ROUTER)
        sock.linger = 0
        sock.rcvhwm = 0
        sock.sndhwm = 0
        sock.curve_server = True
        sock.curve_secretkey = self.keys.secret
        sock.curve_publickey = self.keys.public
        sock.zap_domain = _DOMAIN
        if settings().transport == "ipc":
            import uuid  # the ipc transport only: a tcp client (every run-spmd) does without it

            sock.bind(f"ipc://{_ipc_dir()}/{uuid.uuid4().hex[:16]}")
            return sock, sock.get_string(zmq.LAST_ENDPOINT)
        host = listen_host()
        candidates = [port] if port is not None else bind_port_candidates()
        for i, candidate in enumerate(candidates):
            try:
                sock.bind(f"tcp://{host}:{candidate or '*'}")
                break
            except zmq.ZMQError as e:
                if e.errno != zmq.EADDRINUSE or i == len(candidates) - 1:
                    sock.close(0)
                    raise OSError(e.errno, f"cannot listen on {host}:{candidate or '*'}: {e}") from None
        endpoint = sock.get_string(zmq.LAST_ENDPOINT)
        if host != advertised_host():  # listening on a wildcard ($MONARCH_LISTEN_HOST): peers use the advertised one
            endpoint = f"tcp://{advertised_host()}:{endpoint.rpartition(':')[2]}"
        return sock, endpoint

    def dealer(self, address: str, identity: bytes | None = None) -> zmq.Socket:
        """A CURVE DEALER to ``address``; ``identity`` names it to the server's ROUTER (a link: see mailbox)."""
        sock = self.ctx.socket(zmq.DEALER)
        if identity is not None:
            sock.routing_id = identity
        sock.linger = 2000  # flush what is queued when the socket closes
        sock.sndhwm = 0
        sock.rcvhwm = 0
        sock.curve_serverkey = self.keys.public
        sock.curve_publickey = self.keys.public
        sock.curve_secretkey = self.keys.secret
        sock.connect(address)
        return sock

    def link_router(self, identity: bytes) -> zmq.Socket:
        """A CURVE-client ROUTER named ``identity`` that connects to many servers, one connection
        each, addressed by the routing id given with ``connect_rid`` before each ``connect``; a
        send to a peer not connected (yet) raises EHOSTUNREACH instead of being dropped."""
        sock = self.ctx.socket(zmq.ROUTER)
        if self._link_thread:
            sock.affinity = 2  # (the second I/O thread: see __init__)
        sock.routing_id = identity
        sock.router_mandatory = True
        sock.linger = 2000
        sock.sndhwm = 0
        sock.rcvhwm = 0
        sock.curve_serverkey = self.keys.public
        sock.curve_publickey = self.keys.public
        sock.curve_secretkey = self.keys.secret
        return sock

    def close(self) -> None:
        self.ctx.destroy(linger=0)


_fd_limit_raised = False


def raise_fd_limit() -> None:
    """Raise this process's open-file soft limit to its hard limit, once, as servers do: a client
    of 4,096 hosts holds a TCP connection per host, and a run a log file per rank besides; an
    agent holds a few fds per rank (pipes, the debug channel) and a relay's connections. The
    usual soft limit is 1,024. An unlimited hard limit is taken as 2**20 (the kernel refuses an
    unlimited soft one for open files)."""
    global _fd_limit_raised
    if _fd_limit_raised:
        return
    _fd_limit_raised = True
    try:
        import resource

        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        if hard == resource.RLIM_INFINITY:
            hard = 1 << 20
        if soft != resource.RLIM_INFINITY and soft < hard:
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    except (ImportError, ValueError, OSError):  # not permitted, or no such limit here: keep the soft one
        pass


def _ipc_dir() -> str:
    base = os.environ.get("XDG_RUNTIME_DIR") or tempfile.gettempdir()
    path = os.path.join(base, f"monarch-{os.getuid()}")
    os.makedirs(path, mode=0o700, exist_ok=True)
    os.chmod(path, 0o700)
    return path
