"""Telemetry benchmark: what recording costs a run, and how fast the questions are answered.

    python benchmarks/telemetry.py [--pairs 20] [--loop-pairs 8] [--loop-seconds 3] [--hook-pairs 80]

Everything is measured in the same run, on this machine. Telemetry off
(``MONARCH_TELEMETRY=0``: no rows, no rank hooks, no agent sampling) and on take turns
(ABAB, each side first half the time), and each cost is measured three ways:

* **wall clock, paired**: the median of the per-pair ratios on/off, with a 95 % bootstrap
  interval. On a shared 2-core machine this is honest but wide: it shows an effect only
  when the effect is larger than the noise.
* **CPU time actually spent**: the client (``RUSAGE_CHILDREN`` of the CLI process, or
  ``RUSAGE_SELF`` of this process for the in-process loop), the host agents (their
  process CPU clocks, read from here to the nanosecond), each rank's telemetry
  install (timed directly in children forked from a process holding torch, as warm ranks
  are), and the ranks' own loop CPU. Its increase, divided by the run's wall time (or the
  step time), bounds the wall-clock cost from above whenever that CPU work runs on the
  run's critical path, and is far less sensitive to other load on the machine.
* **the step hook**: µs per call in a tight loop, and in context: CPU per training step
  with the hook, and with a no-op hook as the control (the noise floor), each against no
  hook. The in-context figure is the hook's real cost; its own µs are not.

Rows: a warm re-run (``monarch run-spmd`` of a 4-rank gloo all-reduce, whole CLI process);
a step-bound training loop (2 ranks, the loop's time measured inside each rank);
``monarch stack`` on 16 live ranks; a simple ``monarch sql`` as a whole CLI process.
"""

from __future__ import annotations

import argparse
import io
import os
import random
import re
import resource
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path

from _common import print_table, timed

ALLREDUCE = """
import torch, torch.distributed as dist
dist.init_process_group("gloo")
t = torch.ones(1)
dist.all_reduce(t)
dist.destroy_process_group()
"""

# A step-bound loop: no collective (so two cores shared by the ranks do not dominate).
LOOP = """
import sys, time, torch
torch.manual_seed(0)
torch.set_num_threads(1)
model = torch.nn.Sequential(torch.nn.Linear(256, 256), torch.nn.ReLU(), torch.nn.Linear(256, 256))
opt = torch.optim.SGD(model.parameters(), lr=0.001)
x = torch.randn(64, 256)
steps = int(sys.argv[1])
for _ in range(10):
    opt.zero_grad(); model(x).sum().backward(); opt.step()
t, c = time.perf_counter(), time.process_time()
for _ in range(steps):
    opt.zero_grad(); model(x).sum().backward(); opt.step()
print(f"loop_s {time.perf_counter() - t:.6f} loop_cpu_s {time.process_time() - c:.6f}", flush=True)
"""

WAIT = """
import os, sys, time
def waiting_for_release(flag):
    while not os.path.exists(flag):
        time.sleep(0.05)
waiting_for_release(sys.argv[1])
"""


def cli(args: list[str], cwd: Path, env: dict[str, str]) -> str:
    done = subprocess.run(
        [sys.executable, "-m", "monarch_cli", *args], cwd=cwd, env=env, capture_output=True, text=True
    )
    if done.returncode != 0:
        raise SystemExit(f"monarch {' '.join(args)} failed ({done.returncode}):\n{done.stdout}\n{done.stderr}")
    return done.stdout


def med(xs: Sequence[float]) -> float:
    return statistics.median(xs)


def paired(off: Sequence[float], on: Sequence[float], draws: int = 4000) -> tuple[float, float, float]:
    """Median of the per-pair ratios on/off, and a 95 % bootstrap interval of that median."""
    ratios = [b / a for a, b in zip(off, on)]
    rng = random.Random(0)
    boot = sorted(med([rng.choice(ratios) for _ in ratios]) for _ in range(draws))
    return med(ratios), boot[int(0.025 * draws)], boot[int(0.975 * draws) - 1]


def cpu_of(pids: Sequence[int]) -> float:
    """CPU seconds of these processes (not their children), to the nanosecond: each process's
    CPU clock (Linux: clock id ``(~pid << 3) | 2``); /proc's 10 ms ticks where that is refused."""
    import psutil

    total = 0.0
    for pid in pids:
        try:
            total += time.clock_gettime((~pid << 3) | 2)
        except OSError:
            t = psutil.Process(pid).cpu_times()
            total += t.user + t.system
    return total


def children_cpu() -> float:
    ru = resource.getrusage(resource.RUSAGE_CHILDREN)
    return ru.ru_utime + ru.ru_stime


def self_cpu() -> float:
    ru = resource.getrusage(resource.RUSAGE_SELF)
    return ru.ru_utime + ru.ru_stime


def turns(pairs: int, one: Callable[[bool], None]) -> None:
    """ABAB: off and on alternate, each side first in half the pairs."""
    for i in range(pairs):
        for on in (False, True) if i % 2 else (True, False):
            one(on)


def ratio_cell(off: Sequence[float], on: Sequence[float]) -> str:
    r, lo, hi = paired(off, on)
    return f"{r:.3f}x [{lo:.3f}, {hi:.3f}]"


def hook_us() -> float:
    """µs per call of the step hook itself, in a tight loop (what it costs apart from its effect on the step)."""
    import torch

    from monarch_cli.runtime.rank.telemetry import _StepTimer

    opt = torch.optim.SGD(torch.nn.Linear(4, 4).parameters(), lr=0.01)
    timer = _StepTimer(os.path.join(tempfile.mkdtemp(prefix="monarch-bench-hook-"), "steps"))
    n = 20000
    best = []
    for _ in range(7):
        t = time.perf_counter()
        for _ in range(n):
            timer(opt, (), {})
        best.append((time.perf_counter() - t) / n * 1e6)
    os.close(timer.fd)
    return med(best)


def hook_in_context(pairs: int) -> dict[str, tuple[float, float, float, float]]:
    """CPU µs per training step (the loop's model, in this process) with monarch's hook and with a
    no-op hook (the control: the noise floor), each against no hook, ABAB in short segments.
    Catches what a direct timing cannot: the hook's effect on the step around it."""
    import torch
    import torch.optim.optimizer as optimizer

    from monarch_cli.runtime.rank.telemetry import _StepTimer

    torch.manual_seed(0)
    torch.set_num_threads(1)
    model = torch.nn.Sequential(torch.nn.Linear(256, 256), torch.nn.ReLU(), torch.nn.Linear(256, 256))
    opt = torch.optim.SGD(model.parameters(), lr=0.001)
    x = torch.randn(64, 256)
    hooks = {
        "monarch": _StepTimer(os.path.join(tempfile.mkdtemp(prefix="monarch-bench-hook-"), "steps")),
        "no-op": lambda *_: None,
    }

    def segment(n: int = 100) -> float:
        c = time.process_time()
        for _ in range(n):
            opt.zero_grad()
            model(x).sum().backward()
            opt.step()
        return (time.process_time() - c) / n * 1e6

    segment(300)
    got: dict[str, list[float]] = {"none": [], "monarch": [], "no-op": []}
    for i in range(pairs):
        for name in ["none", "monarch", "no-op"] if i % 2 else ["no-op", "monarch", "none"]:
            handle = optimizer.register_optimizer_step_post_hook(hooks[name]) if name != "none" else None
            got[name].append(segment())
            if handle is not None:
                handle.remove()
    return {name: (med(got["none"]), med(got[name]), *paired(got["none"], got[name])) for name in ("monarch", "no-op")}


INSTALL = """
import os, sys, tempfile, time, torch  # as a warm zygote: torch and the rank's telemetry module imported
from monarch_cli.runtime.rank import telemetry as rank_telemetry
d = tempfile.mkdtemp(prefix="monarch-bench-install-")
for i in range(int(sys.argv[1])):
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # a rank: rank_start is imported with or without telemetry; time only what telemetry adds
        from monarch_cli.runtime.rank import start as rank_start
        t, c = time.perf_counter(), time.process_time()
        rank_start._install_telemetry({"rank": 0, "telemetry": {"run_id": f"r{i}", "agent_pid": os.getppid(), "dir": d}})
        os.write(w, f"{(time.perf_counter() - t) * 1e6:.1f} {(time.process_time() - c) * 1e6:.1f}\\n".encode())
        os._exit(0)
    os.close(w)
    print(os.read(r, 100).decode(), end="", flush=True)
    os.close(r)
    os.waitpid(pid, 0)
"""


def install_us(n: int = 15) -> tuple[float, float]:
    """Median (wall µs, CPU µs) of installing telemetry in a rank forked from a process that has torch."""
    done = subprocess.run([sys.executable, "-c", INSTALL, str(n)], capture_output=True, text=True, check=True)
    pairs = [tuple(map(float, line.split())) for line in done.stdout.splitlines()]
    return med([p[0] for p in pairs]), med([p[1] for p in pairs])


def mean_diff(off: Sequence[float], on: Sequence[float], draws: int = 4000) -> tuple[float, float, float]:
    """Mean of the per-pair differences on - off, and a 95 % bootstrap interval of it."""
    d = [b - a for a, b in zip(off, on)]
    rng = random.Random(1)
    boot = sorted(statistics.mean([rng.choice(d) for _ in d]) for _ in range(draws))
    return statistics.mean(d), boot[int(0.025 * draws)], boot[int(0.975 * draws) - 1]


def agent_pids(state: Path) -> list[int]:
    from monarch_cli.telemetry import db_path, query

    _, rows = query(db_path(state.parent), "SELECT DISTINCT agent_pid FROM hosts WHERE agent_pid IS NOT NULL")
    return [r[0] for r in rows]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--pairs", type=int, default=20, help="ABAB pairs of the warm re-run")
    parser.add_argument("--loop-pairs", type=int, default=8, help="ABAB pairs of the training loop")
    parser.add_argument("--loop-seconds", type=float, default=3.0, help="how long each loop runs")
    parser.add_argument("--hook-pairs", type=int, default=80, help="ABAB pairs of the in-process step hook")
    parser.add_argument("--repeats", type=int, default=7, help="timings of stack and sql")
    args = parser.parse_args()
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from monarch_cli.jobs import job_load
    from monarch_cli.jobs.run_log import rank_log

    rows: list[tuple[str, ...]] = []
    notes: list[str] = []
    with tempfile.TemporaryDirectory(prefix="monarch-bench-tel-") as tmp:
        cwd = Path(tmp)
        (cwd / "allreduce.py").write_text(ALLREDUCE)
        (cwd / "loop.py").write_text(LOOP)
        (cwd / "wait.py").write_text(WAIT)
        state = cwd / ".monarch" / "job_state.pkl"
        env = {True: {**os.environ, "MONARCH_STATE": str(state), "MONARCH_TELEMETRY": "1"}}
        env[False] = {**env[True], "MONARCH_TELEMETRY": "0"}
        cli(["serve", "--hosts", "2", "--", "torchrun", "--nproc-per-node=2", "allreduce.py"], cwd, env[True])
        try:
            for on in (True, False, True):  # warm the zygotes and the store
                cli(["run-spmd"], cwd, env[on])
            agents = agent_pids(state)

            # ---- warm re-run, whole CLI process
            wall: dict[bool, list[float]] = {False: [], True: []}
            client: dict[bool, list[float]] = {False: [], True: []}
            agent: dict[bool, list[float]] = {False: [], True: []}

            def rerun(on: bool) -> None:
                c0, a0, t0 = children_cpu(), cpu_of(agents), time.perf_counter()
                cli(["run-spmd"], cwd, env[on])
                wall[on].append(time.perf_counter() - t0)
                client[on].append(children_cpu() - c0)
                agent[on].append(cpu_of(agents) - a0)

            turns(args.pairs, rerun)
            n = args.pairs
            w_off = med(wall[False])
            rows.append(
                (
                    f"warm re-run, 4 ranks, whole CLI: wall, {n} ABAB pairs",
                    f"{w_off * 1000:.0f} ms",
                    f"{med(wall[True]) * 1000:.0f} ms",
                    ratio_cell(wall[False], wall[True]),
                    "≤ 1.02x",
                )
            )
            d_client, lo_c, hi_c = mean_diff(client[False], client[True])
            d_agent, lo_a, hi_a = mean_diff(agent[False], agent[True])
            for name, (d, lo, hi), off_cpu in (
                ("the client (CLI process)", (d_client, lo_c, hi_c), client[False]),
                ("both host agents", (d_agent, lo_a, hi_a), agent[False]),
            ):
                rows.append(
                    (
                        f"  CPU time of {name}, per run",
                        f"{statistics.mean(off_cpu) * 1000:.1f} ms",
                        f"{(statistics.mean(off_cpu) + d) * 1000:.1f} ms",
                        f"{d * 1000:+.1f} ms [{lo * 1000:+.1f}, {hi * 1000:+.1f}]",
                        "",
                    )
                )
            inst_wall, inst_cpu = install_us()
            rows.append(
                (
                    "  installing telemetry in a warm rank (direct; x4 ranks)",
                    "",
                    f"{inst_cpu:.0f} µs CPU",
                    f"{4 * inst_cpu / 1000:+.1f} ms",
                    "",
                )
            )
            d_total = d_client + d_agent + 4 * inst_cpu / 1e6
            hi_total = hi_c + hi_a + 4 * inst_cpu / 1e6
            rows.append(
                (
                    "  CPU added per run / the run's wall time",
                    "",
                    f"{d_total * 1000:+.1f} ms",
                    f"{d_total / w_off * 100:+.2f} % [..{hi_total / w_off * 100:+.2f} %]",
                    "≤ 2 %",
                )
            )

            # ---- step-bound loop, in process (this process is the client)
            os.chdir(cwd)
            os.environ["MONARCH_STATE"] = str(state)
            job = job_load(state)

            def loop_run(on: bool, steps: int) -> tuple[float, float, float, float, float]:
                os.environ["MONARCH_TELEMETRY"] = "1" if on else "0"
                c0, a0, t0 = self_cpu(), cpu_of(agents), time.perf_counter()
                result = job.run_spmd(
                    ["torchrun", "--nproc-per-node=1", "loop.py", str(steps)], stdout=io.BytesIO(), stderr=io.BytesIO()
                )
                elapsed = time.perf_counter() - t0
                if result.exit_code != 0:
                    raise SystemExit(f"the loop failed: exit {result.exit_code}")
                text = "".join(rank_log(result.log_dir, r).read_text() for r in (0, 1))
                walls = [float(v) for v in re.findall(r"loop_s ([\d.]+)", text)]
                cpus = [float(v) for v in re.findall(r"loop_cpu_s ([\d.]+)", text)]
                return max(walls), sum(cpus), self_cpu() - c0, cpu_of(agents) - a0, elapsed

            probe, _, _, _, _ = loop_run(False, 200)
            steps = max(200, int(args.loop_seconds / (probe / 200)))
            loop: dict[bool, list[tuple[float, float, float, float, float]]] = {False: [], True: []}
            turns(args.loop_pairs, lambda on: loop[on].append(loop_run(on, steps)))
            os.environ["MONARCH_TELEMETRY"] = "1"
            lw = {k: [r[0] for r in v] for k, v in loop.items()}
            step_ms = med(lw[False]) / steps * 1000
            rows.append(
                (
                    f"step-bound loop, 2 ranks x {steps} steps of ~{step_ms:.2f} ms: loop wall, "
                    f"{args.loop_pairs} ABAB pairs",
                    f"{med(lw[False]) * 1000:.0f} ms",
                    f"{med(lw[True]) * 1000:.0f} ms",
                    ratio_cell(lw[False], lw[True]),
                    "≤ 1.01x",
                )
            )
            rank_loop_cpu = {k: statistics.mean(r[1] for r in v) for k, v in loop.items()}
            rows.append(
                (
                    "  CPU time of the 2 ranks' loops",
                    f"{rank_loop_cpu[False] * 1000:.0f} ms",
                    f"{rank_loop_cpu[True] * 1000:.0f} ms",
                    ratio_cell([r[1] for r in loop[False]], [r[1] for r in loop[True]]),
                    "",
                )
            )
            h = hook_us()
            hook_share = h / (step_ms * 1000)
            rows.append(
                (
                    "  the step hook itself, per optimizer.step() (direct, tight loop)",
                    f"{step_ms * 1000:.0f} µs/step",
                    f"{h:.2f} µs",
                    f"{hook_share * 100:+.3f} %",
                    "",
                )
            )
            context = hook_in_context(args.hook_pairs)
            for name, (base, with_hook, r, lo, hi) in context.items():
                rows.append(
                    (
                        f"  CPU per step with the {name} hook vs none, in process, {args.hook_pairs} ABAB pairs",
                        f"{base:.0f} µs",
                        f"{with_hook:.0f} µs",
                        f"{r:.4f}x [{lo:.4f}, {hi:.4f}]",
                        "control" if name == "no-op" else "",
                    )
                )
            seconds = {k: sum(r[4] for r in v) for k, v in loop.items()}
            agent_rate = {k: sum(r[3] for r in v) / seconds[k] for k, v in loop.items()}
            client_rate = {k: sum(r[2] for r in v) / seconds[k] for k, v in loop.items()}
            d_agent_rate = agent_rate[True] - agent_rate[False]
            d_client_rate = client_rate[True] - client_rate[False]
            rows.append(
                (
                    "  CPU of both agents per second of run (sampling)",
                    f"{agent_rate[False] * 1000:.1f} ms/s",
                    f"{agent_rate[True] * 1000:.1f} ms/s",
                    f"{d_agent_rate * 100:+.2f} % of a core",
                    "",
                )
            )
            rows.append(
                (
                    "  CPU of the client per second of run (rows)",
                    f"{client_rate[False] * 1000:.1f} ms/s",
                    f"{client_rate[True] * 1000:.1f} ms/s",
                    f"{d_client_rate * 100:+.2f} % of a core",
                    "",
                )
            )
            # The ranks hold one core each; whatever the agents and the client add per second is taken from
            # them only when every core is busy, shared among the ranks: spread over the 2 ranks' cores.
            # The hook's cost is what it does to the step around it (the in-context row), not its own
            # tight-loop time: µs per step in context, against this loop's step time.
            base, with_hook = context["monarch"][:2]
            hook_ctx_us = max(with_hook - base, h)
            share = hook_ctx_us / (step_ms * 1000) + max(d_agent_rate + d_client_rate, 0.0) / 2
            rows.append(
                (
                    f"  loop cost bound: hook in context ({hook_ctx_us:.1f} µs/step) + (agents + client) / 2 ranks",
                    "",
                    "",
                    f"{share * 100:+.3f} %",
                    "≤ 1 %",
                )
            )
            notes.append(
                f"The warm re-run adds {d_total * 1000:.1f} ms of CPU ({d_total / w_off * 100:.2f} % of its "
                f"{w_off * 1000:.0f} ms); the step-bound loop about {share * 100:.2f} % of its {step_ms:.2f} ms "
                f"steps (the hook: {hook_ctx_us:.1f} µs per step in context, {h:.2f} µs alone). The wall-clock "
                "pairs bound the effect only as tightly as their interval; the CPU rows are the tighter bound."
            )

            # ---- monarch stack on 16 ranks
            flag = cwd / "release"
            box: dict[str, object] = {}
            t = threading.Thread(
                target=lambda: box.setdefault(
                    "r",
                    job.run_spmd(
                        ["torchrun", "--nproc-per-node=8", "wait.py", str(flag)],
                        stdout=io.BytesIO(),
                        stderr=io.BytesIO(),
                    ),
                )
            )
            t.start()
            try:
                deadline = time.monotonic() + 120
                while time.monotonic() < deadline:
                    report = job.stacks()
                    if (
                        len(report.stacks) == 16
                        and all(s.threads for s in report.stacks)
                        and len(report.groups) == 1
                        and "waiting_for_release" in report.groups[0].summary
                    ):
                        break
                    time.sleep(0.5)
                else:
                    raise SystemExit("16 ranks never all reached waiting_for_release")
                api = timed(lambda: job.stacks(), args.repeats)
                whole = timed(lambda: cli(["stack"], cwd, env[True]), args.repeats)
            finally:
                flag.write_text("")
                t.join(120)
            rows.append(("monarch stack, 16 ranks (API call)", "", f"{med(api) * 1000:.0f} ms", "", "< 1 s"))
            rows.append(("monarch stack, 16 ranks (whole CLI process)", "", f"{med(whole) * 1000:.0f} ms", "", "< 1 s"))

            floor = timed(lambda: subprocess.run([sys.executable, "-c", "pass"], check=True), args.repeats * 2)
            sql = timed(lambda: cli(["sql", "SELECT count(*) FROM logs"], cwd, env[True]), args.repeats * 2)
            rows.append(
                (
                    "monarch sql, simple query (whole CLI process)",
                    f"{med(floor) * 1000:.0f} ms (python -c pass)",
                    f"{med(sql) * 1000:.0f} ms",
                    f"{med(sql) / med(floor):.2f}x floor",
                    "< 150 ms",
                )
            )
        finally:
            cli(["stop"], cwd, env[True])
    print_table("telemetry", ["measure", "off / reference", "on", "on vs off [95% CI]", "target"], rows)
    for line in notes:
        print(line)


if __name__ == "__main__":
    main()
