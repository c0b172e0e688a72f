"""Code flows only from the client: a key holder (a host, a relay, a rank, a proc) cannot make
the client run code, only hand it plain data (docs/runtime.md, "Security").

The attackers here hold the reservation's keys, as a hostile rank or host would: a real proc
returns or raises a pickle that runs a command when loaded, and a real CURVE socket with the
keys sends the client a forged message. Each leaves a marker file if the client ran it.
"""

from __future__ import annotations

import dataclasses
import datetime
import enum
import os
import pickle
from pathlib import Path

import numpy as np
import pytest
import torch
import zmq

from monarch_cli import Actor, ActorError, HostMesh, endpoint
from monarch_cli.runtime import protocol
from monarch_cli.runtime.errors import Failure
from monarch_cli.runtime.mailbox.mailbox import Mailbox
from monarch_cli.runtime.transport import wire

from ..conftest import wait_until
from .test_security import _Evil


class _EvilError(Exception):
    def __reduce__(self):
        return (os.system, (f"touch {self.args[0]}",))


@dataclasses.dataclass
class Metrics:
    step: int
    loss: float


class Phase(enum.Enum):
    TRAIN = "train"


class Hostile(Actor):
    @endpoint
    def evil_value(self, path: str) -> object:
        return {"ok": [1, 2], "payload": _Evil(path)}

    @endpoint
    def evil_error(self, path: str) -> None:
        raise _EvilError(path)

    @endpoint
    def values(self) -> dict:
        return {
            "metrics": Metrics(3, 0.5),
            "phase": Phase.TRAIN,
            "array": np.arange(6, dtype=np.float32).reshape(2, 3),
            "tensor": torch.ones(3, dtype=torch.bfloat16),
            "when": datetime.timedelta(seconds=2),
            "path": Path("/data/x"),
            "failure": Failure(proc="p", host="h", pid=1, exitcode=3),
            "bytes": b"x" * 10_000,
        }

    @endpoint
    def plain_error(self) -> None:
        raise ValueError("bad shape")


@pytest.fixture(scope="module")
def hostile(agents):
    procs = HostMesh.connect(agents[:1]).spawn_procs(per_host={"n": 1})
    yield procs.spawn("hostile", Hostile)
    procs.stop().get(timeout=30)


def test_a_proc_returning_a_pickle_that_runs_code_is_refused_at_the_client(tmp_path, hostile):
    marker = tmp_path / "pwned"
    with pytest.raises(ActorError, match="posix.system is not plain data"):
        hostile.evil_value.call_one(str(marker)).get(timeout=30)
    assert not marker.exists(), "a proc's answer ran code in the client"
    # The client goes on: the next answer arrives, and plain values come back whole.
    got = hostile.values.call_one().get(timeout=30)
    assert got["metrics"] == Metrics(3, 0.5) and got["phase"] is Phase.TRAIN
    assert np.array_equal(got["array"], np.arange(6, dtype=np.float32).reshape(2, 3))
    assert got["tensor"].dtype == torch.bfloat16 and got["tensor"].tolist() == [1.0, 1.0, 1.0]
    assert got["when"] == datetime.timedelta(seconds=2) and got["path"] == Path("/data/x")
    assert got["failure"].exitcode == 3 and got["bytes"] == b"x" * 10_000


def test_an_error_whose_exception_runs_code_keeps_its_message_and_runs_nothing(tmp_path, hostile):
    marker = tmp_path / "pwned"
    with pytest.raises(ActorError) as info:
        hostile.evil_error.call_one(str(marker)).get(timeout=30)
    assert not marker.exists(), "a proc's exception ran code in the client"
    assert "_EvilError" in str(info.value) and "evil_error" in info.value.remote_traceback
    assert info.value.exception is None  # withheld, not rebuilt
    with pytest.raises(ActorError) as plain:
        hostile.plain_error.call_one().get(timeout=30)
    assert isinstance(plain.value.exception, ValueError) and str(plain.value.exception) == "bad shape"


def test_a_forged_message_from_a_key_holder_runs_nothing_on_the_client(tmp_path, hostile):
    """A hostile host dials the client's own inbox with the reservation's keys."""
    marker = tmp_path / "pwned"
    mb = Mailbox.get()
    before = mb.events.dropped.get("not plain data", 0)
    ctx = zmq.Context()
    try:
        sock = ctx.socket(zmq.DEALER)
        sock.linger = 0
        sock.curve_serverkey = mb.keys.public
        sock.curve_publickey = mb.keys.public
        sock.curve_secretkey = mb.keys.secret
        sock.connect(mb.address)
        forged_header = pickle.dumps(_Evil(str(marker)))
        wire.send_message(sock, ("result", 10**9, True), [pickle.dumps(_Evil(str(marker)))])
        sock.send_multipart([forged_header, b"x"])
        assert wait_until(lambda: mb.events.dropped.get("not plain data", 0) > before, timeout=30)
    finally:
        ctx.destroy(linger=0)
    assert not marker.exists(), "a forged message ran code in the client"
    assert hostile.values.call_one().get(timeout=30)["metrics"].step == 3


def test_a_key_holder_posing_as_a_relay_cannot_reroute_a_linked_clients_answers(agents):
    """Before: any message on a ``... via relay`` connection naming a client made the agent
    answer that client through the sender from then on, so the client's calls went unanswered
    and their answers went to the attacker."""
    agent = agents[1]
    mb = Mailbox.get()
    mb.link(agent)

    def ping() -> dict:
        return mb.request(agent, lambda cid: protocol.Ping(cid, mb.address)).get(timeout=20)

    assert ping()["host"] == "host1"
    ctx = zmq.Context()
    try:
        sock = ctx.socket(zmq.DEALER)
        sock.linger = 0
        sock.routing_id = b"tcp://10.0.0.9:1" + protocol.VIA_RELAY
        sock.curve_serverkey = mb.keys.public
        sock.curve_publickey = mb.keys.public
        sock.curve_secretkey = mb.keys.secret
        sock.connect(agent)
        wire.send_message(sock, protocol.header(protocol.Ping(7, mb.address)))  # claims the victim
        wire.send_message(sock, protocol.header(protocol.Ping(8, "attacker")))  # its own: answered
        assert sock.poll(30_000), "the agent never answered the relay's own question"
        route, *frames = wire.recv_frames(sock)
        assert route.bytes == b"attacker" and protocol.decode(wire.parse(frames)[0]).cid == 8
        # The first message was handled before the second: the victim's answers still reach it.
        assert ping()["host"] == "host1"
        assert not sock.poll(0), "the victim's answer went to the attacker"
    finally:
        ctx.destroy(linger=0)
