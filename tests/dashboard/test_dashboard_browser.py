"""The dashboard in a real headless chromium, during a real run on a real 2-host local reservation."""

from __future__ import annotations

import os
import re
import threading
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from monarch_cli.jobs import Job

from .conftest import Served, png_pixels, wait_for

REPO = Path(__file__).resolve().parents[2]
DOCS_IMG = REPO / "docs" / "img"

#: Steps an optimizer and prints key=value numbers until told to stop; rank 3 waits somewhere else
#: than the others, so `monarch stack` has two groups.
SCRIPT = """
import os, sys, time
import torch

rank = int(os.environ["RANK"])
stop = sys.argv[1]
model = torch.nn.Linear(8, 1)
opt = torch.optim.SGD(model.parameters(), lr=0.05)
x, y = torch.randn(64, 8), torch.randn(64, 1)


def train_step(step):
    loss = (model(x) - y).pow(2).mean()
    opt.zero_grad()
    loss.backward()
    opt.step()
    print(f"step={step} loss={loss.item():.4f}", flush=True)
    if step % 5 == 0:
        print(f"rank {rank} still going", file=sys.stderr, flush=True)


def slow_rank():
    time.sleep(0.25)


step = 0
while not os.path.exists(stop):
    step += 1
    train_step(step)
    if rank == 3:
        slow_rank()
    else:
        time.sleep(0.25)
"""


def _get(url: str, data: bytes | None = None) -> int:
    try:
        with urllib.request.urlopen(urllib.request.Request(url, data=data), timeout=10) as r:
            return r.status
    except urllib.error.HTTPError as e:
        return e.code


def _shoot(browser, name: str, tmp: Path) -> None:  # type: ignore[no-untyped-def]
    """A screenshot of the page into tmp (checked non-blank) and, with MONARCH_DOCS_SCREENSHOTS=1, into docs/img."""
    png = browser.get_screenshot_as_png()
    width, height, distinct = png_pixels(png)
    assert width >= 800 and height >= 600 and distinct > 20, f"the {name} page looks blank ({distinct} values)"
    (tmp / f"dashboard-{name}.png").write_bytes(png)
    if os.environ.get("MONARCH_DOCS_SCREENSHOTS") == "1":
        DOCS_IMG.mkdir(parents=True, exist_ok=True)
        (DOCS_IMG / f"dashboard-{name}.png").write_bytes(png)


def _row(browser, run_id: str) -> str:  # type: ignore[no-untyped-def]
    """The runs table's row of a run, read in one step (rows are redrawn every second while a run goes on)."""
    return browser.execute_script(
        "const r = document.querySelector(`tr[data-run='${arguments[0]}']`); return r ? r.innerText : ''", run_id
    )


def _run_ids(browser) -> set[str]:  # type: ignore[no-untyped-def]
    return set(browser.execute_script("return [...document.querySelectorAll('tr[data-run]')].map(r => r.dataset.run)"))


def _go(browser, dashboard: Served, route: str) -> None:  # type: ignore[no-untyped-def]
    browser.execute_script("location.hash = arguments[0]", route)
    wait_for(
        f"page {route}",
        lambda: browser.execute_script(
            "return document.getElementById('main').dataset.ready === '1' && location.hash === arguments[0]", route
        ),
    )


@pytest.mark.slow
def test_without_the_token_everything_is_403(dashboard: Served) -> None:
    base = dashboard.base
    for path in (
        "",
        "static/app.js",
        "static/uPlot.iife.min.js",
        "api/runs",
        "api/hosts",
        "api/events",
        "openapi.json",
    ):
        assert _get(base + path) == 403, path
        assert _get(base + path + "?token=wrong") == 403, path
    assert _get(base + "api/stacks", data=b"") == 403
    assert _get(f"{base}api/runs?token={dashboard.token}") == 200
    # the Host header must be the loopback name it listens on (no DNS rebinding)
    req = urllib.request.Request(
        f"{base}api/runs?token={dashboard.token}", headers={"Host": f"evil.example:{dashboard.dash.port}"}
    )
    with pytest.raises(urllib.error.HTTPError) as e:
        urllib.request.urlopen(req, timeout=10)
    assert e.value.code == 403


@pytest.mark.slow
def test_a_live_run_in_the_browser(job: Job, dashboard: Served, browser, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    from selenium.webdriver.common.by import By

    script = tmp_path / "train.py"
    script.write_text(SCRIPT)
    stop = tmp_path / "stop"
    # the 403 page in the browser too
    browser.get(dashboard.base)
    assert "forbidden" in browser.find_element(By.TAG_NAME, "body").text
    assert any("403" in e["message"] for e in browser.get_log("browser"))  # read (and so cleared) here
    browser.get(dashboard.url)
    wait_for(
        "the runs page", lambda: browser.execute_script("return document.getElementById('main').dataset.ready === '1'")
    )
    before = _run_ids(browser)

    # an earlier run that failed: the runs page shows history with its exit summary
    (tmp_path / "fail.py").write_text(
        "import os, sys\nprint('loading data')\nsys.exit(3 if os.environ['RANK'] == '1' else 0)\n"
    )
    failed = job.run_spmd(
        ["torchrun", "--nproc-per-node=2", str(tmp_path / "fail.py")],
        stdout=open(os.devnull, "wb"),
        stderr=open(os.devnull, "wb"),
    )
    assert failed.exit_code == 3
    wait_for(
        "the failed run's row",
        lambda: "exit 3" in _row(browser, failed.run_id),
    )
    before = _run_ids(browser)

    result: dict = {}
    run = threading.Thread(
        target=lambda: result.setdefault(
            "r",
            job.run_spmd(
                ["torchrun", "--nproc-per-node=2", str(script), str(stop)],
                stdout=open(os.devnull, "wb"),
                stderr=open(os.devnull, "wb"),
            ),
        ),
        daemon=True,
    )
    run.start()
    try:
        # the run appears on the open page, live (no reload)
        row = wait_for(
            "the new run's row",
            lambda: sorted(_run_ids(browser) - before),
        )[0]
        text = _row(browser, run_id := row)
        assert "running" in text and "train.py" in text
        wait_for(
            "a few steps of every rank",
            lambda: len(job.sql("SELECT DISTINCT rank FROM steps WHERE run_id = ? AND step >= 8", (run_id,))) == 4,
            timeout=120,
        )
        _shoot(browser, "runs", tmp_path)

        # output: every rank's lines, terminal-style labels; filter by rank, then search
        _go(browser, dashboard, f"#/run/{run_id}")
        rows = lambda: browser.execute_script(  # noqa: E731 - read at once: rows are redrawn as lines arrive
            "return [...document.querySelectorAll('#log .row')].map(r => r.innerText)"
        )
        wait_for(
            "lines of all 4 ranks",
            lambda: {t.split("]")[0] for t in rows()} >= {"[rank0", "[rank1", "[rank2", "[rank3"},
        )
        _shoot(browser, "run", tmp_path)
        browser.find_element(By.ID, "rank-filter").send_keys("1")
        wait_for("only rank 1's lines", lambda: rows() and all(t.startswith("[rank1]") for t in rows()))

        def newest_step() -> int:
            return max(int(m.group(1)) for t in rows() if (m := re.search(r"step=(\d+)", t)))

        seen = newest_step()
        wait_for(
            "rank 1's next lines, live", lambda: newest_step() > seen and all(t.startswith("[rank1]") for t in rows())
        )
        browser.find_element(By.ID, "search").send_keys("still going")
        wait_for(
            "only rank 1's stderr lines",
            lambda: rows() and all(t.startswith("[rank1]") and "still going" in t for t in rows()),
        )
        assert browser.find_elements(By.CSS_SELECTOR, "#log .row.err mark")

        # plots: step time and the printed loss have points per rank
        _go(browser, dashboard, f"#/plots/{run_id}")
        for metric in ("step time (ms)", "CPU (%)", "RSS (MiB)", "loss"):
            wait_for(
                f"points on the {metric} plot",
                lambda m=metric: (
                    browser.execute_script(
                        "const c = window.monarchCharts && window.monarchCharts[arguments[0]];"
                        "return c ? c.plot.data.slice(1).filter(s => s.some(v => v !== null)).length : 0",
                        m,
                    )
                    == 4
                ),
            )
        assert not browser.find_elements(By.CSS_SELECTOR, "[data-metric='GPU utilisation (%)']")  # no GPU here
        _shoot(browser, "plots", tmp_path)

        # stacks, captured on demand, grouped: ranks 0-2 in train_step's sleep, rank 3 in slow_rank
        _go(browser, dashboard, "#/stacks")

        def two_groups() -> list[str] | None:
            """The groups once a capture caught every rank in its sleep; else capture again (a
            rank sampled inside train_step, as a loaded machine sometimes catches it, is a group
            of its own, which the page shows faithfully)."""
            groups = [e.text for e in browser.find_elements(By.CSS_SELECTOR, "#stack-groups .group summary")]
            if len(groups) == 2 and groups[0].startswith("3 ranks (0-2)") and "slow_rank" in groups[1]:
                return groups
            button = browser.find_elements(By.ID, "capture")
            if groups and button and button[0].is_enabled():
                button[0].click()
            return None

        groups = wait_for("two stack groups", two_groups, timeout=90)
        assert groups[1].startswith("1 rank (3)") and "slow_rank" in groups[1], groups
        _shoot(browser, "stacks", tmp_path)

        _go(browser, dashboard, "#/diagnose")
        verdict = wait_for("a verdict", lambda: browser.find_element(By.ID, "verdict").text, timeout=90)
        assert verdict in ("healthy", "suspect found", "cannot tell")
        _shoot(browser, "diagnose", tmp_path)

        _go(browser, dashboard, "#/hosts")
        hosts = wait_for(
            "both hosts alive",
            lambda: [r.text for r in browser.find_elements(By.CSS_SELECTOR, "table tr") if "alive" in r.text],
        )
        assert len(hosts) == 2, hosts
        _shoot(browser, "hosts", tmp_path)

        # the end of the run shows on the runs page, live
        _go(browser, dashboard, "#/runs")
        stop.write_text("")
        run.join(120)
        assert result["r"].exit_code == 0
        wait_for(
            "the run's row says ok",
            lambda: "ok" in _row(browser, run_id).split(),
        )
    finally:
        stop.write_text("")
        run.join(120)
    errors = [e for e in browser.get_log("browser") if e["level"] in ("SEVERE", "WARNING")]
    assert not errors, errors
