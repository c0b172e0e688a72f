"""The protocol module is the one definition of every message: the docs name each kind, and
an agent asked something it does not know says so instead of leaving the caller to time out."""

from __future__ import annotations

import re
import time
from pathlib import Path

import pytest

from monarch_cli.runtime import protocol
from monarch_cli.runtime.errors import ActorError
from monarch_cli.runtime.mailbox.mailbox import Mailbox

DOC = Path(__file__).resolve().parents[2] / "docs" / "architecture.md"


def _messages_table() -> str:
    text = DOC.read_text()
    section = text[text.index("## Messages") :]
    section = section[: section.index("\n## ", 1)]
    return "\n".join(line for line in section.splitlines() if line.startswith("| ") and ("→" in line or "↔" in line))


def test_the_architecture_doc_names_every_message_kind() -> None:
    named = set(re.findall(r"`([a-z_]+)`", _messages_table()))
    missing = (set(protocol.MESSAGES) | set(protocol.DEBUGGER_CHANNEL)) - named
    assert not missing, f"docs/architecture.md's Messages table does not name {sorted(missing)}"


def test_a_message_travels_as_a_plain_tuple_and_is_read_back_by_name() -> None:
    exit_ = protocol.RankExited("run-1", 3, None, 9, 1.5, 1234, "")
    head = protocol.header(exit_)
    assert type(head) is tuple and head[0] == "rank_exit"
    back = protocol.decode(head)
    assert back == exit_ and back.signal == 9 and back.rank == 3
    with pytest.raises(KeyError):
        protocol.decode(("no_such_kind", 1, "addr"))
    with pytest.raises(TypeError):  # a known kind with other fields: an older or newer sender
        protocol.decode(("rank_exit", "run-1", 3))
    assert protocol.answer_to(("no_such_kind", 7, "tcp://x:1")) == (7, "tcp://x:1")
    assert protocol.answer_to(protocol.header(protocol.OutputCredit("run-1", 10))) is None


@pytest.mark.slow
def test_an_agent_answers_an_unknown_request_with_a_clear_error(agents: list) -> None:
    """A newer client's request reaches an older agent: the caller gets an error naming the kind."""

    class FromTheFuture(tuple):  # a kind this agent has never heard of, sent as a newer client would
        KIND = "rebalance_shards"

    agent = agents[0]
    mb = Mailbox.get()
    mb.link(agent)
    fut = mb.request(agent, lambda cid: FromTheFuture((cid, mb.address, "x")))
    with pytest.raises(ActorError, match="does not understand 'rebalance_shards'"):
        fut.get(timeout=10)
    ping = mb.request(agent, lambda cid: protocol.Ping(cid, mb.address)).get(timeout=10)
    assert ping["pid"] > 0  # and it goes on serving


def test_a_batch_reaches_a_threaded_subscription_in_order_and_a_failing_handler_stops_nothing() -> None:
    """An agent's batch (a run's outputs and exits of one round) is handed to the run's own thread
    at once, in the order sent; an inline handler that raises does not stop the other events."""
    import queue
    import threading

    mb = Mailbox.get()
    got: queue.Queue[tuple] = queue.Queue()
    threads: set[str] = set()

    def on_output(e: protocol.Output, body: list) -> None:
        threads.add(threading.current_thread().name)
        got.put(("out", e.rank, bytes(body[0])))

    def on_exit(e: protocol.RankExited, _body: list) -> None:
        got.put(("exit", e.rank))

    def broken(e: protocol.Output, _body: list) -> None:
        raise RuntimeError("a handler's bug")

    run = mb.subscribe("run-b1", {protocol.Output: on_output, protocol.RankExited: on_exit}, thread="test-events")
    other = mb.subscribe("run-b2", {protocol.Output: broken})
    try:
        events = [
            protocol.Output("run-b1", 0, 1),
            protocol.Output("run-b2", 5, 1),
            protocol.Output("run-b1", 1, 1),
            protocol.RankExited("run-b1", 0, 0, None, 0.1, 11, ""),
            protocol.Output("run-b1", 1, 2),
            protocol.RankExited("run-b1", 1, 0, None, 0.1, 12, ""),
        ]
        bodies = [b"zero\n", b"theirs\n", b"one\n", None, b"err\n", None]
        batch = protocol.Batch([protocol.header(e) for e in events], [-1 if b is None else len(b) for b in bodies])
        mb.send(mb.address, batch, [b"".join(b for b in bodies if b is not None)])
        seen = [got.get(timeout=5) for _ in range(5)]
        assert seen == [("out", 0, b"zero\n"), ("out", 1, b"one\n"), ("exit", 0), ("out", 1, b"err\n"), ("exit", 1)]
        assert threads == {"test-events"}
    finally:
        run.close()
        other.close()


def test_events_reach_the_subscription_of_their_run_and_no_other() -> None:
    """Sent through the mailbox's own socket: a run's events go to its subscription; a
    debugger's (every run) gets the rest; an event nobody wants is dropped and counted."""
    import queue

    mb = Mailbox.get()
    got: queue.Queue[tuple] = queue.Queue()
    mine = mb.subscribe("run-a", {protocol.Output: lambda e, body: got.put(("a", e.rank, bytes(body[0])))})
    with mb.subscribe(None, {protocol.DebugState: lambda e, _: got.put(("any", e.run_id, e.state))}):
        dropped = mb.events.dropped.get("output", 0)
        mb.send(mb.address, protocol.Output("run-b", 1, 1), [b"not yours"])
        mb.send(mb.address, protocol.Output("run-a", 0, 1), [b"yours"])
        mb.send(mb.address, protocol.DebugState("run-c", 2, "paused", {}))
        assert got.get(timeout=5) == ("a", 0, b"yours")
        assert got.get(timeout=5) == ("any", "run-c", "paused")
        assert mb.events.dropped.get("output", 0) == dropped + 1
    mine.close()
    mb.send(mb.address, protocol.Output("run-a", 0, 1), [b"after the run ended"])
    mb.send(mb.address, protocol.DebugState("run-c", 2, "running", ""))
    time.sleep(0.3)
    assert got.empty()
