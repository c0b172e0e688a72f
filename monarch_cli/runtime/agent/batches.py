"""An agent's events to each client, gathered over one round of its loop and sent as one message.

At thousands of hosts the client's cost was one ZeroMQ message per rank event (a receive, a
CURVE decryption, a parse, a route: 65,536 for one trivial run of 4,096 hosts x 8 ranks). The
agent now holds a run's events (:data:`~..protocol.BATCHED` kinds: output, exits, telemetry)
per client until the end of the round, then sends them as one :class:`~..protocol.Batch`; a
lone event goes as itself, as before, so nothing waits longer than the round it was made in.

Order is kept per client: any other message to that client sends what is held first. Output
credit is unchanged: the agent counts bytes as it reads them, whether they travel alone or
in a batch, and the client credits each event as it prints it. The emulated cluster
(``tests/emulated_cluster.py``) batches with this class too.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from .. import protocol
from ..transport import wire

#: Body bytes held for one client before the batch goes out without waiting for the round's end.
BATCH_BYTES = 1 << 20

_BATCHED = protocol.BATCHED


class EventBatches:
    """Per client, the events held this round; ``send_frames(address, frames)`` sends one message."""

    def __init__(self, send_frames: Callable[[str, list[Any]], None]) -> None:
        self._send_frames = send_frames
        self._held: dict[str, list[tuple[tuple[Any, ...], Any]]] = {}  # address -> [(header, body | None)]
        self._bytes: dict[str, int] = {}

    def add(self, address: str, msg: Any, body: Sequence[Any] = ()) -> bool:
        """Hold ``msg`` for ``address`` until :meth:`flush`; False if it is not a kind that batches
        (the caller sends it, after :meth:`flush` of ``address``)."""
        if msg.KIND not in _BATCHED or len(body) > 1:
            return False
        held = self._held.get(address)
        if held is None:
            held = self._held[address] = []
            self._bytes[address] = 0
        data = body[0] if body else None
        held.append(((msg.KIND, *msg), data))
        if data is not None:
            self._bytes[address] += len(data)
            if self._bytes[address] >= BATCH_BYTES:
                self.flush(address)
        return True

    def flush(self, address: str) -> None:
        """Send what is held for ``address``: one event as itself, several as one batch."""
        held = self._held.pop(address, None)
        if not held:
            return
        del self._bytes[address]
        if len(held) == 1:
            head, data = held[0]
            self._send_frames(address, wire.frames(head, [] if data is None else [data]))
            return
        heads = [h for h, _ in held]
        sizes = [-1 if d is None else len(d) for _, d in held]
        joined = b"".join(d for _, d in held if d is not None)
        self._send_frames(
            address, wire.frames(protocol.header(protocol.Batch(heads, sizes)), [joined] if joined else [])
        )

    def flush_all(self) -> None:
        """The end of a round: send everything held, client by client."""
        for address in list(self._held):
            self.flush(address)

    def __contains__(self, address: str) -> bool:
        return address in self._held
