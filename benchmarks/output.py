"""Output throughput: a rank's output through ``monarch run-spmd`` against plain ``python``.

    python benchmarks/output.py [--repeats 3]

Each workload is one script. The reference runs it as ``python script.py > file`` (with
``PYTHONUNBUFFERED=1``, which every rank gets, so both sides make the same writes); the
monarch row runs ``monarch run-spmd -- torchrun --nproc-per-node=1 script.py > file`` on a
1-host reservation served once, so the output crosses the rank's pipe, the host agent,
the CURVE socket and the client's sink, and lands in the console file and the rank's log.
The two are run in turns (so noise hits both alike); the ratio is monarch's median over
python's. The "empty script" row is the fixed cost of a run (CLI start, rank start) that
every row includes; "CLI CPU" is the monarch client process's own CPU time (user + system),
which this machine's noise barely moves: it is what the output path costs the client;
"run (result.json)" is the run's own duration as the CLI measured it (no CLI start-up).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from _common import print_table

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from monarch_cli.jobs.run_log import rank_log  # noqa: E402

WORKLOADS: dict[str, str] = {
    "empty script (fixed cost)": "pass\n",
    # 50 MB of short lines, one print() each: ~1.1 M lines of ~45 bytes.
    "50 MB of short lines": (
        "import sys\n"
        "line = 'step %07d loss 0.123456 lr 0.001 tokens/s 123456\\n'\n"
        "n = 50_000_000 // len(line % 0)\n"
        "for i in range(n):\n"
        "    sys.stdout.write(line % i)\n"
    ),
    "one 10 MB line, no newline": "import sys\nsys.stdout.write('x' * 10_000_000)\n",
    "3,000 unflushed dots": "for _ in range(3000):\n    print('.', end='')\n",
}
SIZES = {
    "empty script (fixed cost)": 0,
    "50 MB of short lines": 50e6,
    "one 10 MB line, no newline": 10e6,
    "3,000 unflushed dots": 3000,
}


def run(cmd: list[str], cwd: Path, env: dict, out: Path) -> None:
    with open(out, "wb") as sink:
        proc = subprocess.run(cmd, cwd=cwd, env=env, stdout=sink, stderr=subprocess.PIPE, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed ({proc.returncode}):\n{proc.stderr[-3000:]}")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    n = args.repeats
    with tempfile.TemporaryDirectory(prefix="monarch-bench-output-") as tmp:
        cwd = Path(tmp)
        state = cwd / ".monarch" / "job_state.pkl"
        env = {**os.environ, "MONARCH_STATE": str(state), "PYTHONUNBUFFERED": "1"}
        monarch = [sys.executable, "-m", "monarch_cli"]
        out = cwd / "console.out"
        t = time.perf_counter()
        run([*monarch, "serve", "--hosts", "1"], cwd, env, out)
        serve_time = time.perf_counter() - t
        rows = []
        try:
            for name, code in WORKLOADS.items():
                script = cwd / f"w{len(rows)}.py"
                script.write_text(code)
                command = [*monarch, "run-spmd", "--", "torchrun", "--nproc-per-node=1", str(script)]
                run(command, cwd, env, out)  # warm-up
                plain, via, cpu, inside = [], [], [], []
                for _ in range(n):
                    plain.append(_timed_run([sys.executable, str(script)], cwd, env, out)[0])
                    wall, used = _timed_run(command, cwd, env, out)
                    via.append(wall)
                    cpu.append(used)
                    inside.append(json.loads((_latest_run(cwd) / "result.json").read_text())["duration"])
                logged = rank_log(_latest_run(cwd), 0)
                if logged.stat().st_size != _expected_size(script, cwd, env):
                    raise SystemExit(f"{name}: the rank's log has {logged.stat().st_size} bytes, not what python wrote")
                rows.append((name, plain, via, cpu, inside))
        finally:
            run([*monarch, "stop"], cwd, env, out)
    cells = []
    for name, plain, via, cpu, inside in rows:
        p, m = statistics.median(plain), statistics.median(via)
        rate = f"{SIZES[name] / m / 1e6:.1f}" if SIZES[name] >= 1e6 else ""
        cells.append(
            (
                name,
                f"{p:.3f} s",
                f"{m:.3f} s",
                f"{m / p:.1f}x",
                rate,
                f"{statistics.median(cpu):.3f} s",
                f"{statistics.median(inside):.3f} s",
            )
        )
    print_table(
        f"output throughput, 1 rank, median of {n} (serve once: {serve_time:.2f} s)",
        ("workload", "python > file", "monarch > file", "ratio", "monarch MB/s", "CLI CPU", "run (result.json)"),
        cells,
    )


def _latest_run(cwd: Path) -> Path:
    return max((cwd / ".monarch" / "logs").iterdir(), key=lambda p: p.stat().st_mtime)


def _timed_run(cmd: list[str], cwd: Path, env: dict, out: Path) -> tuple[float, float]:
    """Wall seconds, and the child's CPU seconds (user + system)."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    t = time.perf_counter()
    run(cmd, cwd, env, out)
    wall = time.perf_counter() - t
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    return wall, (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)


def _expected_size(script: Path, cwd: Path, env: dict) -> int:
    ref = cwd / "reference.out"
    run([sys.executable, str(script)], cwd, env, ref)
    return ref.stat().st_size


if __name__ == "__main__":
    main()
