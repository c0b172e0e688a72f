"""Heartbeat answers while an agent streams output: one port carries both.

    python benchmarks/heartbeat.py [--beats 400] [--megabytes 50]

Heartbeats and everything else share the agent's one port (issue 9): the agent answers a
heartbeat from its I/O loop, between reads of its ranks' output. This measures the
heartbeat round trip (on a DEALER of its own, so this is the agent's answer time, not the client's) on a
1-host local reservation, idle (the reference, same run) and while a rank writes
``--megabytes`` of short lines through the same agent to this process. The figure that
matters is the worst answer against the heartbeat timeout (5 s by default).
"""

from __future__ import annotations

import argparse
import io
import statistics
import tempfile
import threading
import time
from pathlib import Path

from _common import print_table

FLOOD = (
    "import sys\nline = 'step %07d loss 0.123456 lr 0.001 tokens/s 123456\\n'\n"
    "for i in range({n}):\n    sys.stdout.write(line % i)\n"
)


def beats(sock: object, address: str, n: int, stop: threading.Event | None = None) -> list[float]:
    from monarch_cli.runtime import protocol
    from monarch_cli.runtime.transport import wire

    beat = wire.frames(protocol.header(protocol.Heartbeat(address)))[0]
    out = []
    for _ in range(n):
        if stop is not None and stop.is_set():
            break
        t = time.perf_counter()
        sock.send(beat)  # type: ignore[attr-defined]
        sock.recv()  # type: ignore[attr-defined]
        out.append(time.perf_counter() - t)
        time.sleep(0.005)
    return out


def row(name: str, xs: list[float]) -> list[str]:
    xs = sorted(xs)
    p99 = xs[min(len(xs) - 1, int(len(xs) * 0.99))]
    return [name, str(len(xs)), f"{statistics.median(xs) * 1e3:.2f}", f"{p99 * 1e3:.2f}", f"{xs[-1] * 1e3:.2f}"]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--beats", type=int, default=400)
    parser.add_argument("--megabytes", type=int, default=50)
    args = parser.parse_args()
    from monarch_cli.jobs import serve
    from monarch_cli.runtime.transport.sockets import Transport

    with tempfile.TemporaryDirectory(prefix="monarch-bench-hb-") as tmp:
        cwd = Path(tmp)
        job = serve(None, "local", hosts=1, state=cwd / ".monarch" / "job_state.pkl")
        try:
            hs = job.hostset()
            transport = Transport(job.keys, zap=False)
            sock = transport.dealer(hs.hosts[0].agent)
            idle = beats(sock, hs.mb.address, args.beats)
            script = cwd / "flood.py"
            script.write_text(FLOOD.format(n=args.megabytes * 1_000_000 // 49))
            stop = threading.Event()
            busy: list[float] = []
            result = {}

            def flood() -> None:
                result["run"] = job.run_spmd(
                    ["torchrun", "--nproc-per-node=1", str(script)], stdout=io.BytesIO(), stderr=io.BytesIO()
                )
                stop.set()

            runner = threading.Thread(target=flood)
            t = time.perf_counter()
            runner.start()
            while not stop.is_set():
                busy += beats(sock, hs.mb.address, 50, stop)
            runner.join()
            took = time.perf_counter() - t
            sock.close(0)
            transport.close()
        finally:
            job.stop()
    assert result["run"].exit_code == 0
    print_table(
        "heartbeat round trip (ms) on the agent's one port",
        ["agent", "beats", "median", "p99", "max"],
        [row("idle (reference)", idle), row(f"while a rank streams {args.megabytes} MB ({took:.1f} s)", busy)],
    )


if __name__ == "__main__":
    main()
