"""The agent's share of a client's links to hosts it is not connected to (runs in the agent).

A client of thousands of hosts keeps a connection to ~√N of them (the relays) and reaches
the rest through one (``protocol.links``): a run's requests, its heartbeats and credits go to
the relay wrapped, one message per relay per turn of the client's I/O thread, and the relay
sends each on, as it is, on its own connection to the host. The relay has one ROUTER for
them, a connection per host, shared by every client and kept from one command to the next
(as ``relay.py``'s are): a fresh command pays ~√N handshakes, here as in the client. The host
treats that connection as the client's link while the client's last message came on it:
it answers, streams the run's events and acks the beats there, naming the client, and reaps
the client if the beats stop (a dead relay stops them). What comes back is gathered per
client over one round of the agent's loop and sent as one message.

The relay decodes nothing it carries. It forwards only for a client that passed the
reservation's CURVE authentication, which could reach the hosts directly with the same keys.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import zmq

from .. import protocol
from ..transport import wire
from ..transport.sockets import RoutedSends

if TYPE_CHECKING:
    from .core import AgentCore


class ClientRoutes:
    """The host's side: how each client is answered. On its own link, unless its last message
    came on a relay's connection (``protocol.VIA_RELAY``): then there, with the client's address
    after the route so the relay knows whose it is (the message names the client).

    A relay's connection may not claim a client that reaches this host on its own link: every
    party holds the same keys, so otherwise any of them could name a client and have that
    client's answers and run events rerouted through itself (docs/runtime.md, "Security")."""

    def __init__(self) -> None:
        self._relayed: dict[str, bytes] = {}
        self._direct: set[str] = set()

    def note(self, route: bytes, msg: Any) -> bool:
        """A message ``msg`` came on ``route``: answer its client that way from now on. False
        when a relay's connection named a client that has its own link (the message is refused)."""
        client = getattr(msg, "reply_to", None) or getattr(msg, "client", None)
        if protocol.is_relay_route(route):
            if isinstance(client, str):
                if client in self._direct:
                    return False
                self._relayed[client] = route
            return True
        own = route.decode(errors="replace")
        if client == own and own not in self._direct and len(self._direct) < _MAX_DIRECT:
            self._direct.add(own)  # a client's own link: its name is its routing id
        if self._relayed:
            self._relayed.pop(own, None)
        return True

    def to(self, address: str) -> list[bytes]:
        """The routing frames that reach client ``address``."""
        relay = self._relayed.get(address) if self._relayed else None
        return [address.encode()] if relay is None else [relay, address.encode()]

    def back(self, route: bytes, client: str) -> list[bytes]:
        """The routing frames that answer ``client`` on the connection ``route`` (a heartbeat's ack)."""
        return [route, client.encode()] if protocol.is_relay_route(route) else [route]

    def forget(self, address: str) -> None:
        self._relayed.pop(address, None)
        self._direct.discard(address)


#: Links remembered as a client's own (each a few dozen bytes; forgotten with the client).
_MAX_DIRECT = 65536
#: Hosts this agent keeps a connection to for its clients.
MAX_TARGETS = 4096
#: Messages read from the hosts per round of the loop (the rest of the loop gets its turn).
_READ_BATCH = 1024


class LinkForwarder:
    def __init__(self, agent: AgentCore, watch: Callable[[Any], None], unwatch: Callable[[Any], None]) -> None:
        self.agent = agent
        self._watch = watch
        self._unwatch = unwatch
        self.socks: list[Any] = []  # the one ROUTER, once made (a list: the agent's loop polls them)
        self._targets: set[bytes] = set()
        self._unsent = RoutedSends()  # by host: what waits for its connection to come up
        self._held: dict[bytes, list[tuple[str, list[Any]]]] = {}  # by client: to send at the round's end

    def forward(self, route: bytes, frames: list[Any]) -> None:
        """``frames`` = ``[FORWARD, index, *frames]`` from the client whose routing id is ``route``."""
        try:
            messages = list(protocol.unforward(frames[1:]))
        except Exception as e:  # noqa: BLE001 - a malformed envelope: nothing in it is passed on
            print(f"monarch agent: bad forward: {type(e).__name__}: {e}", file=sys.stderr, flush=True)
            return
        for target, message in messages:
            self._forward_one(target, message)

    def _socket(self) -> Any:
        if not self.socks:
            sock = self.agent.transport.link_router(self.agent.address.encode() + protocol.VIA_RELAY)
            self.socks.append(sock)
            self._watch(sock)
        return self.socks[0]

    def _forward_one(self, address: str, message: list[Any]) -> None:
        sock = self._socket()
        target = address.encode()
        if target not in self._targets:
            if not address.startswith(("tcp://", "ipc://")) or len(self._targets) >= MAX_TARGETS:
                self._refuse(address, message)
                return
            sock.connect_rid = target
            sock.connect(address)
            self._targets.add(target)
        self._unsent.send(sock, target, message)

    def _refuse(self, target: str, message: list[Any]) -> None:
        """A request for a target this agent will not reach is answered, as the target would
        fail it, so its caller does not wait out its timeout."""
        try:
            answer = protocol.answer_to(wire.parse(message)[0])
        except Exception:  # noqa: BLE001 - not a message we can answer
            answer = None
        if answer is not None:
            self.agent.reply(
                answer[1], answer[0], False, f"the relay {self.agent.address} does not forward to {target!r}"
            )

    def readable(self, sock: Any) -> None:
        """``[host, client, *message]`` from the hosts: held for the client until the round's end."""
        read = 0
        held = self._held
        while read < _READ_BATCH and sock.getsockopt(zmq.EVENTS) & zmq.POLLIN:
            frames = wire.recv_frames(sock)
            read += 1
            if len(frames) < 3:
                continue
            client = frames[1].bytes
            entry = (frames[0].bytes.decode(errors="replace"), frames[2:])
            mine = held.get(client)
            if mine is None:
                held[client] = [entry]
            else:
                mine.append(entry)

    def flush(self) -> None:
        """Send each client what its hosts sent this round, one message each; retry what waits
        for a connection."""
        if self._unsent:
            self._unsent.retry(self.socks[0])
        if self._held:
            held, self._held = self._held, {}
            for client, messages in held.items():
                try:
                    self.agent.send_frames(client.decode(errors="replace"), protocol.forwarded_frames(messages))
                except zmq.ZMQError:  # the client is gone: its hosts reap it when its beats stop
                    pass

    def next_due(self) -> float | None:
        """Soon, while messages wait for connections to come up."""
        return time.monotonic() + 0.005 if self._unsent else None

    def client_gone(self, address: str) -> None:
        """The client said it exits, or was reaped: nothing more is held for it."""
        self._held.pop(address.encode(), None)

    def close(self) -> None:
        for sock in self.socks:
            self._unwatch(sock)
            sock.close(linger=0)
        self.socks.clear()
