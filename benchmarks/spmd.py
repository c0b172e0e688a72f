"""SPMD benchmark: cold torchrun vs monarch runs of the same 2-rank gloo all-reduce script.

    python benchmarks/spmd.py [--repeats 5]

All rows are measured in the same run, on this machine; the ratio column is cold
torchrun's median time divided by the row's median.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import List

from _common import print_table, timed

SCRIPT = """
import torch, torch.distributed as dist
dist.init_process_group("gloo")
t = torch.ones(1)
dist.all_reduce(t)
assert t.item() == dist.get_world_size()
dist.destroy_process_group()
"""


def run(cmd: List[str], cwd: Path, env: dict) -> None:
    proc = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed ({proc.returncode}):\n{proc.stdout}\n{proc.stderr}")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    n = args.repeats
    with tempfile.TemporaryDirectory(prefix="monarch-bench-") as tmp:
        cwd = Path(tmp)
        (cwd / "allreduce.py").write_text(SCRIPT)
        state = cwd / ".monarch" / "job_state.pkl"
        env = {**os.environ, "MONARCH_STATE": str(state)}
        torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", "allreduce.py"]
        monarch = [sys.executable, "-m", "monarch_cli"]

        cold = timed(lambda: run(torchrun, cwd, env), n)

        t = time.perf_counter()
        run([*monarch, "serve", "--", "torchrun", "--nproc-per-node=2", "allreduce.py"], cwd, env)
        serve_time = time.perf_counter() - t
        first = timed(lambda: run([*monarch, "run-spmd"], cwd, env), 1)
        cli = timed(lambda: run([*monarch, "run-spmd"], cwd, env), n)
        cli_cold = timed(lambda: run([*monarch, "run-spmd", "--cold"], cwd, env), n)

        os.chdir(cwd)
        from monarch_cli.jobs import job_load

        job = job_load(state)
        sink = open(os.devnull, "wb")

        def api_run() -> None:
            result = job.run_spmd(stdout=sink, stderr=sink)
            assert result.exit_code == 0, result

        api = timed(api_run, n * 2)
        run([*monarch, "stop"], cwd, env)

    base = statistics.median(cold)
    rows = [
        ("torchrun --standalone --nproc-per-node=2 (cold)", cold, "reference"),
        ("monarch serve (once)", [serve_time], ""),
        ("first monarch run-spmd (CLI process)", first, ""),
        ("repeated monarch run-spmd (CLI process)", cli, ">= 8x"),
        ("repeated monarch run-spmd --cold (CLI process)", cli_cold, ""),
        ("repeated job.run_spmd() from Python", api, ">= 8x"),
    ]
    cells = []
    for name, times, target in rows:
        med = statistics.median(times)
        cells.append((name, f"{med:.3f} s", f"{min(times):.3f} s", f"{base / med:.1f}x", target))
    print_table("SPMD, 2 ranks gloo all-reduce", ("what", "median", "min", "speed-up vs torchrun", "target"), cells)


if __name__ == "__main__":
    main()
