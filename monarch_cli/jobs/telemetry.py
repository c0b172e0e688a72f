"""Telemetry from the controller's side, while a run goes on: recording it.

:class:`RunTelemetry` is what ``run-spmd`` feeds while a run goes on (runs, ranks, every
output line, the agents' samples and step records) into the reservation's store. The
questions asked of it later (``monarch stack``, ``diagnose``, ``top``) are :mod:`.inspector`'s:
a run does not load them.
"""

from __future__ import annotations

import shlex
import time
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from ..config import env
from ..runtime import protocol
from ..telemetry import TelemetryWriter, db_path
from .errors import JobError

if TYPE_CHECKING:
    from .model import HostSet, Launch, RankExit, RunResult


def enabled() -> bool:
    """``MONARCH_TELEMETRY=0`` turns recording off (for A/B benchmarks)."""
    return env.telemetry


class TelemetryError(JobError):
    """A telemetry query that cannot be answered (one line for the user)."""


# ---------------------------------------------------------------------------- recording
class RunRecorder(Protocol):
    """What a run tells its telemetry; :data:`NO_TELEMETRY` when recording is off."""

    def started(self, launches: list[Launch], hostset: HostSet, attempt: int) -> None:
        """An attempt's ranks are about to start."""

    def start(self) -> None:
        """The ranks are on their way: start writing."""

    def output(self, rank: int, stream: int, data: bytes) -> None:
        """A rank wrote ``data`` to ``stream`` (1 stdout, 2 stderr)."""

    def rank_exit(self, e: RankExit) -> None:
        """A rank ended."""

    def on_agent_event(self, event: protocol.Telemetry, _body: Any) -> None:
        """A host agent's samples and step records for the run."""

    def event(self, kind: str, rank: int | None, detail: str) -> None:
        """Something the controller saw happen to the run (a partition between its hosts)."""

    def finish(self, result: RunResult | None) -> None:
        """The run ended (None: it failed to run); nothing is written after."""


class NoTelemetry:
    """The :class:`RunRecorder` of a run that records nothing (``MONARCH_TELEMETRY=0``, ``exec``)."""

    def started(self, launches: list[Launch], hostset: HostSet, attempt: int) -> None:
        pass

    def start(self) -> None:
        pass

    def output(self, rank: int, stream: int, data: bytes) -> None:
        pass

    def rank_exit(self, e: RankExit) -> None:
        pass

    def on_agent_event(self, event: protocol.Telemetry, _body: Any) -> None:
        pass

    def event(self, kind: str, rank: int | None, detail: str) -> None:
        pass

    def finish(self, result: RunResult | None) -> None:
        pass


NO_TELEMETRY: RunRecorder = NoTelemetry()


class RunTelemetry:
    """One run's rows, written in the background by a :class:`TelemetryWriter`."""

    def __init__(
        self, state_dir: Path, run_id: str, command: Sequence[str], log_dir: Path, reservation: str = ""
    ) -> None:
        self.run_id = run_id
        self.export = _otlp_export(state_dir, reservation, run_id, shlex.join(command))
        self.writer = TelemetryWriter(db_path(state_dir), run_id, start=False)  # started once the ranks are launched
        self.writer.sql(
            "INSERT OR REPLACE INTO runs (run_id, command, started_at, log_dir, restarts, interrupted) "
            "VALUES (?, ?, ?, ?, 0, 0)",
            (run_id, shlex.join(command), time.time(), str(log_dir)),
        )
        self.writer.event("run_start", None, shlex.join(command))

    def started(self, launches: list[Launch], hostset: HostSet, attempt: int) -> None:
        now = time.time()
        nodes = sorted({l.node for l in launches})
        w = self.writer
        w.set_rank_count(len(launches))
        w.sql("UPDATE runs SET world_size = ?, hosts = ? WHERE run_id = ?", (len(launches), len(nodes), self.run_id))
        if attempt == 0:
            w.rows(
                "hosts",
                (
                    (
                        self.run_id,
                        n,
                        hostset.hosts[n].name,
                        hostset.hosts[n].agent,
                        hostset.infos[n].get("pid"),
                        hostset.infos[n].get("cpus"),
                        hostset.infos[n].get("gpus"),
                    )
                    for n in nodes
                ),
            )
        else:
            w.sql("DELETE FROM ranks WHERE run_id = ?", (self.run_id,))
            w.event("restart", None, f"attempt {attempt}")
        # A generator: the writer thread makes each row as it inserts it (no 32,768 tuples held).
        w.rows(
            "ranks",
            (
                (
                    self.run_id,
                    l.rank,
                    l.local,
                    l.node,
                    hostset.hosts[l.node].name,
                    None,
                    None,
                    None,
                    None,
                    None,
                    now,
                    None,
                    None,
                    0,
                )
                for l in launches
            ),
        )
        if self.export is not None:
            self.export.ranks_started([(l.rank, hostset.hosts[l.node].name, l.local) for l in launches])

    def start(self) -> None:
        self.writer.start()

    def output(self, rank: int, stream: int, data: bytes) -> None:
        self.writer.output(rank, stream, data)
        if self.export is not None:
            self.export.output(rank, stream, data)

    def event(self, kind: str, rank: int | None, detail: str) -> None:
        self.writer.event(kind, rank, detail)

    def rank_exit(self, e: RankExit) -> None:
        w = self.writer
        w.end_of_rank(e.rank)
        w.sql(
            "UPDATE ranks SET pid = ?, exit_code = ?, signal = ?, status = ?, how = ?, ended_at = ? "
            "WHERE run_id = ? AND rank = ?",
            (e.pid, e.exitcode, e.signal, e.status, e.how, time.time(), self.run_id, e.rank),
        )
        if not e.ok:
            w.event("rank_lost" if e.lost else "rank_failed", e.rank, e.how)
        if self.export is not None:
            self.export.rank_exit(e.rank, e.how, e.status)

    def on_agent_event(self, event: protocol.Telemetry, _body: Any) -> None:
        """A host agent's :class:`~monarch_cli.runtime.protocol.Telemetry` for this run."""
        if event.run_id == self.run_id:
            self.writer.rows("samples", event.samples)
            self.writer.rows("steps", event.steps)
            if self.export is not None:
                self.export.samples(event.samples, event.steps)

    def finish(self, result: RunResult | None) -> None:
        if result is None:  # it failed to run: ended all the same (exit_code NULL), not "running" forever
            self.writer.sql("UPDATE runs SET ended_at = ? WHERE run_id = ?", (time.time(), self.run_id))
            self.writer.event("run_end", None, "failed to run")
        else:
            self.writer.sql(
                "UPDATE runs SET ended_at = ?, exit_code = ?, restarts = ?, interrupted = ? WHERE run_id = ?",
                (time.time(), result.exit_code, result.restarts, int(result.interrupted), self.run_id),
            )
            if result.interrupted:
                self.writer.event("interrupt", None, "")
            self.writer.event("run_end", None, f"exit {result.exit_code}")
        self.writer.close()
        if self.export is not None:
            self.export.finish(result.exit_code if result is not None else None)


def _otlp_export(state_dir: Path, reservation: str, run_id: str, command: str) -> Any:
    """The run's OpenTelemetry export when the reservation names a collector (``serve --otlp``), else None."""
    from . import otlp

    endpoint = otlp.endpoint_for(state_dir)
    return otlp.RunExport(endpoint, reservation, run_id, command) if endpoint else None
