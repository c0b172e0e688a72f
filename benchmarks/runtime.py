"""Runtime benchmark: one table, with the raw-pyzmq floor measured in the same run.

    python benchmarks/runtime.py [--quick]

The floor is two Python processes, DEALER -> ROUTER over TCP, echoing a ~100-byte pickled
message (no encryption, no actor layer): the least any Python RPC over ZeroMQ can cost here.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import pickle
import platform
import statistics
import sys
import time

import psutil
import zmq
from _common import print_table, timed

from monarch_cli import Actor, HostMesh, endpoint, this_host
from monarch_cli.runtime.mailbox.mailbox import Mailbox

PAYLOAD = {"step": 1, "loss": 0.125, "name": "x" * 48}


def _echo_server(port_q: mp.Queue[int]) -> None:
    ctx = zmq.Context()
    sock = ctx.socket(zmq.ROUTER)
    port = sock.bind_to_random_port("tcp://127.0.0.1")
    port_q.put(port)
    while True:
        ident, msg = sock.recv_multipart()
        if msg == b"stop":
            break
        sock.send_multipart([ident, pickle.dumps(pickle.loads(msg))])


class FloorClient:
    """A raw DEALER talking to the echo server in its own process."""

    def __init__(self) -> None:
        ctx = mp.get_context("spawn")
        q: mp.Queue[int] = ctx.Queue()
        self.server = ctx.Process(target=_echo_server, args=(q,), daemon=True)
        self.server.start()
        self.sock = zmq.Context.instance().socket(zmq.DEALER)
        self.sock.connect(f"tcp://127.0.0.1:{q.get()}")

    def round_trip(self) -> None:
        self.sock.send(pickle.dumps(PAYLOAD))
        pickle.loads(self.sock.recv())

    def close(self) -> None:
        self.sock.send(b"stop")
        self.server.join()
        self.sock.close()


class Echo(Actor):
    @endpoint
    def echo(self, x):
        return x


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--quick", action="store_true", help="fewer repetitions (for a smoke run)")
    args = parser.parse_args()
    n = 300 if args.quick else 3000
    rows = []

    host = this_host()
    procs = host.spawn_procs(per_host={"gpus": 1})
    echo = procs.spawn("echo", Echo)
    floor_client = FloorClient()
    # Interleave the two in blocks so that machine noise hits both alike.
    floor_times: list[float] = []
    call_times: list[float] = []
    trusting_times: list[float] = []  # the client reading replies as full pickles (before issue 38 #2)
    mailbox = Mailbox.get()
    for _ in range(10):
        floor_times += timed(floor_client.round_trip, n // 10, warmup=20)
        call_times += timed(lambda: echo.echo.call_one(PAYLOAD).get(), n // 10, warmup=20)
        mailbox.plain_only = False
        trusting_times += timed(lambda: echo.echo.call_one(PAYLOAD).get(), n // 10, warmup=20)
        mailbox.plain_only = True
    floor_client.close()
    floor = statistics.median(floor_times)
    rtt = statistics.median(call_times)
    trusting = statistics.median(trusting_times)
    rows.append(("raw pyzmq round trip (floor)", f"{floor * 1e6:.0f} µs", "-", "reference"))
    rows.append(("call_one round trip (median)", f"{rtt * 1e6:.0f} µs", f"{rtt / floor:.2f}x floor", "<= 1.5x floor"))
    rows.append(
        (
            "  the same, replies read as full pickles",
            f"{trusting * 1e6:.0f} µs",
            f"plain data costs {rtt / trusting:.2f}x",
            "reported (issue 38 #2)",
        )
    )

    # The same call to a proc reached through its host's agent (hosts that cannot reach the client).
    relayed_procs = HostMesh.connect([host._members[0].agent], relay=[True]).spawn_procs(per_host={"gpus": 1})
    relayed = relayed_procs.spawn("echo", Echo)
    relayed_times = timed(lambda: relayed.echo.call_one(PAYLOAD).get(), n, warmup=20)
    relayed_procs.stop().get()
    relayed_rtt = statistics.median(relayed_times)
    rows.append(
        (
            "call_one relayed by the agent (median)",
            f"{relayed_rtt * 1e6:.0f} µs",
            f"{relayed_rtt / rtt:.2f}x direct",
            "reported",
        )
    )

    best = 0.0
    for _ in range(3 if args.quick else 5):
        t = time.perf_counter()
        futs = [echo.echo.call_one(PAYLOAD) for _ in range(1000)]
        for f in futs:
            f.get()
        best = max(best, 1000 / (time.perf_counter() - t))
    rows.append(
        ("pipelined calls, 1000 in flight", f"{best:,.0f} /s", f"{best * floor:.2f}x floor rate", ">= 20,000 /s")
    )

    spawn_times = []
    for _ in range(5 if args.quick else 15):
        t = time.perf_counter()
        p = host.spawn_procs(per_host={"gpus": 1})
        spawn_times.append(time.perf_counter() - t)
        p.stop().get()
    spawn = statistics.median(spawn_times)
    rows.append(("proc spawn until ready (median)", f"{spawn * 1e3:.0f} ms", "-", "<= 100 ms"))

    time.sleep(0.5)
    rss = psutil.Process(procs._members[0].pid).memory_info().rss
    uss = psutil.Process(procs._members[0].pid).memory_full_info().uss
    rows.append(
        ("idle proc memory (RSS / unique)", f"{rss / 2**20:.0f} MB / {uss / 2**20:.0f} MB", "-", "RSS <= 40 MB")
    )
    procs.stop().get()

    for size in (1, 4, 16):
        mesh = host.spawn_procs(per_host={"gpus": size})
        actors = mesh.spawn("echo", Echo)
        lat = statistics.median(timed(lambda: actors.echo.call(PAYLOAD).get(), max(50, n // (4 * size)), warmup=20))
        rows.append(
            (f"call() on {size:>2} procs (median)", f"{lat * 1e6:.0f} µs", f"{lat / floor:.2f}x floor", "reported")
        )
        mesh.stop().get()

    print_table(f"runtime, Python {platform.python_version()}", ("measure", "result", "ratio", "target"), rows)


if __name__ == "__main__":
    sys.exit(main())
