"""The processes ``benchmarks/frameworks.py`` times: cold torchrun, and one reservation's CLI runs.

Every process here is a whole ``python`` process started the way a user starts it; nothing is
timed in this process. A process that fails or hangs raises :class:`CaseFailed`, so that one
broken case leaves its row saying so while the other cases still run.
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SCRIPTS = REPO / "benchmarks" / "frameworks"
MONARCH = [sys.executable, "-m", "monarch_cli"]
CHECKSUM = re.compile(r"param-checksum ([0-9a-f]{64})")
OWN = re.compile(r"script-seconds ([0-9.]+)")
#: The full ML environment of every GPU image: transformers imports these when they are installed.
FULL_ENV = ("pyarrow", "sklearn", "datasets")


class CaseFailed(Exception):
    """A process of one case failed or hung; the message is one line, its output went to stderr."""


@dataclass(frozen=True)
class Layout:
    """``HxR``: H hosts (local ones, for monarch; torchrun nodes, cold) x R ranks per host."""

    hosts: int
    ranks: int

    @classmethod
    def parse(cls, text: str) -> Layout:
        hosts, sep, ranks = text.strip().partition("x")
        if not (sep and hosts.isdigit() and ranks.isdigit() and int(hosts) > 0 and int(ranks) > 0):
            raise SystemExit(f"layout {text!r}: HOSTSxRANKS, e.g. 1x2")
        return cls(int(hosts), int(ranks))

    def __str__(self) -> str:
        return f"{self.hosts}x{self.ranks}"

    @property
    def label(self) -> str:
        hosts = "1 host" if self.hosts == 1 else f"{self.hosts} local hosts"
        return f"{hosts} x {self.ranks} rank{'s' if self.ranks > 1 else ''}"


@dataclass(frozen=True)
class Run:
    """One whole process tree's wall time and its output."""

    seconds: float
    text: str

    @property
    def checksum(self) -> str | None:
        found = set(CHECKSUM.findall(self.text))
        return found.pop() if len(found) == 1 else None

    @property
    def own(self) -> float | None:
        """The least ``script-seconds`` any rank printed: the rank that started last waited for no other."""
        times = [float(t) for t in OWN.findall(self.text)]
        return min(times) if times else None


def _popen(cmd: list[str], cwd: Path, env: dict[str, str]) -> subprocess.Popen[str]:
    return subprocess.Popen(
        cmd, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True
    )


def _finish(procs: list[subprocess.Popen[str]], what: str, timeout: float) -> str:
    """Wait for every process; their output together. A failure or a hang kills them all."""
    out, deadline = [], time.monotonic() + timeout
    try:
        for p in procs:
            stdout, stderr = p.communicate(timeout=max(1.0, deadline - time.monotonic()))
            out.append(stdout + stderr)
            if p.returncode != 0:
                print(f"--- {what} failed ({p.returncode}):\n{(stdout + stderr)[-4000:]}", file=sys.stderr, flush=True)
                raise CaseFailed(f"{what} failed (exit {p.returncode})")
    except subprocess.TimeoutExpired:
        raise CaseFailed(f"{what} hung (over {timeout:.0f} s)") from None
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)  # its own session: the ranks it started go too
                p.wait()
    return "\n".join(out)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def cold(script: Path, layout: Layout, cwd: Path, env: dict[str, str], timeout: float) -> Run:
    """Cold torchrun: ``--standalone`` on 1 host; on H hosts, H ``torchrun --nnodes=H --node-rank=i``
    started together, one per host."""
    run = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={layout.ranks}"]
    t = time.perf_counter()
    if layout.hosts == 1:
        procs = [_popen([*run, "--standalone", str(script)], cwd, env)]
    else:
        port = _free_port()
        rendezvous = [f"--nnodes={layout.hosts}", "--master-addr=127.0.0.1", f"--master-port={port}"]
        procs = [_popen([*run, *rendezvous, f"--node-rank={i}", str(script)], cwd, env) for i in range(layout.hosts)]
    text = _finish(procs, f"cold torchrun of {script.stem}", timeout)
    return Run(time.perf_counter() - t, text)


class Reservation:
    """One ``monarch serve`` of one script in its own workspace, state file and cache: what a user
    sees serving this script for the first time."""

    def __init__(self, cwd: Path, script: Path, layout: Layout, env: dict[str, str], keep_ranks: bool) -> None:
        self.cwd, self.layout, self.keep_ranks = cwd, layout, keep_ranks
        cwd.mkdir(parents=True)
        self.env = {
            **env,
            "MONARCH_STATE": str(cwd / ".monarch" / "job_state.pkl"),
            "MONARCH_CACHE_DIR": str(cwd / "cache"),
        }
        self.command = ["torchrun", f"--nproc-per-node={layout.ranks}", str(script)]

    def serve(self, timeout: float) -> float:
        t = time.perf_counter()
        cmd = [*MONARCH, "serve", "--hosts", str(self.layout.hosts), "--", *self.command]
        _finish([_popen(cmd, self.cwd, self.env)], "monarch serve", timeout)
        return time.perf_counter() - t

    def run(self, timeout: float) -> Run:
        """One whole CLI process: ``monarch run-spmd [--keep-ranks]``, the served command."""
        cmd = [*MONARCH, "run-spmd", *(["--keep-ranks"] if self.keep_ranks else [])]
        t = time.perf_counter()
        text = _finish([_popen(cmd, self.cwd, self.env)], "monarch run-spmd", timeout)
        return Run(time.perf_counter() - t, text)

    def modules(self) -> str:
        """The modules the hosts' warm processes hold now (``monarch warm --json``, asked once)."""
        done = subprocess.run([*MONARCH, "warm", "--json"], cwd=self.cwd, env=self.env, capture_output=True, text=True)
        try:
            return str(sum(h["warm"]["modules"] for h in json.loads(done.stdout)["hosts"]))
        except (ValueError, KeyError, TypeError):
            return "?"

    def stop(self) -> None:
        subprocess.run([*MONARCH, "stop"], cwd=self.cwd, env=self.env, capture_output=True)


def missing_full_env() -> list[str]:
    """Which of :data:`FULL_ENV` do not import in a fresh interpreter (this one stays light)."""
    code = "import importlib, sys\nfor m in sys.argv[1:]:\n    try: importlib.import_module(m)\n"
    code += "    except Exception: print(m)\n"
    done = subprocess.run([sys.executable, "-c", code, *FULL_ENV], capture_output=True, text=True, check=True)
    return done.stdout.split()


def gpus() -> tuple[int, str]:
    """CUDA devices torch sees (0 without torch's CUDA) and the first one's name, asked in a fresh
    interpreter: this one never initialises CUDA."""
    code = "import torch\nn = torch.cuda.device_count() if torch.cuda.is_available() else 0\n"
    code += "print(n, torch.cuda.get_device_name(0) if n else '')"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    count, _, name = done.stdout.strip().partition(" ")
    return (int(count), name) if done.returncode == 0 and count.isdigit() else (0, "")


def has_keep_ranks(env: dict[str, str]) -> bool:
    """Whether this build's ``monarch run-spmd`` accepts ``--keep-ranks`` (its help says)."""
    done = subprocess.run(
        [*MONARCH, "run-spmd", "--help"], env={**env, "COLUMNS": "200"}, capture_output=True, text=True
    )
    return "--keep-ranks" in done.stdout


def interpreter_start(*flags: str) -> float:
    """Median of 7 ``python -c pass``: the part of a CLI run's overhead that is the interpreter
    and this environment's site-packages (``.pth`` files run at every start)."""
    times = []
    for _ in range(7):
        t = time.perf_counter()
        subprocess.run([sys.executable, *flags, "-c", "pass"], check=True)
        times.append(time.perf_counter() - t)
    return statistics.median(times)
