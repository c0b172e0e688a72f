"""OpenTelemetry export of a run: rank metrics, run/rank lifecycle as traces, rank output as logs (OTLP/HTTP).

Off unless a reservation names a collector (``monarch serve --otlp ENDPOINT``, kept in
``.monarch/otlp.json``; ``$MONARCH_OTLP_ENDPOINT`` overrides, ``off`` disables). The run's loop only
appends to a queue: a daemon thread imports the SDK (the ``otlp`` extra), turns the queue into spans,
metric points and log records, and the SDK's batch processors export them with short timeouts. A
collector that is down or unreachable therefore never slows or fails the run: at the end the run waits
for the last export only if the collector was seen to answer, and then at most :data:`FLUSH_WAIT_S`.
"""

from __future__ import annotations

import collections
import json
import re
import threading
import time
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from ..config import env
from ..sysutil import atomic_write

CONFIG_NAME = "otlp.json"
#: Seconds one export may take (each signal, each batch).
EXPORT_TIMEOUT_S = env.otlp_timeout  # read once, when a run first imports this module
#: The most a run's end waits for its last data to leave, when the collector answers.
FLUSH_WAIT_S = 3.0
#: Output lines queued beyond this (a collector far slower than the ranks) are dropped, and counted.
MAX_QUEUED = 200_000
#: Bytes of output waiting for the export thread, at most (the rest is dropped and counted): the
#: queue was bounded in items only, and a flood of big chunks grew the client ~40 MiB/s.
MAX_QUEUED_BYTES = 64 << 20
#: Bytes of one exported line, at most: a tqdm bar redrawn with \r and never ended is one line,
#: and was joined again with every chunk (16/31/62 MiB took 2.9/11.2/40.5 s).
MAX_RECORD = 16 << 10
_CONTINUES = b" ... [line cut: longer than 16 KiB]"
#: Records the SDK's own queue holds before it drops: with records of at most MAX_RECORD, at most
#: 64 MiB (it was 65,536 records, up to a gigabyte behind a collector that never answers).
_SDK_QUEUED_RECORDS = 4096


def config_path(state_dir: Path) -> Path:
    return Path(state_dir) / CONFIG_NAME


def set_endpoint(state_dir: Path, endpoint: str | None) -> None:
    """Remember (or, with ``None``/``""``/``off``, forget) the reservation's collector."""
    path = config_path(state_dir)
    if not endpoint or endpoint == "off":
        path.unlink(missing_ok=True)
        return
    check_endpoint(endpoint)
    path.parent.mkdir(parents=True, exist_ok=True)
    # 0600 whether or not it existed (an endpoint may carry a token; an older file may be 0644)
    atomic_write(path, json.dumps({"endpoint": endpoint.rstrip("/")}), 0o600)


def check_endpoint(endpoint: str) -> None:
    parts = urlsplit(endpoint)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ValueError(f"--otlp takes an OTLP/HTTP base URL such as http://localhost:4318, not {redact(endpoint)!r}")


_USERINFO = re.compile(r"(?<=://)[^/@\s]+@")
_SECRET_QUERY = re.compile(r"([?&][^=&\s]*(?:token|key|secret|password|passwd|auth|sig)[^=&\s]*=)[^&\s]+", re.I)


def redact(text: str) -> str:
    """``text`` with the credentials of any URL in it masked (``https://***@host``, ``?token=***``):
    what is printed, logged or exported about an endpoint or a command line."""
    return _SECRET_QUERY.sub(r"\1***", _USERINFO.sub("***@", text))


def carries_credentials(endpoint: str) -> bool:
    """Whether an endpoint holds a secret (user info, a token in its query): not for a command line."""
    return redact(endpoint) != endpoint


def endpoint_for(state_dir: Path) -> str | None:
    given = env.otlp_endpoint
    if given is not None:
        return None if given in ("", "off") else given.rstrip("/")
    try:
        return json.loads(config_path(state_dir).read_text()).get("endpoint") or None
    except (OSError, ValueError):
        return None


class _Lines:
    """Output chunks into whole lines, per (rank, stream), each at most :data:`MAX_RECORD` bytes: a
    longer line is exported cut, once, and the rest of it is skipped up to its newline (linear in
    the bytes, whatever the line's length)."""

    def __init__(self) -> None:
        self.partial: dict[tuple[int, int], bytes] = {}
        self.skipping: set[tuple[int, int]] = set()

    def add(self, key: tuple[int, int], data: bytes) -> list[bytes]:
        if key in self.skipping:
            cut = data.find(b"\n")
            if cut < 0:
                return []
            self.skipping.discard(key)
            data = data[cut + 1 :]
        *whole, rest = (self.partial.pop(key, b"") + data).split(b"\n")
        out = [line if len(line) <= MAX_RECORD else line[:MAX_RECORD] + _CONTINUES for line in whole]
        if len(rest) > MAX_RECORD:
            out.append(rest[:MAX_RECORD] + _CONTINUES)
            self.skipping.add(key)
        elif rest:
            self.partial[key] = rest
        return out

    def rest(self, key: tuple[int, int]) -> bytes:
        self.skipping.discard(key)
        return self.partial.pop(key, b"")


class RunExport:
    """One run's export. Every public method only appends to a queue (the run's loop never waits)."""

    def __init__(self, endpoint: str, reservation: str, run_id: str, command: str) -> None:
        self.endpoint, self.reservation, self.run_id, self.command = endpoint, reservation, run_id, command
        self._queue: collections.deque[tuple[str, Any]] = collections.deque()
        self._wake = threading.Event()
        self._done = threading.Event()
        self.answered = False  # the collector accepted a TCP connection
        self._probed = threading.Event()
        self.dropped = 0
        self._queued_bytes = 0
        self._bytes_lock = threading.Lock()
        self.error: str | None = None
        self._thread = threading.Thread(target=self._loop, name="monarch-otlp", daemon=True)
        self._thread.start()

    # ------------------------------------------------------------ producers
    def _put(self, kind: str, item: Any) -> None:
        if len(self._queue) >= MAX_QUEUED or self.error is not None:
            self.dropped += 1
            return
        self._queue.append((kind, item))

    def ranks_started(self, ranks: list[tuple[int, str, int]]) -> None:
        """(rank, host, local rank) of each launched rank."""
        self._put("start", (time.time_ns(), ranks))
        self._wake.set()

    def output(self, rank: int, stream: int, data: bytes) -> None:
        with self._bytes_lock:
            if self._queued_bytes + len(data) > MAX_QUEUED_BYTES:
                self.dropped += 1
                return
            self._queued_bytes += len(data)
        self._put("out", (time.time_ns(), rank, stream, data))

    def _taken(self, data: bytes) -> None:
        with self._bytes_lock:
            self._queued_bytes -= len(data)

    def rank_exit(self, rank: int, how: str, status: int) -> None:
        self._put("exit", (time.time_ns(), rank, how, status))

    def samples(self, samples: list[tuple[Any, ...]], steps: list[tuple[Any, ...]]) -> None:
        self._put("metrics", (samples, steps))
        self._wake.set()

    def finish(self, exit_code: int | None) -> None:
        """End the run's span and flush; waits (at most FLUSH_WAIT_S) only for a collector that answered."""
        self._queue.append(("end", (time.time_ns(), exit_code)))
        self._wake.set()
        self._probed.wait(1.5)  # done long before, unless the run was shorter than a connect timeout
        if self.answered:
            self._done.wait(FLUSH_WAIT_S)
        elif self.error is None:
            self.error = f"nothing answers at {redact(self.endpoint)}"
        if self.error is not None:
            import sys

            print(
                f"monarch: OpenTelemetry export failed ({redact(self.error)}); the run is unaffected", file=sys.stderr
            )

    # --------------------------------------------------------------- thread
    def _loop(self) -> None:
        try:
            self._probe()
            sdk = _Sdk(self.endpoint, self.reservation, self.run_id)
        except Exception as e:  # noqa: BLE001 - the SDK missing or failing: the run goes on without export
            self.error = f"{type(e).__name__}: {e}" + (
                " (pip install the 'otlp' extra)" if isinstance(e, ImportError) else ""
            )
            self._probed.set()
            self._queue.clear()
            self._done.set()
            return
        run_span = sdk.tracer.start_span(
            "monarch.run",
            attributes={"monarch.run_id": self.run_id, "process.command_line": redact(self.command)},
            start_time=time.time_ns(),
        )
        ranks: dict[int, Any] = {}
        lines = _Lines()
        hosts: dict[int, str] = {}
        ended = False
        while not ended:
            self._wake.wait(0.5)
            self._wake.clear()
            while self._queue:
                kind, item = self._queue.popleft()
                try:
                    if kind == "start":
                        ts, launched = item
                        for rank, host, local in launched:
                            hosts[rank] = host
                            ranks[rank] = sdk.rank_span(run_span, rank, host, local, ts)
                    elif kind == "out":
                        ts, rank, stream, data = item
                        self._taken(data)
                        for raw in lines.add((rank, stream), data):
                            sdk.log(ranks.get(rank), rank, hosts.get(rank), stream, ts, raw)
                    elif kind == "exit":
                        ts, rank, how, status = item
                        for stream in (1, 2):
                            rest = lines.rest((rank, stream))
                            if rest:
                                sdk.log(ranks.get(rank), rank, hosts.get(rank), stream, ts, rest)
                        sdk.end_rank(ranks.pop(rank, None), how, status, ts)
                    elif kind == "metrics":
                        samples, steps = item
                        sdk.record(samples, steps, hosts)
                    elif kind == "end":
                        ts, exit_code = item
                        for span in ranks.values():
                            sdk.end_rank(span, "unknown (the run ended first)", None, ts)
                        sdk.end_run(run_span, exit_code, ts)
                        ended = True
                except Exception as e:  # noqa: BLE001 - a bad record must not stop the export of the rest
                    self.error = f"{type(e).__name__}: {e}"
        try:
            sdk.shutdown()
        finally:
            self._done.set()

    def _probe(self) -> None:
        """Is anything listening at the collector's address? (Off the run's path; decides whether its end waits.)"""
        import socket  # only a run that exports needs it, and every run-spmd imports this module

        parts = urlsplit(self.endpoint)
        port = parts.port or (443 if parts.scheme == "https" else 80)
        try:
            socket.create_connection((parts.hostname, port), timeout=1.0).close()
            self.answered = True
        except OSError:
            self.answered = False
        finally:
            self._probed.set()


class _Sdk:
    """The OpenTelemetry SDK objects of one run (imported here: only a run that exports loads them)."""

    def __init__(self, endpoint: str, reservation: str, run_id: str) -> None:
        import logging
        import socket

        from opentelemetry.exporter.otlp.proto.http._log_exporter import OTLPLogExporter
        from opentelemetry.exporter.otlp.proto.http.metric_exporter import OTLPMetricExporter
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
        from opentelemetry.sdk._logs import LoggerProvider
        from opentelemetry.sdk._logs.export import BatchLogRecordProcessor
        from opentelemetry.sdk.metrics import MeterProvider
        from opentelemetry.sdk.metrics.export import PeriodicExportingMetricReader
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor

        quiet = logging.getLogger("opentelemetry")  # its retries would print on the run's console
        quiet.addHandler(logging.NullHandler())
        quiet.propagate = False
        resource = Resource.create(
            {
                "service.name": "monarch",
                "monarch.reservation": reservation,
                "monarch.run_id": run_id,
                "host.name": socket.gethostname(),  # the client's host; each rank's is an attribute
            }
        )
        timeout = EXPORT_TIMEOUT_S
        ms = int(timeout * 1000)
        self.traces = TracerProvider(resource=resource)
        self.traces.add_span_processor(
            BatchSpanProcessor(
                OTLPSpanExporter(f"{endpoint}/v1/traces", timeout=timeout),
                schedule_delay_millis=1000,
                export_timeout_millis=ms,
            )
        )
        self.logs = LoggerProvider(resource=resource)
        self.logs.add_log_record_processor(
            BatchLogRecordProcessor(
                OTLPLogExporter(f"{endpoint}/v1/logs", timeout=timeout),
                schedule_delay_millis=1000,
                export_timeout_millis=ms,
                max_queue_size=_SDK_QUEUED_RECORDS,
            )
        )
        self.reader = PeriodicExportingMetricReader(
            OTLPMetricExporter(f"{endpoint}/v1/metrics", timeout=timeout),
            export_interval_millis=2000,
            export_timeout_millis=ms,
        )
        self.metrics = MeterProvider(resource=resource, metric_readers=[self.reader])
        self.tracer = self.traces.get_tracer("monarch_cli")
        self.logger = self.logs.get_logger("monarch_cli")
        meter = self.metrics.get_meter("monarch_cli")
        self.cpu = meter.create_gauge(
            "monarch.rank.cpu", unit="%", description="CPU use of the rank's process (100 = one core)"
        )
        self.rss = meter.create_gauge(
            "monarch.rank.rss", unit="MiBy", description="resident memory of the rank's process"
        )
        self.gpu_util = meter.create_gauge(
            "monarch.rank.gpu.utilization", unit="%", description="utilisation of the rank's GPU"
        )
        self.gpu_mem = meter.create_gauge(
            "monarch.rank.gpu.memory", unit="MiBy", description="GPU memory of the rank's process"
        )
        self.step_time = meter.create_histogram(
            "monarch.rank.step_time", unit="ms", description="time between optimizer steps"
        )
        self.steps = meter.create_counter("monarch.rank.steps", unit="{step}", description="optimizer steps taken")
        from opentelemetry import trace
        from opentelemetry._logs import SeverityNumber
        from opentelemetry.trace import Status, StatusCode

        self._trace, self._sev, self._status, self._code = trace, SeverityNumber, Status, StatusCode

    def _attrs(self, rank: int, host: str | None) -> dict[str, Any]:
        return {"monarch.rank": rank, "monarch.host": host or ""}

    def rank_span(self, parent: Any, rank: int, host: str, local: int, ts: int) -> Any:
        ctx = self._trace.set_span_in_context(parent)
        attrs = {**self._attrs(rank, host), "monarch.local_rank": local}
        return self.tracer.start_span(f"rank {rank}", context=ctx, attributes=attrs, start_time=ts)

    def end_rank(self, span: Any, how: str, status: int | None, ts: int) -> None:
        if span is None:
            return
        span.set_attribute("monarch.exit", how)
        if status is not None:
            span.set_attribute("monarch.status", status)
        span.set_status(self._status(self._code.OK if status == 0 else self._code.ERROR, None if status == 0 else how))
        span.end(end_time=ts)

    def end_run(self, span: Any, exit_code: int | None, ts: int) -> None:
        if exit_code is not None:
            span.set_attribute("monarch.exit_code", exit_code)
        ok = exit_code == 0
        span.set_status(self._status(self._code.OK if ok else self._code.ERROR, None if ok else f"exit {exit_code}"))
        span.end(end_time=ts)

    def log(self, span: Any, rank: int, host: str | None, stream: int, ts: int, raw: bytes) -> None:
        err = stream == 2
        self.logger.emit(
            timestamp=ts,
            observed_timestamp=ts,
            context=self._trace.set_span_in_context(span) if span is not None else None,
            severity_number=self._sev.WARN if err else self._sev.INFO,
            severity_text="stderr" if err else "stdout",
            body=raw.rstrip(b"\r").decode("utf-8", "backslashreplace"),
            attributes={**self._attrs(rank, host), "log.iostream": "stderr" if err else "stdout"},
        )

    def record(self, samples: list[tuple[Any, ...]], steps: list[tuple[Any, ...]], hosts: dict[int, str]) -> None:
        # rows as the store has them: samples (run_id, rank, host, ts, pid, state, cpu, rss, threads, gpu_index,
        # gpu_util, gpu_mem_mb, ...), steps (run_id, rank, step, ts, dt_ms)
        for s in samples:
            attrs = self._attrs(s[1], s[2])
            if s[6] is not None:
                self.cpu.set(s[6], attrs)
            if s[7] is not None:
                self.rss.set(s[7], attrs)
            if s[10] is not None:
                self.gpu_util.set(s[10], attrs)
            if s[11] is not None:
                self.gpu_mem.set(s[11], attrs)
        for st in steps:
            attrs = self._attrs(st[1], hosts.get(st[1]))
            self.steps.add(1, attrs)
            if st[2] > 1 and st[4] is not None:  # step 1 counts start-up
                self.step_time.record(st[4], attrs)

    def shutdown(self) -> None:
        ms = int(EXPORT_TIMEOUT_S * 1000)
        for batching in (self.traces, self.logs):
            batching.force_flush(ms)
        self.reader.force_flush(ms)
        for provider in (self.traces, self.logs, self.metrics):
            provider.shutdown()
