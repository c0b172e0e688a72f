"""Messages: out-of-band buffers, big tensors, ordering and loss under load."""

from __future__ import annotations

import os
import threading

import numpy as np
import pytest

from monarch_cli import Actor, endpoint, this_host
from monarch_cli.runtime.transport import wire


class Store(Actor):
    def __init__(self) -> None:
        self.items: dict = {}
        self.log: list = []

    @endpoint
    def echo(self, x):
        return x

    @endpoint
    def append(self, sender: int, seq: int) -> None:
        self.log.append((sender, seq))

    @endpoint
    def log_of(self) -> list:
        return self.log

    @endpoint
    def checksum(self, t) -> float:
        return float(t.sum())

    @endpoint
    def bump(self, a):
        a += 1  # received arrays are writable, in place
        return a


@pytest.fixture(scope="module")
def store():
    procs = this_host().spawn_procs(per_host={"gpus": 1})
    yield procs.spawn("store", Store)
    procs.stop().get()


def test_large_buffers_leave_the_pickle_out_of_band():
    a = np.arange(1_000_000, dtype=np.float32)
    blob = np.frombuffer(b"x" * 100_000, dtype=np.uint8)
    frames = wire.dumps({"a": a, "blob": blob, "small": np.arange(3)})
    assert len(frames) == 4 and len(frames[0]) < 1000  # the pickle holds only the structure
    assert isinstance(frames[1], memoryview) and frames[1].nbytes == a.nbytes  # not copied
    assert frames[1].obj is a.data.obj if hasattr(frames[1], "obj") else True
    assert isinstance(frames[3], bytearray)  # tiny buffers are copied: cheaper than a zero-copy frame
    out = wire.loads(frames)
    assert np.array_equal(out["a"], a) and out["a"].flags.writeable
    assert out["blob"].tobytes() == b"x" * 100_000


def test_torch_tensors_keep_dtype_shape_and_grad():
    torch = pytest.importorskip("torch")
    t = torch.randn(64, 32).to(torch.bfloat16)
    p = torch.nn.Parameter(torch.ones(3))
    out = wire.loads(wire.dumps((t, p, t[:, 1])))
    assert out[0].dtype == torch.bfloat16 and torch.equal(out[0], t)
    assert isinstance(out[1], torch.nn.Parameter) and out[1].requires_grad
    assert torch.equal(out[2], t[:, 1])


def test_torch_tensors_leave_the_pickle_out_of_band_without_a_copy():
    torch = pytest.importorskip("torch")
    t = torch.arange(1_000_000, dtype=torch.float32)
    frames = wire.dumps(t)
    assert len(frames) == 2 and len(frames[0]) < 1000 and frames[1].nbytes == t.numel() * 4
    sent = np.frombuffer(frames[1], dtype=np.float32)
    assert sent.__array_interface__["data"][0] == t.data_ptr()  # the tensor's own memory
    assert torch.equal(wire.loads(frames), t)


def test_big_bytes_and_bytearray_leave_the_pickle_without_a_copy():
    blob, buf = b"x" * (2 << 20), bytearray(b"y" * (2 << 20))
    frames = wire.dumps({"blob": blob, "buf": buf, "small": b"tiny"})
    assert len(frames) == 3 and len(frames[0]) < 1000  # the pickle holds only the structure
    assert frames[1].obj is blob and frames[2].obj is buf  # the objects' own memory
    out = wire.loads(frames)
    assert type(out["blob"]) is bytes and out["blob"] == blob
    assert type(out["buf"]) is bytearray and out["buf"] == buf and out["small"] == b"tiny"


def test_big_bytes_round_trip_through_an_actor(store):
    blob = os.urandom(3 << 20)
    back = store.echo.call_one([blob, bytearray(blob[:8192])]).get(timeout=30)
    assert type(back[0]) is bytes and back[0] == blob and back[1] == bytearray(blob[:8192])


def test_arrays_round_trip_through_an_actor_writable(store):
    a = np.arange(10, dtype=np.int64)
    assert np.array_equal(store.bump.call_one(a).get(timeout=10), a + 1)


@pytest.mark.slow
def test_one_gib_tensor_round_trips(store):
    torch = pytest.importorskip("torch")
    t = torch.ones(2**28, dtype=torch.float32)  # 1 GiB
    t[123] = 5.0
    back = store.echo.call_one(t).get(timeout=120)
    assert back.shape == t.shape and back.dtype == t.dtype
    assert float(back[123]) == 5.0 and torch.equal(back, t)
    del back


def test_order_is_kept_per_sender_and_nothing_is_lost_under_load(store):
    senders, per_sender = 4, 2000

    def send(sender: int) -> None:
        futs = [store.append.call_one(sender, seq) for seq in range(per_sender)]
        for f in futs:
            f.get(timeout=60)

    threads = [threading.Thread(target=send, args=(i,), daemon=True) for i in range(senders)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    log = store.log_of.call_one().get(timeout=30)
    assert len(log) == senders * per_sender
    for sender in range(senders):
        assert [seq for s, seq in log if s == sender] == list(range(per_sender))


@pytest.mark.parametrize(
    "body, frames",
    [
        (None, 1),  # header only
        ({"loss": 0.5, "name": "x" * 48}, 1),  # the usual call: packed into one frame
        (b"x" * 200_000, 2),  # too big to pack: header frame + body frame
        (np.arange(100_000, dtype=np.float32), 3),  # an out-of-band buffer travels as its own frame
    ],
)
def test_messages_are_one_frame_when_small_and_round_trip_either_way(body, frames):
    import zmq

    ctx = zmq.Context()
    a, b = ctx.socket(zmq.PAIR), ctx.socket(zmq.PAIR)
    try:
        a.bind("inproc://wire-test")
        b.connect("inproc://wire-test")
        header = ("result", 7, True)
        wire.send_message(a, header, () if body is None else wire.dumps(body))
        got = b.recv_multipart(copy=False)
        assert len(got) == frames
        got_header, got_body = wire.parse(got)
        assert got_header == header
        if body is None:
            assert got_body == []
        elif isinstance(body, np.ndarray):
            assert np.array_equal(wire.loads(got_body), body)
        else:
            assert wire.loads(got_body) == body
    finally:
        a.close(linger=0)
        b.close(linger=0)
        ctx.term()
