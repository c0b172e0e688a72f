"""OpenTelemetry export of real runs to a receiver this test starts (decoded with the opentelemetry-proto package)."""

from __future__ import annotations

import gzip
import socket
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest

from monarch_cli.jobs import Job, otlp

from .conftest import spmd

SCRIPT = """
import os, sys, time
import torch
rank = int(os.environ["RANK"])
model = torch.nn.Linear(4, 1)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
for step in range(12):
    loss = model(torch.randn(8, 4)).pow(2).mean()
    opt.zero_grad(); loss.backward(); opt.step()
    print(f"step={step} loss={loss.item():.3f}", flush=True)
    time.sleep(0.2)
print(f"rank {rank} done", file=sys.stderr, flush=True)
"""


class Receiver:
    """An OTLP/HTTP collector: keeps every decoded request per signal."""

    def __init__(self) -> None:
        from opentelemetry.proto.collector.logs.v1.logs_service_pb2 import ExportLogsServiceRequest
        from opentelemetry.proto.collector.metrics.v1.metrics_service_pb2 import ExportMetricsServiceRequest
        from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

        kinds = {
            "/v1/traces": ExportTraceServiceRequest,
            "/v1/metrics": ExportMetricsServiceRequest,
            "/v1/logs": ExportLogsServiceRequest,
        }
        self.got: dict[str, list[Any]] = {k: [] for k in kinds}
        got = self.got

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers["Content-Length"]))
                if self.headers.get("Content-Encoding") == "gzip":
                    body = gzip.decompress(body)
                message = kinds[self.path]()
                message.ParseFromString(body)
                got[self.path].append(message)
                self.send_response(200)
                self.send_header("Content-Type", "application/x-protobuf")
                self.send_header("Content-Length", "0")
                self.end_headers()

            def log_message(self, *_: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def receiver() -> Iterator[Receiver]:
    r = Receiver()
    yield r
    r.close()


def _attrs(kvs: Any) -> dict[str, Any]:
    out = {}
    for kv in kvs:
        v = kv.value
        out[kv.key] = getattr(v, v.WhichOneof("value")) if v.WhichOneof("value") else None
    return out


def _wait(what: str, check: Any, timeout: float = 60.0) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        found = check()
        if found:
            return found
        time.sleep(0.1)
    raise AssertionError(f"timed out waiting for {what}")


@pytest.mark.slow
def test_a_run_is_exported_as_spans_logs_and_metrics(job: Job, tmp_path: Path, receiver: Receiver) -> None:
    script = tmp_path / "train.py"
    script.write_text(SCRIPT)
    otlp.set_endpoint(job.path.parent, receiver.url)
    try:
        run = spmd(job, script)
    finally:
        otlp.set_endpoint(job.path.parent, None)
    assert run.result.exit_code == 0
    run_id = run.result.run_id
    reservation = job.state.reservation_id

    def spans() -> list[tuple[dict[str, Any], Any]]:
        return [
            (_attrs(rs.resource.attributes), s)
            for req in receiver.got["/v1/traces"]
            for rs in req.resource_spans
            for ss in rs.scope_spans
            for s in ss.spans
        ]

    _wait("the run's span and its 4 ranks' spans", lambda: len(spans()) >= 5)
    by_name = {s.name: (res, s) for res, s in spans()}
    res, root = by_name["monarch.run"]
    assert res["monarch.reservation"] == reservation and res["monarch.run_id"] == run_id
    assert _attrs(root.attributes)["monarch.exit_code"] == 0
    for rank in range(4):
        _, span = by_name[f"rank {rank}"]
        a = _attrs(span.attributes)
        assert a["monarch.rank"] == rank and a["monarch.host"] == ("local0" if rank < 2 else "local1")
        assert a["monarch.exit"] == "exit 0" and span.parent_span_id == root.span_id and span.trace_id == root.trace_id
        assert span.end_time_unix_nano > span.start_time_unix_nano

    def logs() -> list[tuple[dict[str, Any], Any]]:
        return [
            (_attrs(rl.resource.attributes), r)
            for req in receiver.got["/v1/logs"]
            for rl in req.resource_logs
            for sl in rl.scope_logs
            for r in sl.log_records
        ]

    _wait("every output line as a log record", lambda: len(logs()) >= 4 * 13)
    lines = {(_attrs(r.attributes)["monarch.rank"], r.body.string_value) for _, r in logs()}
    for rank in range(4):
        assert any(rk == rank and body.startswith("step=11 loss=") for rk, body in lines)
        assert (rank, f"rank {rank} done") in lines
    stderr = [r for _, r in logs() if r.body.string_value.endswith("done")]
    assert all(_attrs(r.attributes)["log.iostream"] == "stderr" and r.trace_id for r in stderr)
    assert all(res["monarch.reservation"] == reservation for res, _ in logs())

    def points(name: str) -> list[dict[str, Any]]:
        found = []
        for req in receiver.got["/v1/metrics"]:
            for rm in req.resource_metrics:
                for sm in rm.scope_metrics:
                    for m in sm.metrics:
                        if m.name == name:
                            data = getattr(m, m.WhichOneof("data"))
                            found += [_attrs(p.attributes) for p in data.data_points]
        return found

    for name in ("monarch.rank.rss", "monarch.rank.cpu", "monarch.rank.step_time", "monarch.rank.steps"):
        ranks = _wait(
            f"{name} of every rank", lambda n=name: {a["monarch.rank"] for a in points(n)} >= {0, 1, 2, 3} and points(n)
        )
        assert {a["monarch.host"] for a in ranks} == {"local0", "local1"}


class _BlackHole:
    """A collector that accepts connections and never answers."""

    def __init__(self) -> None:
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(64)
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"


@pytest.mark.slow
@pytest.mark.parametrize("collector", ["down", "silent"])
def test_an_unreachable_collector_neither_fails_nor_holds_the_run(
    job: Job, tmp_path: Path, collector: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each export would wait up to 60 s for this collector; the run still ends as soon as its ranks do
    (a 'silent' one, which accepts the connection, is waited for at most FLUSH_WAIT_S)."""
    monkeypatch.setattr(otlp, "EXPORT_TIMEOUT_S", 60.0)
    script = tmp_path / "train.py"
    script.write_text(SCRIPT)
    if collector == "down":
        free = socket.socket()
        free.bind(("127.0.0.1", 0))
        url = f"http://127.0.0.1:{free.getsockname()[1]}"
        free.close()  # nothing listens there now
        hole = None
    else:
        hole = _BlackHole()
        url = hole.url
    otlp.set_endpoint(job.path.parent, url)
    try:
        run = spmd(job, script)
    finally:
        otlp.set_endpoint(job.path.parent, None)
        if hole is not None:
            hole.sock.close()
    assert run.result.exit_code == 0
    assert sorted(len(v) for v in run.by_rank().values()) == [12] * 4, run.by_rank()
    assert sorted(len(v) for v in run.by_rank("err").values()) == [1] * 4, run.by_rank("err")
    # the run took its ranks' time (~2.4 s of steps) plus start and end, nowhere near one export timeout
    assert run.elapsed < 30, run.elapsed
    rows = job.sql("SELECT count(*) AS n FROM logs WHERE run_id = ?", (run.result.run_id,))
    assert rows[0]["n"] == 4 * 13  # the store, written alongside, is complete


def test_the_endpoint_is_checked_and_kept_private(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(ValueError, match="OTLP/HTTP base URL"):
        otlp.set_endpoint(tmp_path, "localhost:4318")
    otlp.set_endpoint(tmp_path, "http://collector:4318/")
    assert otlp.endpoint_for(tmp_path) == "http://collector:4318"
    assert (otlp.config_path(tmp_path).stat().st_mode & 0o077) == 0
    otlp.set_endpoint(tmp_path, "off")
    assert otlp.endpoint_for(tmp_path) is None
    monkeypatch.setenv("MONARCH_OTLP_ENDPOINT", "http://other:4318")  # the environment overrides, per run
    otlp.set_endpoint(tmp_path, "http://collector:4318")
    assert otlp.endpoint_for(tmp_path) == "http://other:4318"
    monkeypatch.setenv("MONARCH_OTLP_ENDPOINT", "off")
    assert otlp.endpoint_for(tmp_path) is None


BAR = """
import sys
for _ in range(512):  # 32 MiB of a progress bar redrawn with \\r, never ended
    sys.stdout.write("\\r" + "#" * 65536)
sys.stdout.write("\\nafter the bar\\n")
"""


@pytest.mark.slow
def test_a_line_of_many_megabytes_is_exported_cut_once(job: Job, tmp_path: Path, receiver: Receiver) -> None:
    """Each exported line is at most 16 KiB: a 32 MiB progress bar becomes one record, cut and
    saying so, and the lines after it arrive (it was joined again with every chunk: minutes)."""
    script = tmp_path / "bar.py"
    script.write_text(BAR)
    otlp.set_endpoint(job.path.parent, receiver.url)
    try:
        run = spmd(job, script, nproc=1)
    finally:
        otlp.set_endpoint(job.path.parent, None)
    assert run.result.exit_code == 0, run.text()[-2000:]

    def bodies() -> list[str]:
        return [
            r.body.string_value
            for req in receiver.got["/v1/logs"]
            for rl in req.resource_logs
            for sl in rl.scope_logs
            for r in sl.log_records
        ]

    _wait("the line after the bar, from both ranks", lambda: bodies().count("after the bar") == 2)
    bars = [b for b in bodies() if b.startswith("\r#")]
    assert len(bars) == 2, [len(b) for b in bars]
    assert all(len(b) <= (16 << 10) + 64 and b.endswith("[line cut: longer than 16 KiB]") for b in bars)
