"""What one client can make the dashboard server do is bounded: points per series answer, live streams at once.

A real store written by the real :class:`TelemetryWriter` and the real server on a loopback port, asked
over real HTTP (issue 38, row 12).
"""

from __future__ import annotations

import http.client
import json
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from typing import Any

import pytest

from monarch_cli.dashboard.app import MAX_STREAMS
from monarch_cli.dashboard.views import MAX_NUMBER_POINTS, MAX_SERIES_ROWS
from monarch_cli.telemetry import TelemetryWriter, db_path

from .conftest import Served, wait_for

RUN = "20260101-000000000-lim1"
SAMPLES = MAX_SERIES_ROWS + 5_000
STEPS = MAX_SERIES_ROWS + 3_000
LONG_LINES = 100
PER_LINE = 1000  # "a=1 " 1000 times: 4,000 characters, under the store's 4 KiB line cut


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    """A store (no reservation) with more samples and steps than one answer holds, and lines dense with numbers."""
    state = tmp_path_factory.mktemp("limits") / ".monarch" / "job_state.pkl"
    w = TelemetryWriter(db_path(state.parent), RUN)
    t0 = time.time() - 600
    w.sql("INSERT INTO runs (run_id, command, started_at, world_size) VALUES (?,?,?,?)", (RUN, "python big.py", t0, 8))
    w.rows(
        "samples",
        [
            (RUN, i % 8, "node0", t0 + i, 1000, "running", 50.0, 900.0, 4, None, None, None, None, None)
            for i in range(SAMPLES)
        ],
    )
    w.rows("steps", [(RUN, i % 8, i // 8 + 1, t0 + i * 0.01, 500.0) for i in range(STEPS)])
    for i in range(LONG_LINES):
        w.output(i % 8, 1, ("a=1 " * PER_LINE).encode() + b"\n")
    w.flush(120)
    dash = Served(state)
    yield dash
    dash.stop()
    w.close()


def _series(served: Served, query: str = "") -> Any:
    url = f"{served.base}api/runs/{RUN}/series?token={served.token}{query}"
    with urllib.request.urlopen(url, timeout=60) as r:
        return json.loads(r.read())


def _points(answer: dict[str, Any]) -> int:
    return sum(len(p) for p in answer["numbers"].values())


def test_a_series_answer_is_bounded_and_pages_to_the_end(served: Served) -> None:
    """The first answer stops at the bound and says `more`; following its cursors gives every row once."""
    first = _series(served)
    assert len(first["samples"]) == MAX_SERIES_ROWS and len(first["steps"]) == MAX_SERIES_ROWS, len(first["samples"])
    assert _points(first) <= MAX_NUMBER_POINTS + PER_LINE and first["more"] is True
    samples, steps, points, answer, asked = first["samples"], first["steps"], _points(first), first, 1
    while answer["more"]:
        c = answer["cursors"]
        answer = _series(served, f"&samples={c['samples']}&steps={c['steps']}&logs={c['logs']}")
        samples, steps, points, asked = (
            samples + answer["samples"],
            steps + answer["steps"],
            points + _points(answer),
            asked + 1,
        )
        assert asked < 10, "the cursors do not move on"
    assert len(samples) == SAMPLES and [s[1] for s in samples] == sorted(s[1] for s in samples)
    assert len(steps) == STEPS and points == LONG_LINES * PER_LINE
    # a smaller page when asked; an absurd one is refused with one line, not served
    assert len(_series(served, "&limit=10")["samples"]) == 10
    with pytest.raises(urllib.error.HTTPError) as e:
        _series(served, f"&limit={10**9}")
    assert e.value.code == 422 and "limit" in e.value.read().decode()


def test_the_live_series_comes_in_bounded_events(served: Served) -> None:
    """From cursor 0 the stream sends everything, one bounded event after another without waiting for new rows."""
    url = f"{served.base}api/events?token={served.token}&run={RUN}&series=true"
    sizes: list[int] = []
    with urllib.request.urlopen(url, timeout=60) as stream:
        kind = None
        for raw in stream:
            line = raw.decode().rstrip("\n")
            if line.startswith("event: "):
                kind = line[7:]
            elif line.startswith("data: ") and kind == "series":
                sizes.append(len(json.loads(line[6:])["samples"]))
                if sum(sizes) >= SAMPLES:
                    break
    assert sum(sizes) == SAMPLES and max(sizes) == MAX_SERIES_ROWS, sizes


class _Stream:
    """One event stream held open over a raw HTTP connection."""

    def __init__(self, served: Served) -> None:
        self.conn = http.client.HTTPConnection("127.0.0.1", served.dash.port, timeout=30)
        self.conn.request("GET", f"/api/events?token={served.token}")
        self.answer = self.conn.getresponse()

    def close(self) -> None:
        self.answer.close()
        self.conn.close()


def test_live_streams_are_capped_and_a_closed_one_frees_its_slot(served: Served) -> None:
    held = [_Stream(served) for _ in range(MAX_STREAMS)]
    try:
        for s in held:  # each admitted: its first comment arrived
            assert s.answer.status == 200 and s.answer.readline() == b": connected\n"
        extra = _Stream(served)
        assert extra.answer.status == 429, extra.answer.status
        why = extra.answer.read().decode()
        extra.close()
        assert why.count("\n") == 1 and "too many live streams" in why
        # other requests still work while every stream slot is taken
        with urllib.request.urlopen(f"{served.base}api/runs?token={served.token}", timeout=30) as r:
            assert r.status == 200
        held.pop().close()  # a client goes away: its slot is free again (once the server sees it gone)

        def admitted() -> _Stream | None:
            s = _Stream(served)
            if s.answer.status == 200:
                return s
            s.close()
            return None

        held.append(wait_for("a freed stream slot", admitted, timeout=30))
        assert held[-1].answer.readline() == b": connected\n"
    finally:
        for s in held:
            s.close()
