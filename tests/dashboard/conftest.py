"""Fixtures for the dashboard: Debian's chromium driven by selenium, a real 2-host local reservation, a served dashboard.

Nothing is mocked: the browser is the real headless chromium (installed with apt-get here if missing,
as tests/ssh/conftest.py installs sshd), the dashboard is the real server on a loopback port, and the
runs are real ranks on real host agents.
"""

from __future__ import annotations

import os
import shutil
import struct
import subprocess
import threading
import time
import zlib
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from monarch_cli.dashboard import Dashboard
from monarch_cli.jobs import Job, serve

CHROMIUM_FLAGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--window-size=1400,900",
]


def _install_chromium() -> None:
    if shutil.which("chromium") and shutil.which("chromedriver"):
        return
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    for cmd in (["apt-get", "update", "-qq"], ["apt-get", "install", "-y", "-qq", "chromium", "chromium-driver"]):
        proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
        if proc.returncode != 0:
            pytest.fail(f"{' '.join(cmd)} failed: {proc.stderr[-2000:]}")


@pytest.fixture(scope="module")
def browser(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    """Headless chromium with a fresh profile; its console log is kept (``get_log('browser')``)."""
    _install_chromium()
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = shutil.which("chromium") or "/usr/bin/chromium"
    for flag in CHROMIUM_FLAGS:
        options.add_argument(flag)
    options.add_argument(f"--user-data-dir={tmp_path_factory.mktemp('chromium-profile')}")
    options.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    driver = webdriver.Chrome(options=options, service=Service(shutil.which("chromedriver") or "/usr/bin/chromedriver"))
    driver.set_page_load_timeout(60)
    yield driver
    driver.quit()


@pytest.fixture(scope="module")
def job(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Job]:
    j = serve(None, hosts=2, state=tmp_path_factory.mktemp("job") / ".monarch" / "job_state.pkl")
    yield j
    j.stop()


class Served:
    """A dashboard serving from a thread of this process."""

    def __init__(self, state: Path) -> None:
        self.dash = Dashboard(state, 0)
        self.thread = threading.Thread(target=self.dash.serve, daemon=True)
        self.thread.start()
        self.url, self.base, self.token = self.dash.url, self.dash.base, self.dash.token

    def stop(self) -> None:
        self.dash.stop()
        self.thread.join(10)


@pytest.fixture(scope="module")
def dashboard(job: Job) -> Iterator[Served]:
    served = Served(job.path)
    yield served
    served.stop()


def wait_for(what: str, check: Callable[[], Any], timeout: float = 60.0) -> Any:
    """Poll ``check`` until it returns something true (events the page shows; no sleeps as assertions)."""
    deadline = time.monotonic() + timeout
    last: Any = None
    while time.monotonic() < deadline:
        try:
            last = check()
        except Exception as e:  # a stale element while the page redraws: look again
            last = e
        else:
            if last:
                return last
        time.sleep(0.1)
    raise AssertionError(f"timed out waiting for {what} (last: {last!r})")


def png_pixels(data: bytes) -> tuple[int, int, int]:
    """(width, height, distinct byte values of the image's decoded rows): a blank page has very few."""
    assert data[:8] == b"\x89PNG\r\n\x1a\n", "not a PNG"
    pos, idat, size = 8, b"", (0, 0)
    while pos < len(data):
        (length,) = struct.unpack(">I", data[pos : pos + 4])
        kind = data[pos + 4 : pos + 8]
        body = data[pos + 8 : pos + 8 + length]
        if kind == b"IHDR":
            size = struct.unpack(">II", body[:8])
        elif kind == b"IDAT":
            idat += body
        pos += 12 + length
    raw = zlib.decompress(idat)
    return size[0], size[1], len(set(raw[:: max(1, len(raw) // 200_000)]))
