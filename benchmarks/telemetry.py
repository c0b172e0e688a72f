"""Telemetry benchmark: what recording costs a run, and how fast the questions are answered.

    python benchmarks/telemetry.py [--repeats 7] [--steps 300]

Rows, all measured in the same run on this machine, telemetry off (``MONARCH_TELEMETRY=0``)
and on taking turns so that noise hits both alike:

* a warm re-run (``monarch run-spmd`` of a 4-rank gloo all-reduce, whole CLI process);
* a step-bound training loop (the loop's own time, measured inside rank 0), and the
  step hook alone (a tiny optimizer step in this process, hook registered or not);
* ``monarch stack`` on 16 live ranks (the API call, and the whole CLI process);
* a simple ``monarch sql`` query as a whole CLI process, against ``python -c pass``.
"""

from __future__ import annotations

import argparse
import io
import os
import re
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Dict, List

from _common import print_table, timed

ALLREDUCE = """
import torch, torch.distributed as dist
dist.init_process_group("gloo")
t = torch.ones(1)
dist.all_reduce(t)
dist.destroy_process_group()
"""

# A step-bound loop: no collective (so two cores shared by 4 ranks do not dominate), a few ms per step.
LOOP = """
import sys, time, torch
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(256, 256), torch.nn.ReLU(), torch.nn.Linear(256, 256))
opt = torch.optim.SGD(model.parameters(), lr=0.001)
x = torch.randn(64, 256)
steps = int(sys.argv[1])
for _ in range(10):
    opt.zero_grad(); model(x).sum().backward(); opt.step()
t = time.perf_counter()
for _ in range(steps):
    opt.zero_grad(); model(x).sum().backward(); opt.step()
print(f"loop_s {time.perf_counter() - t:.6f}", flush=True)
"""

WAIT = """
import os, sys, time
def waiting_for_release(flag):
    while not os.path.exists(flag):
        time.sleep(0.05)
waiting_for_release(sys.argv[1])
"""


def cli(args: List[str], cwd: Path, env: Dict[str, str]) -> None:
    done = subprocess.run([sys.executable, "-m", "monarch_cli", *args], cwd=cwd, env=env, capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"monarch {' '.join(args)} failed ({done.returncode}):\n{done.stdout}\n{done.stderr}")


def med(xs: List[float]) -> float:
    return statistics.median(xs)


def hook_cost(repeats: int) -> "tuple[float, float]":
    """Median µs per tiny optimizer step without and with monarch's step hook, interleaved."""
    import torch
    import torch.optim.optimizer as optimizer

    from monarch_cli.runtime.rank_telemetry import _StepTimer

    model = torch.nn.Linear(16, 16)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    x = torch.randn(4, 16)

    def loop(n: int = 500) -> float:
        t = time.perf_counter()
        for _ in range(n):
            opt.zero_grad()
            model(x).sum().backward()
            opt.step()
        return (time.perf_counter() - t) / n * 1e6

    loop()
    timer = _StepTimer(os.path.join(tempfile.mkdtemp(prefix="monarch-bench-hook-"), "steps"))
    off, on = [], []
    for i in range(max(repeats, 5) * 2):
        for hooked in (False, True)[:: 1 if i % 2 else -1]:
            if hooked:
                handle = optimizer.register_optimizer_step_post_hook(timer)
                on.append(loop())
                handle.remove()
            else:
                off.append(loop())
    return med(off), med(on)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--steps", type=int, default=100)
    args = parser.parse_args()
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from monarch_cli.jobs import serve

    rows = []
    with tempfile.TemporaryDirectory(prefix="monarch-bench-tel-") as tmp:
        cwd = Path(tmp)
        (cwd / "allreduce.py").write_text(ALLREDUCE)
        (cwd / "loop.py").write_text(LOOP)
        (cwd / "wait.py").write_text(WAIT)
        state = cwd / ".monarch" / "job_state.pkl"
        env_on = {**os.environ, "MONARCH_STATE": str(state), "MONARCH_TELEMETRY": "1"}
        env_off = {**env_on, "MONARCH_TELEMETRY": "0"}
        cli(["serve", "--hosts", "2", "--", "torchrun", "--nproc-per-node=2", "allreduce.py"], cwd, env_on)
        try:
            cli(["run-spmd"], cwd, env_on)  # warm the zygotes
            off: List[float] = []
            on: List[float] = []
            for i in range(args.repeats):  # taking turns, each side first half the time
                for env, into in ((env_off, off), (env_on, on))[:: 1 if i % 2 else -1]:
                    into += timed(lambda: cli(["run-spmd"], cwd, env), 1)
            rows.append(("warm re-run, 4 ranks (CLI)", f"{med(off) * 1000:.0f} ms", f"{med(on) * 1000:.0f} ms",
                         f"{med(on) / med(off):.3f}x", "≤ 1.02x"))

            os.chdir(cwd)
            os.environ["MONARCH_STATE"] = str(state)
            job = serve(None, hosts=2, state=state)
            loop_off: List[float] = []
            loop_on: List[float] = []
            for i in range(args.repeats):
                for enabled, into in (("0", loop_off), ("1", loop_on))[:: 1 if i % 2 else -1]:
                    os.environ["MONARCH_TELEMETRY"] = enabled
                    result = job.run_spmd(["torchrun", "--nproc-per-node=1", "loop.py", str(args.steps)],
                                          stdout=io.BytesIO(), stderr=io.BytesIO())
                    text = (result.log_dir / "rank0.log").read_text()
                    into.append(float(re.search(r"loop_s ([\d.]+)", text).group(1)))
            os.environ["MONARCH_TELEMETRY"] = "1"
            per_step = med(loop_off) / args.steps * 1000
            rows.append((f"step-bound loop, {args.steps} steps of ~{per_step:.1f} ms (rank 0)",
                         f"{med(loop_off) * 1000:.0f} ms", f"{med(loop_on) * 1000:.0f} ms",
                         f"{med(loop_on) / med(loop_off):.3f}x", "≤ 1.01x"))

            hook_off, hook_on = hook_cost(args.repeats)
            rows.append(("optimizer.step() hook alone, tiny step (in process)", f"{hook_off:.1f} µs/step",
                         f"{hook_on:.1f} µs/step", f"+{hook_on - hook_off:.1f} µs", "-"))

            flag = cwd / "release"
            box: Dict[str, object] = {}
            t = threading.Thread(target=lambda: box.setdefault("r", job.run_spmd(
                ["torchrun", "--nproc-per-node=8", "wait.py", str(flag)], stdout=io.BytesIO(), stderr=io.BytesIO())))
            t.start()
            try:
                deadline = time.monotonic() + 120
                while time.monotonic() < deadline:
                    report = job.stacks()
                    if len(report.stacks) == 16 and all(s.threads for s in report.stacks) and len(report.groups) == 1 \
                            and "waiting_for_release" in report.groups[0].summary:
                        break
                    time.sleep(0.5)
                else:
                    raise SystemExit("16 ranks never all reached waiting_for_release")
                api = timed(lambda: job.stacks(), args.repeats)
                whole = timed(lambda: cli(["stack"], cwd, env_on), args.repeats)
            finally:
                flag.write_text("")
                t.join(120)
            rows.append(("monarch stack, 16 ranks (API call)", "-", f"{med(api) * 1000:.0f} ms", "-", "< 1 s"))
            rows.append(("monarch stack, 16 ranks (whole CLI process)", "-", f"{med(whole) * 1000:.0f} ms", "-", "< 1 s"))

            floor = timed(lambda: subprocess.run([sys.executable, "-c", "pass"], check=True), args.repeats * 2)
            sql = timed(lambda: cli(["sql", "SELECT count(*) FROM logs"], cwd, env_on), args.repeats * 2)
            rows.append(("monarch sql, simple query (whole CLI process)", f"{med(floor) * 1000:.0f} ms (python -c pass)",
                         f"{med(sql) * 1000:.0f} ms", f"{med(sql) / med(floor):.2f}x floor", "< 150 ms"))
        finally:
            cli(["stop"], cwd, env_on)
    print_table("telemetry", ["measure", "off / reference", "on", "ratio", "target"], rows)


if __name__ == "__main__":
    main()
