"""Fixtures for SPMD tests: one real local reservation (2 host agents) per test module.

Nothing is mocked: ranks are real processes forked from the agents' zygotes (warm) or
fresh interpreters (cold), running real torch with gloo on the CPU.
"""

from __future__ import annotations

import dataclasses
import io
import queue
import re
import subprocess
import threading
import time
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path
from typing import IO

import psutil
import pytest

from monarch_cli.jobs import Job, RunResult, serve
from monarch_cli.jobs.run_log import rank_log

PREFIX = re.compile(rb"^\[(rank\d+|local\d+)\] ")  # labels of equal width: one space


@pytest.fixture(scope="module")
def job_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("job")


@pytest.fixture(scope="module")
def job(job_dir: Path) -> Iterator[Job]:
    """One 2-host local reservation shared by every test of a module, released at the end."""
    j = serve(None, hosts=2, state=job_dir / ".monarch" / "job_state.pkl")
    yield j
    j.stop()


@dataclasses.dataclass
class Run:
    result: RunResult
    out: bytes
    err: bytes
    elapsed: float

    def log(self, rank: int) -> bytes:
        return rank_log(self.result.log_dir, rank).read_bytes()

    def lines(self, stream: str = "out") -> list[bytes]:
        return (self.out if stream == "out" else self.err).splitlines()

    def text(self) -> str:
        return (self.out + self.err).decode("utf-8", "backslashreplace")

    def by_rank(self, stream: str = "out") -> dict[str, list[bytes]]:
        """Console lines grouped by their [label] prefix, prefix removed (order kept)."""
        grouped: dict[str, list[bytes]] = {}
        for line in self.lines(stream):
            m = PREFIX.match(line)
            assert m, f"console line without a rank prefix: {line!r}"
            grouped.setdefault(m.group(1).decode(), []).append(line[m.end() :])
        return grouped


def spmd(
    job: Job,
    script: Path,
    *args: str,
    nproc: int = 2,
    flags: Sequence[str] = (),
    cold: bool = False,
    ranks: set[int] | None = None,
    grace: float = 3.0,
    notices: list[str] | None = None,
    stall_timeout: float | None = None,
) -> Run:
    """``torchrun --nproc-per-node=N [flags] script args`` on the reservation, console captured."""
    out, err = io.BytesIO(), io.BytesIO()
    command = ["torchrun", f"--nproc-per-node={nproc}", *flags, str(script), *args]
    started = time.monotonic()
    result = job.run_spmd(
        command,
        cold=cold,
        ranks=ranks,
        stdout=out,
        stderr=err,
        grace=grace,
        on_event=None if notices is None else notices.append,
        stall_timeout=stall_timeout,
    )
    return Run(result, out.getvalue(), err.getvalue(), time.monotonic() - started)


def reservation_pids(job: Job) -> set[int]:
    """The agents of a reservation and every process under them right now."""
    pids: set[int] = set()
    for host in job.state.hosts:
        try:
            agent = psutil.Process(host.pid)
        except psutil.NoSuchProcess:
            continue
        pids.add(agent.pid)
        pids.update(p.pid for p in agent.children(recursive=True))
    return pids


def living(pids: Iterable[int]) -> list[str]:
    """Descriptions of the processes among ``pids`` still alive (zombies count as gone)."""
    left = []
    for pid in pids:
        try:
            p = psutil.Process(pid)
            if p.status() != psutil.STATUS_ZOMBIE:
                left.append(f"{pid}: {' '.join(p.cmdline())}")
        except psutil.NoSuchProcess:
            pass
    return left


def wait_warm(job: Job, timeout: float = 90.0) -> list[dict]:
    """Wait until every host's warm process holds what its runs taught it; returns their info."""

    def settled() -> bool:
        warm = [h["warm"] for h in job.status()["hosts"]]
        return all(w and w["ready"] and not w["warming"] and w["learned_held"] > 0 for w in warm)

    deadline = time.monotonic() + timeout
    while not settled():
        assert time.monotonic() < deadline, f"warm processes never settled: {job.status()['hosts']}"
        time.sleep(0.2)
    return [h["warm"] for h in job.status()["hosts"]]


class ConsoleReader:
    """A process whose console is read line by line by a thread (so a test never blocks on it),
    killed on leaving the ``with`` block if still running: a failed assertion leaves no run going."""

    what = "the process"

    def __init__(self, proc: subprocess.Popen[bytes], console: IO[bytes]) -> None:
        self.proc = proc
        self.lines: queue.Queue[str] = queue.Queue()
        self.seen: list[str] = []
        threading.Thread(target=self._read_lines, args=(console,), daemon=True).start()

    def __enter__(self) -> ConsoleReader:
        return self

    def __exit__(self, *_: object) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)

    def _read_lines(self, stream: IO[bytes]) -> None:
        for raw in stream:
            self.lines.put(raw.decode(errors="replace").rstrip("\n"))

    def wait_for(self, text: str, count: int = 1, timeout: float = 30) -> None:
        deadline = time.monotonic() + timeout
        while sum(text in line for line in self.seen) < count:
            left = deadline - time.monotonic()
            if left <= 0:
                raise AssertionError(f"waited {timeout} s for {count} x {text!r}; got {self.seen}")
            try:
                self.seen.append(self.lines.get(timeout=left))
            except queue.Empty:
                pass

    def finish(self, timeout: float) -> int:
        try:
            code = self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            raise AssertionError(f"{self.what} did not exit within {timeout} s; console: {self.seen}")
        self._finished()
        time.sleep(0.1)
        while not self.lines.empty():
            self.seen.append(self.lines.get())
        return code

    def _finished(self) -> None:
        """Subclasses: wait for whatever else they read."""
