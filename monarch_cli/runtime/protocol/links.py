"""A link carried by a relay agent: the envelope around a client's messages to a host it has
no connection to, and around that host's messages back (docs/architecture.md, "At scale").

A client of thousands of hosts connects to ~√N of them (the relays) and reaches each other
host through one: what it would have sent on that host's link goes to the relay wrapped in
:data:`FORWARD`, and the relay sends the inner frames, as they are, on its connection to that host
(:data:`VIA_RELAY`); the host answers the client back on it, naming the client. What the hosts send back on those connections the relay gathers per
client for one round of its loop and sends as one :data:`FORWARDED` message. Neither side
decodes what it carries: the envelopes are raw frames, like :data:`HEARTBEAT_ACK`, and no
message's first frame is this short (a message starts with its header's 4-byte length and a
pickle).
"""

from __future__ import annotations

import pickle
from collections.abc import Iterator, Sequence
from typing import Any

from ..transport.plain import loads_plain

__all__ = ["FORWARD", "FORWARDED", "VIA_RELAY", "forward_frames", "forwarded_frames", "unforward", "is_relay_route"]

#: First frame of ``[FORWARD, index, *frames]``, client → relay: ``index`` pickles
#: ``[(target address, number of frames), ...]`` for the messages that follow, in order.
FORWARD = b"fwd"
#: First frame of ``[FORWARDED, index, *frames]``, relay → client: the same, by source.
FORWARDED = b"fwded"


#: Ends the routing id of a relay's connections to the hosts it forwards to (its own address,
#: then this): one connection per host, shared by every client it forwards for and kept from
#: one command to the next. A host answers a client whose last message came on such a
#: connection on it, with the client's address as the first frame after the route, so the
#: relay knows whose it is; its ROUTER keeps the client's direct link as a route of its own.
VIA_RELAY = b" via relay"


def is_relay_route(route: bytes) -> bool:
    """Whether a message came on a relay's connection (the client is named in the message)."""
    return route.endswith(VIA_RELAY)


def forward_frames(messages: Sequence[tuple[str, Sequence[Any]]]) -> list[Any]:
    """What a client sends its relay: every ``(target, frames)`` it has for the relay's hosts
    this turn of its I/O thread, in one message (a run's start to 4,096 hosts is 64 messages)."""
    return _envelope(FORWARD, messages)


def forwarded_frames(messages: Sequence[tuple[str, Sequence[Any]]]) -> list[Any]:
    """What a relay sends its client: every ``(source, frames)`` it gathered, in one message."""
    return _envelope(FORWARDED, messages)


def _envelope(kind: bytes, messages: Sequence[tuple[str, Sequence[Any]]]) -> list[Any]:
    out: list[Any] = [kind, pickle.dumps([(address, len(frames)) for address, frames in messages], 5)]
    for _, frames in messages:
        out.extend(frames)
    return out


def unforward(frames: Sequence[Any]) -> Iterator[tuple[str, list[Any]]]:
    """``(address, frames)`` of each message in a :data:`FORWARD` or :data:`FORWARDED` message's
    frames after its first (a bad index raises: the whole envelope is refused)."""
    at = 1
    for address, count in loads_plain(frames[0]):  # a relay's index: plain data, whoever reads it
        yield str(address), list(frames[at : at + count])
        at += count
