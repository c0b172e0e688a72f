"""An agent's batched events (runtime/agent/batches.py), encoded as they travel and read back
as the client's mailbox reads them: same events, same order, same bytes, nothing held past a flush."""

from __future__ import annotations

from typing import Any

import zmq

from monarch_cli.runtime import protocol
from monarch_cli.runtime.agent.batches import BATCH_BYTES, EventBatches
from monarch_cli.runtime.transport import wire


def _received(sent: list[tuple[str, list[Any]]]) -> list[tuple[str, tuple[Any, ...], list[bytes]]]:
    """What a client handles, message by message: batches unpacked, as ``Mailbox._handle_message`` does."""
    out = []
    for address, frames in sent:
        head, body = wire.parse([zmq.Frame(f) for f in frames])
        if head[0] == "batch":
            for h, b in protocol.unbatch(protocol.decode(head), body):
                out.append((address, h, [bytes(x) for x in b]))
        else:
            out.append((address, head, [bytes(x) for x in body]))
    return out


def test_one_round_of_many_ranks_is_one_message_per_client_in_order() -> None:
    sent: list[tuple[str, list[Any]]] = []
    batches = EventBatches(lambda address, frames: sent.append((address, frames)))
    expected = []
    for rank in range(8):
        for i in range(3):
            data = f"rank {rank} line {i}\n".encode()
            assert batches.add("client-a", protocol.Output("r1", rank, 1), [data])
            expected.append(("client-a", ("output", "r1", rank, 1), [data]))
        assert batches.add("client-a", protocol.RankExited("r1", rank, 0, None, 0.5, 100 + rank, ""))
        expected.append(("client-a", ("rank_exit", "r1", rank, 0, None, 0.5, 100 + rank, ""), []))
    assert batches.add("client-b", protocol.Output("r2", 0, 2), [b"other client\n"])
    assert not sent, "held until the round ends"
    batches.flush_all()
    assert [a for a, _ in sent] == ["client-a", "client-b"]  # one message per client
    got = _received(sent)
    assert got[:-1] == expected
    assert got[-1] == ("client-b", ("output", "r2", 0, 2), [b"other client\n"])  # a lone event goes as itself
    assert wire.parse([zmq.Frame(f) for f in sent[1][1]])[0][0] == "output"


def test_other_messages_send_what_is_held_first_and_a_big_batch_goes_early() -> None:
    sent: list[tuple[str, list[Any]]] = []
    batches = EventBatches(lambda address, frames: sent.append((address, frames)))
    batches.add("c", protocol.Output("r", 0, 1), [b"before the pause\n"])
    assert not batches.add("c", protocol.RankPaused("r", 0, "h", {}))  # not batched: the caller flushes and sends
    assert "c" in batches
    batches.flush("c")
    assert "c" not in batches and len(sent) == 1
    chunk = b"x" * (BATCH_BYTES // 4)
    for rank in range(4):  # the fourth chunk reaches the cap: sent without waiting for the round's end
        batches.add("c", protocol.Output("r", rank, 1), [chunk])
    assert len(sent) == 2
    got = _received(sent[1:])
    assert [(h[2], b) for _, h, b in got] == [(rank, [chunk]) for rank in range(4)]
