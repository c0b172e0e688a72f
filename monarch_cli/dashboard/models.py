"""The shapes of the dashboard's JSON answers: FastAPI turns them into the OpenAPI schema (``/openapi.json``).

Field names are the telemetry store's columns (``monarch sql --schema`` says what each means).
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field

Opt = Any  # (a column that may be NULL; its type is in `monarch sql --schema`)


class _Row(BaseModel):
    model_config = ConfigDict(extra="allow")  # a column added to the store shows up without a change here


class Run(_Row):
    run_id: str
    command: str | None = None
    started_at: float | None = None
    ended_at: float | None = Field(None, description="NULL while the run goes on (or if its client died)")
    exit_code: int | None = None
    world_size: int | None = None
    hosts: int | None = None
    restarts: int | None = None
    interrupted: int | None = None
    seconds: float | None = None
    failed: int | None = Field(None, description="ranks that did not exit 0")


class RankExit(_Row):
    rank: int
    local_rank: int | None = None
    node: int | None = None
    host: str | None = None
    pid: int | None = None
    exit_code: int | None = None
    signal: int | None = None
    status: int | None = None
    how: str | None = Field(None, description="'exit 0', 'killed by SIGKILL', 'lost: ...'; NULL while running")
    started_at: float | None = None
    ended_at: float | None = None
    last_output_at: float | None = None
    lines: int | None = None


class RunEvent(_Row):
    ts: float
    rank: int | None = None
    kind: str
    detail: str | None = None


class RunHost(_Row):
    node: int
    host: str
    agent: str | None = None
    agent_pid: int | None = None
    cpus: int | None = None
    gpus: int | None = None


class RunDetail(BaseModel):
    run: Run
    ranks: list[RankExit] = Field(description="the exit table")
    events: list[RunEvent]
    hosts: list[RunHost]


class LogLine(BaseModel):
    id: int = Field(description="the line's cursor (pass as after= or before=)")
    rank: int
    ts: float
    stream: str
    line: str


class LogPage(BaseModel):
    run_id: str | None
    lines: list[LogLine] = Field(description="oldest first")
    more: bool = Field(description="the page is full: there are more lines in that direction")


class Series(BaseModel):
    run_id: str | None
    samples: list[list[Opt]] = Field(description="[rank, ts, cpu_percent, rss_mb, gpu_util, gpu_mem_mb]")
    steps: list[list[Opt]] = Field(description="[rank, ts, step, dt_ms]")
    numbers: dict[str, list[list[Opt]]] = Field(description="key -> [rank, ts, value] for each key=value printed")
    cursors: dict[str, int] = Field(description="samples, steps, logs: the next request's cursors")
    more: bool = Field(False, description="clipped at the limit: ask again with these cursors for the rest")


class Host(BaseModel):
    name: str
    agent: str | None = None
    alive: bool | None = Field(None, description="the agent answered just now")
    ranks_running: int | None = None
    warm: bool | None = Field(None, description="the warm process is ready")
    warming: bool | None = None
    cpus: int | None = None
    gpus: int | None = None
    sampled_at: float | None = None
    ranks: int = Field(0, description="ranks of the newest run sampled on this host")
    cpu_percent: float | None = Field(None, description="sum of its ranks' newest CPU samples")
    rss_mb: float | None = None
    gpu_util: float | None = Field(None, description="mean of its ranks' GPUs' utilisation")
    gpu_mem_mb: float | None = None


class Hosts(BaseModel):
    reservation_id: str | None = None
    scheduler: str | None = None
    alive: bool | None = None
    stale: str | None = Field(None, description="why the reservation is not (fully) reachable")
    run_id: str | None = None
    hosts: list[Host]


class StackGroup(BaseModel):
    ranks: list[int]
    ranks_text: str | None = None
    summary: str
    frames: list[Opt]


class Stacks(BaseModel):
    run_id: str | None
    capture_id: str | None = None
    ts: float | None = None
    method: list[str] = []
    groups: list[StackGroup]
    seconds: float | None = Field(None, description="how long the capture took (a fresh capture only)")
    live: bool | None = Field(None, description="false: no live rank, the groups are the newest stored capture")


class Suspect(BaseModel):
    rank: int
    host: str | None = None
    reasons: list[str]


class Diagnosis(BaseModel):
    verdict: str = Field(description="healthy | suspect | unknown")
    exit_code: int = Field(description="0 healthy, 1 a suspect found, 2 cannot tell (as `monarch diagnose`)")
    run_id: str | None = None
    summary: str
    suspects: list[Suspect]
    evidence: dict[str, Any]


class Top(BaseModel):
    run_id: str | None
    ranks: list[dict[str, Any]] = Field(description="the `monarch top --json` rows, suspects first")


class Query(BaseModel):
    description: str
    sql: str
