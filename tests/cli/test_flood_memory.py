"""A flood of output through the real CLI client: its memory stays under a fixed ceiling, and
every byte still reaches the run's log (issue 38 #5).

Two ranks print 200 MB each, in 4 KB lines, as fast as Python can, and the reservation exports
to an OTLP collector that accepts connections and never answers. The console is /dev/null
(the fastest reader), so what limits the client is what it does with the lines: the run log on
disk, the telemetry store and the OTLP exporter. Every buffer between them is bounded in bytes
(``output.MAX_LOG_QUEUED``, ``telemetry.writer.MAX_QUEUED_BYTES``, ``otlp.MAX_QUEUED_BYTES``);
before they were, the OTLP queue was bounded in items (200,000 lines of any length) and the
client grew with the flood.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest

from monarch_cli.jobs import otlp, serve
from monarch_cli.jobs.run_log import rank_log

pytestmark = pytest.mark.slow

LINES = 50_000
LINE = "step {i:>9} loss 0.125 " + "x" * 3972 + "\n"  # 4000 bytes
FLOOD = f"""\
import sys
out = sys.stdout
for i in range({LINES}):
    out.write({LINE!r}.format(i=i))
out.flush()
"""
#: The client's resident memory may not pass this, whatever the ranks send: ~70 MiB of its own,
#: plus the bounded queues (64 MiB each, and they do not all fill at once).
CEILING = 384 << 20


@pytest.fixture(scope="module")
def work(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    work = tmp_path_factory.mktemp("flood")
    (work / "flood.py").write_text(FLOOD)
    job = serve(None, hosts=1, state=work / ".monarch" / "job_state.pkl")
    silent = socket.socket()  # an OTLP collector that accepts connections and never answers
    silent.bind(("127.0.0.1", 0))
    silent.listen(64)
    otlp.set_endpoint(job.path.parent, f"http://127.0.0.1:{silent.getsockname()[1]}")
    yield work
    silent.close()
    job.stop()


def test_a_flood_of_output_keeps_the_client_under_a_fixed_memory_ceiling(work: Path) -> None:
    env = {**os.environ, "MONARCH_STATE": str(work / ".monarch" / "job_state.pkl"), "NO_COLOR": "1"}
    command = [sys.executable, "-m", "monarch_cli", "run-spmd", "--", "torchrun", "--nproc-per-node=2", "flood.py"]
    client = subprocess.Popen(command, cwd=work, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    watched = psutil.Process(client.pid)
    peak = 0
    deadline = time.monotonic() + 600
    while client.poll() is None and time.monotonic() < deadline:
        try:
            peak = max(peak, watched.memory_info().rss)
        except psutil.NoSuchProcess:
            break
        time.sleep(0.05)  # sampling the client's memory, not waiting on it
    assert client.wait(timeout=60) == 0, client.stderr.read().decode()[-2000:] if client.stderr else ""
    print(f"client peak RSS: {peak >> 20} MiB")
    assert peak < CEILING, f"the client grew to {peak >> 20} MiB under the flood (ceiling {CEILING >> 20} MiB)"
    logs = sorted((work / ".monarch" / "logs").glob("*/output.log"))
    assert len(logs) == 1
    expected = LINES * len(LINE.format(i=0))
    for rank in (0, 1):
        text = rank_log(logs[0].parent, rank).read_bytes()
        assert len(text) == expected, f"rank {rank}'s log holds {len(text)} bytes of the {expected} it wrote"
        assert text.endswith(LINE.format(i=LINES - 1).encode())
