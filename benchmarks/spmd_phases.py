"""Where a repeated ``monarch run-spmd`` of a bare all-reduce spends its time, phase by phase.

    python benchmarks/spmd_phases.py [--repeats 15] [--typer]

One local host, 2 ranks, a warm reservation (served here, settled first). Each run is a
whole ``monarch run-spmd`` process; a small driver runs the CLI's own ``main()`` with time
stamps at the client's phase boundaries (taken when ``monarch_cli.jobs.job`` and
``.spmd`` are imported: nothing of the run is changed), and the script stamps its own
steps. All stamps are wall-clock (``time.time()``), shared by the processes of one machine.
``--typer`` sends the command line through Typer, as every command went before
``cli/fast.py`` (it still takes ``--help`` and anything the fast route leaves to it).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from _common import print_table

SCRIPT = """
import json, os, time
t = {"start": time.time()}
import torch, torch.distributed as dist
dist.init_process_group("gloo")
t["rendezvous"] = time.time()
x = torch.ones(1)
dist.all_reduce(x)
t["all_reduce"] = time.time()
assert x.item() == dist.get_world_size()
dist.destroy_process_group()
t["destroyed"] = time.time()
with open(os.path.join(os.environ["PHASES_DIR"], "rank%s.json" % os.environ["RANK"]), "w") as f:
    json.dump(t, f)
"""

DRIVER = r"""
import atexit, importlib.abc, importlib.machinery, json, os, sys, time
T = {"main": time.time()}

def mark(name):
    T.setdefault(name, time.time())

def wrap(owner, attr, before=None, after=None):
    fn = getattr(owner, attr)
    def wrapped(*a, **k):
        if before:
            mark(before)
        try:
            return fn(*a, **k)
        finally:
            if after:
                mark(after)
    setattr(owner, attr, wrapped)

def job_module(m):
    mark("imported")
    wrap(m.Job, "hostset", "connect", "connected")
    wrap(m.Job, "run_spmd", None, "returned")

def spmd_module(m):
    wrap(m.SpmdRunner, "run", "launch", "reported")

HOOKS = {"monarch_cli.jobs.job": job_module, "monarch_cli.jobs.spmd": spmd_module}

class Finder(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name not in HOOKS:
            return None
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        run = spec.loader.exec_module
        def exec_module(module):
            run(module)
            HOOKS[name](module)
        spec.loader.exec_module = exec_module
        return spec

sys.meta_path.insert(0, Finder())
atexit.register(lambda: json.dump(T, open(os.environ["PHASES_OUT"], "w")))  # runs first: registered last
sys.argv = ["monarch", *sys.argv[1:]]
if os.environ.get("PHASES_TYPER"):
    from monarch_cli.cli import _app, _only_module
    _app(_only_module(sys.argv[1:]))(prog_name="monarch")
else:
    from monarch_cli.cli import main
    main()
"""

#: (row, from stamp, to stamp); rank stamps are the later rank's, "rank.start" the earlier one's.
PHASES = [
    ("interpreter start (python, site)", "exec", "main"),
    ("imports (CLI, job API, runtime, zmq)", "main", "imported"),
    ("state file, keys, connect + ping agents", "imported", "connected"),
    ("run dir, workspace check, port, plan", "connected", "launch"),
    ("launch sent -> first rank's script starts", "launch", "rank.start"),
    ("script start -> init_process_group done", "rank.start", "rank.rendezvous"),
    ("all_reduce", "rank.rendezvous", "rank.all_reduce"),
    ("destroy_process_group", "rank.all_reduce", "rank.destroyed"),
    ("script end -> every exit reported", "rank.destroyed", "reported"),
    ("result.json, state, telemetry close", "reported", "returned"),
    ("print, atexit, process exit", "returned", "exit"),
    ("whole CLI process", "exec", "exit"),
]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--typer", action="store_true", help="parse with Typer, as before the fast route")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="monarch-phases-") as tmp:
        root = Path(tmp)
        (root / "script.py").write_text(SCRIPT)
        (root / "driver.py").write_text(DRIVER)
        env = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}
        env.update(
            MONARCH_STATE=str(root / ".monarch" / "job_state.pkl"),
            MONARCH_CACHE_DIR=str(root / "cache"),
            PHASES_DIR=str(root),
            PHASES_OUT=str(root / "client.json"),
        )
        if args.typer:
            env["PHASES_TYPER"] = "1"
        monarch = [sys.executable, "-m", "monarch_cli"]

        def cli(*argv: str) -> subprocess.CompletedProcess:
            done = subprocess.run([*monarch, *argv], cwd=root, env=env, capture_output=True, text=True, timeout=180)
            if done.returncode != 0:
                raise SystemExit(f"monarch {' '.join(argv)} failed: {done.stderr}")
            return done

        cli("serve", "--hosts", "1", "--", "torchrun", "--nproc-per-node=2", "script.py")
        try:
            cli("run-spmd")
            deadline = time.monotonic() + 120  # the warm process learns the script's imports, in the background
            while time.monotonic() < deadline:
                w = json.loads(cli("warm", "--json").stdout)["hosts"][0]["warm"]
                if w and w["ready"] and not w["warming"] and (w["learned_held"] or not w.get("learning")):
                    break
                time.sleep(0.5)
            for _ in range(2):
                cli("run-spmd")
            runs: list[dict[str, float]] = []
            for _ in range(args.repeats):
                t0 = time.time()
                done = subprocess.run(
                    [sys.executable, str(root / "driver.py"), "run-spmd"],
                    cwd=root,
                    env=env,
                    capture_output=True,
                    text=True,
                    timeout=180,
                )
                t1 = time.time()
                if done.returncode != 0 or "cold" in done.stderr:
                    raise SystemExit(f"run failed or started cold: {done.stderr}")
                stamps = {"exec": t0, "exit": t1, **json.loads((root / "client.json").read_text())}
                ranks = [json.loads((root / f"rank{r}.json").read_text()) for r in (0, 1)]
                stamps["rank.start"] = min(r["start"] for r in ranks)
                for key in ("rendezvous", "all_reduce", "destroyed"):
                    stamps[f"rank.{key}"] = max(r[key] for r in ranks)
                runs.append(stamps)
                time.sleep(0.2)
        finally:
            subprocess.run([*monarch, "stop"], cwd=root, env=env, capture_output=True)
    rows = []
    for name, a, b in PHASES:
        spans = [1000 * (r[b] - r[a]) for r in runs]
        rows.append((name, f"{statistics.median(spans):.1f} ms", f"{min(spans):.1f} ms", f"{max(spans):.1f} ms"))
    route = "Typer" if args.typer else "default (fast route)"
    print_table(
        f"run-spmd phases, bare all-reduce, 2 ranks, {args.repeats} runs, CLI route: {route}",
        ("phase", "median", "min", "max"),
        rows,
    )


if __name__ == "__main__":
    main()
