"""128 ranks and 100k output lines: the API answers in pages and deltas, and the page keeps only what is in view.

The store is a real one written by the real :class:`TelemetryWriter` (no reservation: the dashboard then shows
the store's history, as it does between runs); the server and the browser are real.
"""

from __future__ import annotations

import json
import threading
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from monarch_cli.dashboard.views import MAX_SERIES_ROWS
from monarch_cli.telemetry import TelemetryWriter, db_path

from .conftest import Served, wait_for

RANKS = 128
LINES = 100_000
RUN = "20260101-000000000-big1"


def _fill(state_dir: Path) -> TelemetryWriter:
    """A run of 128 ranks on 16 hosts: 100k lines (a few with 'needle', one number per line), samples, steps."""
    # A store told to keep every line as it comes (the first half of MONARCH_TELEMETRY_LINES is written live,
    # the last half when the run ends): the page's worst case, far beyond the default sample of 20k lines.
    w = TelemetryWriter(db_path(state_dir), RUN, max_lines=4 * LINES)
    t0 = time.time() - 600
    w.sql(
        "INSERT INTO runs (run_id, command, started_at, world_size, hosts, restarts, interrupted) VALUES (?,?,?,?,?,0,0)",
        (RUN, "torchrun --nnodes=16 --nproc-per-node=8 big.py", t0, RANKS, 16),
    )
    w.rows(
        "ranks",
        [
            (RUN, r, r % 8, r // 8, f"node{r // 8}", None, None, None, None, None, t0, None, None, 0)
            for r in range(RANKS)
        ],
    )
    for i in range(LINES):
        rank = i % RANKS
        text = f"step={i // RANKS} loss={1.0 / (1 + i // RANKS):.4f}" + (" needle" if i % 997 == 0 else "")
        w.output(rank, 1, text.encode() + b"\n")
    w.rows(
        "samples",
        [
            (
                RUN,
                r,
                f"node{r // 8}",
                t0 + s,
                1000 + r,
                "running",
                50.0 + r % 7,
                900.0 + s,
                4,
                None,
                None,
                None,
                None,
                None,
            )
            for s in range(60)
            for r in range(RANKS)
        ],
    )
    w.rows("steps", [(RUN, r, s, t0 + s * 0.5, 500.0 + r) for s in range(1, 200) for r in range(RANKS)])
    w.flush(120)
    return w


@pytest.fixture(scope="module")
def big(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Served, TelemetryWriter]]:
    state = tmp_path_factory.mktemp("big") / ".monarch" / "job_state.pkl"
    writer = _fill(state.parent)
    served = Served(state)
    yield served, writer
    served.stop()
    writer.close()


def _json(served: Served, path: str) -> Any:
    sep = "&" if "?" in path else "?"
    with urllib.request.urlopen(f"{served.base}{path}{sep}token={served.token}", timeout=30) as r:
        return json.loads(r.read())


@pytest.mark.slow
def test_the_api_pages_filters_and_sends_deltas(big: tuple[Served, TelemetryWriter]) -> None:
    served, writer = big
    tail = _json(served, f"api/runs/{RUN}/logs")
    assert len(tail["lines"]) == 1000 and tail["more"]
    assert tail["lines"][-1]["line"].startswith(f"step={(LINES - 1) // RANKS} ")
    ids = [l["id"] for l in tail["lines"]]
    assert ids == sorted(ids)
    earlier = _json(served, f"api/runs/{RUN}/logs?before={ids[0]}&limit=500")
    assert len(earlier["lines"]) == 500 and earlier["lines"][-1]["id"] < ids[0]
    only = _json(served, f"api/runs/{RUN}/logs?ranks=5,7-8&limit=5000")
    assert {l["rank"] for l in only["lines"]} == {5, 7, 8}
    assert len(only["lines"]) == sum(len(range(r, LINES, RANKS)) for r in (5, 7, 8)) and not only["more"]
    found = _json(served, f"api/runs/{RUN}/logs?q=NEEDLE&limit=5000")
    assert len(found["lines"]) == len(range(0, LINES, 997)) and all("needle" in l["line"] for l in found["lines"])
    # the series: every rank's samples and steps, and the printed numbers (loss, step) parsed from output,
    # in bounded answers that each name the cursors of the next
    series = _json(served, f"api/runs/{RUN}/series")
    samples, steps, losses = series["samples"], series["steps"], series["numbers"]["loss"]
    assert series["more"] and len(steps) == MAX_SERIES_ROWS
    while series["more"]:
        c = series["cursors"]
        series = _json(served, f"api/runs/{RUN}/series?samples={c['samples']}&steps={c['steps']}&logs={c['logs']}")
        samples, steps, losses = (
            samples + series["samples"],
            steps + series["steps"],
            losses + series["numbers"].get("loss", []),
        )
    assert len(samples) == 60 * RANKS and len(steps) == 199 * RANKS
    assert {r for r, _, _ in losses} == set(range(RANKS))
    c = series["cursors"]
    again = _json(served, f"api/runs/{RUN}/series?samples={c['samples']}&steps={c['steps']}&logs={c['logs']}")
    assert again["samples"] == [] and again["steps"] == [] and again["numbers"] == {} and not again["more"]

    # live: the event stream sends only the lines written after the cursor, filtered as asked
    last = ids[-1]
    got: list[dict] = []
    opened = threading.Event()

    def follow() -> None:
        url = f"{served.base}api/events?token={served.token}&run={RUN}&after={last}&ranks=3"
        with urllib.request.urlopen(url, timeout=60) as stream:
            opened.set()
            kind = None
            for raw in stream:
                line = raw.decode().rstrip("\n")
                if line.startswith("event: "):
                    kind = line[7:]
                elif line.startswith("data: ") and kind == "logs":
                    got.extend(json.loads(line[6:])["lines"])
                    if any(l["line"] == "new 9" for l in got):
                        return

    reader = threading.Thread(target=follow, daemon=True)
    reader.start()
    assert opened.wait(30)
    for i in range(10):
        writer.output(3, 1, f"new {i}\n".encode())
        writer.output(4, 1, f"other {i}\n".encode())
    writer.flush(30)
    reader.join(60)
    assert [l["line"] for l in got] == [f"new {i}" for i in range(10)], got


@pytest.mark.slow
def test_the_page_stays_small_with_128_ranks_and_100k_lines(big: tuple[Served, TelemetryWriter], browser) -> None:  # type: ignore[no-untyped-def]
    from selenium.webdriver.common.by import By

    served, _ = big
    browser.get(served.url + f"#/run/{RUN}")
    wait_for("the output's tail", lambda: browser.find_elements(By.CSS_SELECTOR, "#log .row"))
    rows = browser.find_elements(By.CSS_SELECTOR, "#log .row")
    assert 10 < len(rows) < 200, len(rows)  # only the rows in view (and a margin) are in the page
    assert "2,000 line(s) loaded" in browser.find_element(By.ID, "line-count").text
    # the exit table shows the ranks that did not exit 0 (all 128 run here), the rest is summarised
    assert "128 ranks" in browser.find_element(By.ID, "exit-table").find_element(By.XPATH, "..").text
    # scrolling to the top loads the page before
    browser.execute_script("document.getElementById('log').scrollTop = 0")
    wait_for("earlier lines", lambda: "4,000 line(s) loaded" in browser.find_element(By.ID, "line-count").text)
    browser.find_element(By.ID, "rank-filter").send_keys("127")
    wait_for(
        "rank 127 only",
        lambda: (
            (t := [r.text for r in browser.find_elements(By.CSS_SELECTOR, "#log .row")])
            and all(x.startswith("[rank127]") for x in t)
        ),
    )
    # plots of 128 ranks: one series per rank, legend hidden
    browser.execute_script("location.hash = arguments[0]", f"#/plots/{RUN}")
    n = wait_for(
        "the CPU plot",
        lambda: browser.execute_script(
            "const c = window.monarchCharts && window.monarchCharts['CPU (%)']; return c ? c.plot.series.length - 1 : 0"
        ),
    )
    assert n == RANKS
    assert browser.execute_script("return window.monarchCharts['loss'].plot.data[0].length") > 100
    errors = [e for e in browser.get_log("browser") if e["level"] in ("SEVERE", "WARNING")]
    assert not errors, errors
