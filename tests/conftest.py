"""Shared fixtures: real agents, real procs, real sockets; nothing of the runtime is mocked."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path

import psutil
import pytest

from monarch_cli.runtime.launch.start import launch_agent
from monarch_cli.runtime.mailbox.mailbox import Mailbox
from monarch_cli.runtime.transport.keys import Keys

REPO = Path(__file__).resolve().parents[1]

# A suite started as a background job of a non-interactive shell (`.ci/run &`) inherits SIGINT
# and SIGQUIT ignored, and would hand that to every process it starts: the Ctrl-C tests would
# then test the shell. (tests/jobs/test_inherited_signals.py covers a client started so.)
if signal.getsignal(signal.SIGINT) == signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)
if signal.getsignal(signal.SIGQUIT) == signal.SIG_IGN:
    signal.signal(signal.SIGQUIT, signal.SIG_DFL)


@pytest.fixture(scope="session", autouse=True)
def private_warm_cache(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """What agents learn about ranks' imports stays in this session, not in ~/.cache."""
    path = tmp_path_factory.mktemp("monarch-cache")
    old = os.environ.get("MONARCH_CACHE_DIR")
    os.environ["MONARCH_CACHE_DIR"] = str(path)
    yield path
    if old is None:
        os.environ.pop("MONARCH_CACHE_DIR", None)
    else:
        os.environ["MONARCH_CACHE_DIR"] = old


@pytest.fixture(scope="module", autouse=True)
def no_mailbox_outlives_its_module() -> Iterator[None]:
    """Reservations a module stopped through the CLI (another process) leave this process's
    mailboxes for their keys behind; close them, so their threads do not pile up in pytest."""
    yield
    for keys in list(Mailbox._by_keys):
        Mailbox.discard(keys)


@pytest.fixture(scope="session")
def keys() -> Keys:
    return Mailbox.get().keys


@pytest.fixture(scope="session")
def agents(keys: Keys) -> Iterator[list[str]]:
    """Two host agents on this machine, reporting themselves as host0 and host1."""
    procs, addrs = [], []
    for i in range(2):
        proc, addr = launch_agent(keys, name=f"host{i}")
        procs.append(proc)
        addrs.append(addr)
    yield addrs
    for proc in procs:
        proc.stdin.close()
        proc.wait(10)


def wait_until(predicate: Callable[[], bool], timeout: float, interval: float = 0.05) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(interval)
    return predicate()


def alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def all_gone(pids: Iterable[int]) -> bool:
    return not any(alive(p) for p in pids)


def run_python(code: str, *args: str, timeout: float = 120, **kwargs) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code), *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=REPO,
        **kwargs,
    )


def spawn_python(code: str, *args: str, env: dict[str, str] | None = None, **kwargs) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-u", "-c", textwrap.dedent(code), *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=REPO,
        env={**os.environ, **(env or {}), "PYTHONPATH": str(REPO)},
        **kwargs,
    )


def write_script(directory: Path, name: str, code: str) -> Path:
    """Write dedented ``code`` to ``directory/name`` (parents made) and return the path."""
    path = directory / name
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(textwrap.dedent(code).lstrip())
    return path


def one_line_error(done: subprocess.CompletedProcess, *needles: str) -> str:
    """Assert a clean failure: non-zero, one `monarch: error:` line, no traceback; return it."""
    assert done.returncode != 0, done.stdout + done.stderr
    assert "Traceback" not in done.stderr, done.stderr
    lines = [l for l in done.stderr.splitlines() if l.strip()]
    assert len(lines) == 1 and lines[0].startswith("monarch: error:"), done.stderr
    for needle in needles:
        assert needle in lines[0], lines[0]
    return lines[0]


def assert_golden(path: Path, text: str) -> str:
    """``text`` must equal the committed golden file ``path``; MONARCH_UPDATE_GOLDEN=1 rewrites it."""
    if os.environ.get("MONARCH_UPDATE_GOLDEN"):
        path.write_text(text)
    assert path.exists(), f"no golden file {path}; run with MONARCH_UPDATE_GOLDEN=1 to create it"
    assert text == path.read_text(), f"{path.name} differs from its golden file (MONARCH_UPDATE_GOLDEN=1 to accept)"
    return text
