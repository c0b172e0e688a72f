"""Real training frameworks: cold torchrun vs ``monarch run-spmd``, side by side in one run.

    python benchmarks/frameworks.py [--repeats 3] [--cold-repeats 2] [--only hf_trainer,...] [--layouts 1x2,2x1]

The four scripts of ``benchmarks/frameworks/`` (Hugging Face Trainer with a tiny GPT-2 from a
config, Lightning ``strategy="ddp"``, an Accelerate loop, an FSDP2/DTensor trainer), CPU and gloo,
each on 1 host x 2 ranks and on 2 local hosts x 1 rank. For each, in this order and this process:

* **cold torchrun**: ``torchrun --standalone --nproc-per-node=2`` on 1 host; on 2 hosts, two
  ``torchrun --nnodes=2 --nproc-per-node=1 --node-rank=i`` started together (one per host);
* **first run**: ``monarch serve`` once, then the first ``monarch run-spmd`` (whole CLI process);
  its warm process holds torch only, as on any first run of a new script;
* **warm re-run**: after the warm processes have learned the script's imports (runs until
  ``monarch warm --json`` says they settled), ``--repeats`` whole CLI processes;
* **script's own work**: the least ``script-seconds`` a rank prints (from its first line to its
  end, its ``atexit`` teardown included, in a warm rank that imported everything already; the rank that started last waited for no other,
  while rank 0's time includes waiting for it in the rendezvous); **overhead** is the warm
  re-run minus it;
* **checksums**: every run's ``param-checksum`` must equal cold torchrun's, else the benchmark fails.

Targets (issue 22): warm re-run >= 15x faster than cold torchrun; first run no slower than it;
overhead <= 0.15 s.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from _common import print_table

REPO = Path(__file__).resolve().parents[1]
SCRIPTS = REPO / "benchmarks" / "frameworks"
NAMES = ["hf_trainer", "lightning_ddp", "accelerate_loop", "fsdp2_trainer"]
CHECKSUM = re.compile(r"param-checksum ([0-9a-f]{64})")
OWN = re.compile(r"script-seconds ([0-9.]+)")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _check(procs: list[subprocess.Popen[str]], what: str) -> str:
    out = []
    for p in procs:
        try:
            stdout, stderr = p.communicate(timeout=600)
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            raise SystemExit(f"{what} hung (over 600 s)") from None
        if p.returncode != 0:
            raise SystemExit(f"{what} failed ({p.returncode}):\n{stdout[-3000:]}\n{stderr[-3000:]}")
        out.append(stdout + stderr)
    return "\n".join(out)


class Case:
    """One script on one layout: its own directory and reservation."""

    def __init__(self, root: Path, name: str, hosts: int, env: dict[str, str]) -> None:
        self.name, self.hosts = name, hosts
        self.nproc = 2 // hosts
        self.cwd = root / f"{name}-{hosts}"
        self.cwd.mkdir()
        self.env = {**env, "MONARCH_STATE": str(self.cwd / ".monarch" / "job_state.pkl")}
        self.monarch = [sys.executable, "-m", "monarch_cli"]
        self.script = str(SCRIPTS / f"{name}.py")

    def _popen(self, cmd: list[str]) -> subprocess.Popen[str]:
        return subprocess.Popen(
            cmd, cwd=self.cwd, env=self.env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
        )

    def cold(self) -> tuple[float, str]:
        run = [sys.executable, "-m", "torch.distributed.run"]
        t = time.perf_counter()
        if self.hosts == 1:
            procs = [self._popen([*run, "--standalone", "--nproc-per-node=2", self.script])]
        else:
            port = _free_port()
            procs = [
                self._popen(
                    [
                        *run,
                        "--nnodes=2",
                        "--nproc-per-node=1",
                        f"--node-rank={i}",
                        "--master-addr=127.0.0.1",
                        f"--master-port={port}",
                        self.script,
                    ]
                )
                for i in range(2)
            ]
        text = _check(procs, f"cold torchrun of {self.name}")
        return time.perf_counter() - t, text

    def serve(self) -> None:
        _check([self._popen([*self.monarch, "serve", "--hosts", str(self.hosts)])], "monarch serve")

    def monarch_run(self) -> tuple[float, str]:
        t = time.perf_counter()
        text = _check(
            [self._popen([*self.monarch, "run-spmd", "--", "torchrun", f"--nproc-per-node={self.nproc}", self.script])],
            f"monarch run-spmd of {self.name}",
        )
        return time.perf_counter() - t, text

    def warm(self) -> list[dict]:
        done = subprocess.run(
            [*self.monarch, "warm", "--json"], cwd=self.cwd, env=self.env, capture_output=True, text=True
        )
        try:  # a loaded machine can make an agent late to answer: settle() asks again
            return [h.get("warm") for h in json.loads(done.stdout)["hosts"]]
        except (ValueError, KeyError, TypeError):
            print(f"  (monarch warm: {done.stdout.strip()} {done.stderr.strip()}; asking again)", flush=True)
            return [None]

    def settle(self, timeout: float = 900) -> list[dict]:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            warm = self.warm()
            if all(w and w["ready"] and not w["warming"] and w["learned_held"] for w in warm):
                return warm
            time.sleep(1)
        raise SystemExit(f"{self.name}: the warm processes did not settle within {timeout:.0f} s")

    def stop(self) -> None:
        subprocess.run([*self.monarch, "stop"], cwd=self.cwd, env=self.env, capture_output=True)


def _sum(text: str, what: str) -> str:
    found = CHECKSUM.findall(text)
    if len(found) != 1:
        raise SystemExit(f"{what}: no checksum in its output:\n{text[-3000:]}")
    return found[0]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--repeats", type=int, default=3, help="warm re-runs per case")
    parser.add_argument("--cold-repeats", type=int, default=2, help="cold torchrun runs per case")
    parser.add_argument("--only", default=",".join(NAMES))
    parser.add_argument("--layouts", default="1x2,2x1", help="1x2: 1 host x 2 ranks; 2x1: 2 hosts x 1 rank")
    args = parser.parse_args()
    subprocess.run([sys.executable, "-m", "compileall", "-q", str(REPO / "monarch_cli")], capture_output=True)
    rows: dict[str, list[tuple[str, ...]]] = {}
    verdicts: list[str] = []
    with tempfile.TemporaryDirectory(prefix="monarch-fw-bench-") as tmp:
        root = Path(tmp)
        env = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}
        env.update(MONARCH_CACHE_DIR=str(root / "cache"), HF_HUB_OFFLINE="1", MONARCH_LEARN_PRELOAD="1")
        for layout in args.layouts.split(","):
            hosts = 1 if layout == "1x2" else 2
            for name in args.only.split(","):
                case = Case(root, name, hosts, env)
                try:
                    colds = [case.cold() for _ in range(args.cold_repeats)]
                    reference = _sum(colds[0][1], "cold torchrun")
                    case.serve()
                    first_t, first_text = case.monarch_run()
                    case.settle()
                    warm_runs = [case.monarch_run() for _ in range(args.repeats)]
                    held = case.settle()
                finally:
                    case.stop()
                sums = {_sum(t, "a run") for _, t in [*colds, (first_t, first_text), *warm_runs]}
                if sums != {reference}:
                    raise SystemExit(f"{name} {layout}: checksums differ: {sums}")
                cold = statistics.median(t for t, _ in colds)
                warm = statistics.median(t for t, _ in warm_runs)
                own = statistics.median(min(float(t) for t in OWN.findall(text)) for _, text in warm_runs)
                cells = (
                    name,
                    " / ".join(f"{t:.2f}" for t, _ in colds) + " s",
                    f"{first_t:.2f} s ({cold / first_t:.2f}x)",
                    " / ".join(f"{t:.3f}" for t, _ in warm_runs) + " s",
                    f"{cold / warm:.1f}x",
                    f"{own:.3f} s",
                    f"{warm - own:.3f} s",
                    f"{sum(w['modules'] for w in held)}",
                    reference[:12],
                )
                rows.setdefault(layout, []).append(cells)
                print("  ".join(cells), flush=True)
                verdicts.append(
                    f"{name} {layout}: warm re-run {cold / warm:.1f}x (>= 15x: {'met' if cold / warm >= 15 else 'NOT met'}); "
                    f"first run {cold / first_t:.2f}x of cold ({'met' if first_t <= cold else 'NOT met'}); "
                    f"overhead {warm - own:.3f} s (<= 0.15 s: {'met' if warm - own <= 0.15 else 'NOT met'})"
                )
    columns = (
        "script",
        "cold torchrun",
        "first monarch run (vs cold)",
        "warm re-runs (CLI process)",
        "cold / warm",
        "script's own work",
        "overhead",
        "warm modules",
        "checksum (all equal)",
    )
    for layout, cells in rows.items():
        label = "1 host x 2 ranks" if layout == "1x2" else "2 local hosts x 1 rank"
        print_table(f"frameworks, {label}", columns, cells)
    for line in verdicts:
        print("  " + line)
    start, bare = _interpreter_start(), _interpreter_start("-S")
    print(
        f"  interpreter start here (in every CLI run's overhead): python -c pass {start * 1000:.0f} ms, "
        f"without site-packages' .pth files (-S) {bare * 1000:.0f} ms"
    )


def _interpreter_start(*flags: str) -> float:
    """Median of 7 ``python -c pass``: the part of a CLI run's overhead that is the interpreter
    and this environment's site-packages (``.pth`` files run at every start)."""
    times = []
    for _ in range(7):
        t = time.perf_counter()
        subprocess.run([sys.executable, *flags, "-c", "pass"], check=True)
        times.append(time.perf_counter() - t)
    return statistics.median(times)


if __name__ == "__main__":
    main()
