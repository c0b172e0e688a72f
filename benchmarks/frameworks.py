"""Real training frameworks: cold torchrun vs every ``monarch run-spmd`` after one serve, in one run.

    python benchmarks/frameworks.py [--runs 6] [--cold-repeats 2] [--only hf_trainer,...]
                                    [--layouts 1x2,2x1] [--device auto|cpu|cuda] [--bare]

The scripts of ``benchmarks/frameworks/``: a bare all-reduce, plain DDP on an MLP (50 steps),
Hugging Face Trainer with a tiny GPT-2 from a config, Lightning ``strategy="ddp"``, an Accelerate
loop, an FSDP2/DTensor trainer. Each prints ``param-checksum`` (its final parameters) and
``script-seconds``. For each script and layout, in this order and this process:

* **cold torchrun** (``--cold-repeats`` times; the ratios divide their median):
  ``torchrun --standalone --nproc-per-node=R`` on 1 host; on H hosts, H ``torchrun --nnodes=H
  --node-rank=i`` started together (one per host);
* **runs 1..N after one serve**: ``monarch serve --hosts H -- torchrun --nproc-per-node=R
  script`` once, in a workspace, state file and cache of its own (a first serve of this script),
  then ``--runs`` whole CLI processes ``monarch run-spmd``, back to back, each shown with its
  ratio against cold torchrun: no median, no best-of, no waiting for the warm processes to settle;
* **--keep-ranks**: the same again, a second serve, with ``monarch run-spmd --keep-ranks`` (where
  this build's ``run-spmd --help`` has the flag; otherwise the row says n/a);
* **own / overhead**: the last run's least ``script-seconds`` of any rank (the rank that started
  last waited for no other) and the run minus it;
* **checksums**: every run's must equal cold torchrun's, else the benchmark exits 1 (after the
  table: one mismatch or failed case leaves the other rows measured).

**Environment.** By default the full ML environment of every GPU image: pyarrow, scikit-learn
and datasets importable (transformers imports them when present; the test extra installs them).
Where one is missing the benchmark refuses unless ``--bare``; the table title says which ran.
**Device.** ``--device cuda`` (the default where torch sees a GPU) runs every script on
``LOCAL_RANK``'s GPU with nccl (``FW_DEVICE=cuda``, read by ``frameworks/fwcommon.py``): one rank
per GPU, 1 host (default layout 1x1). On the CPU: gloo, layouts 1x2 and 2x1.

Targets (issue 37): from the second run after serve, every re-run >= 15x faster than cold
torchrun; on one GPU, plain DDP <= 0.7 s and HF Trainer <= 1.0 s; checksums equal cold torchrun's.
"""

from __future__ import annotations

import argparse
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from _common import print_table
from _fwcase import (
    MONARCH,
    REPO,
    SCRIPTS,
    CaseFailed,
    Layout,
    Reservation,
    Run,
    cold,
    gpus,
    has_keep_ranks,
    interpreter_start,
    missing_full_env,
)

NAMES = ["allreduce", "ddp_mlp", "hf_trainer", "lightning_ddp", "accelerate_loop", "fsdp2_trainer", "compiled_mlp"]
PACKAGES = {"pyarrow": "pyarrow", "sklearn": "scikit-learn", "datasets": "datasets"}
TARGET = 15.0  # x cold torchrun, from the second run after serve
GPU_TARGETS = {"ddp_mlp": 0.7, "hf_trainer": 1.0}  # seconds a re-run may take on one GPU
NO_KEEP = "n/a (no --keep-ranks in this build)"


@dataclass
class Served:
    """One reservation: its serve, runs 1..N, the warm modules after them; or why it did not run."""

    mode: str
    serve_s: float | None = None
    runs: list[Run] = field(default_factory=list)
    modules: str = ""
    error: str | None = None


@dataclass
class Row:
    """One script on one layout: its cold torchrun runs and its reservations."""

    name: str
    layout: Layout
    colds: list[Run] = field(default_factory=list)
    served: list[Served] = field(default_factory=list)
    error: str | None = None

    @property
    def reference(self) -> str | None:
        return self.colds[0].checksum if self.colds else None

    @property
    def cold_s(self) -> float:
        return statistics.median(r.seconds for r in self.colds)

    def mismatches(self) -> list[str]:
        if self.colds and self.reference is None:
            return ["cold torchrun printed no checksum"]
        out = [f"cold torchrun {i + 1}" for i, r in enumerate(self.colds) if r.checksum != self.reference]
        for s in self.served:
            out += [f"{s.mode} run {i + 1}" for i, r in enumerate(s.runs) if r.checksum != self.reference]
        return out


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--runs", type=int, default=6, help="CLI runs after one serve (each shown)")
    parser.add_argument("--cold-repeats", type=int, default=2, help="cold torchrun runs per case")
    parser.add_argument("--only", default=",".join(NAMES), help="scripts, comma-separated")
    parser.add_argument("--layouts", help="HOSTSxRANKS, comma-separated (CPU: 1x2,2x1; GPU: 1x1)")
    parser.add_argument(
        "--device", choices=["auto", "cpu", "cuda"], default="auto", help="auto: cuda if torch sees one"
    )
    parser.add_argument("--bare", action="store_true", help="run even where pyarrow/scikit-learn/datasets are missing")
    parser.add_argument("--no-keep-ranks", action="store_true", help="skip the --keep-ranks reservations")
    parser.add_argument("--budget-s", type=float, default=0, help="start no case past this many seconds (0: none)")
    parser.add_argument("--timeout-s", type=float, default=600, help="the longest one process may take")
    args = parser.parse_args()
    unknown = set(args.only.split(",")) - set(NAMES)
    if unknown:
        parser.error(f"--only: no script {', '.join(sorted(unknown))} (there are {', '.join(NAMES)})")
    if args.runs < 2 or args.cold_repeats < 1:
        parser.error("--runs 2 or more, --cold-repeats 1 or more")
    return args


def environment(bare: bool) -> str:
    """The table's word for the environment; refuses a bare one unless ``--bare``."""
    missing = [PACKAGES[m] for m in missing_full_env()]
    if not missing:
        if bare:
            print("  --bare: pyarrow, scikit-learn and datasets all import here: this is the full environment")
        return "full environment (pyarrow, scikit-learn, datasets import)"
    if not bare:
        raise SystemExit(
            f"the full environment needs {', '.join(missing)}: install them (pip install pyarrow scikit-learn "
            "datasets; the test extra has them) or pass --bare to measure without them"
        )
    return f"bare environment (--bare; {', '.join(missing)} missing)"


@dataclass(frozen=True)
class Setup:
    """What this invocation measures: the environment, the device, the layouts, the CLI's flags."""

    env_title: str
    device: str
    device_title: str
    layouts: list[Layout]
    keep_ok: bool


def setup(args: argparse.Namespace) -> Setup:
    """The environment (refused if bare without ``--bare``), ``cpu`` or ``cuda`` and the layouts it can run."""
    env_title = environment(args.bare)
    keep_ok = has_keep_ranks(dict(os.environ))
    count, gpu_name = gpus() if args.device != "cpu" else (0, "")
    device = args.device if args.device != "auto" else ("cuda" if count else "cpu")
    if device == "cpu":
        layouts = [Layout.parse(t) for t in (args.layouts or "1x2,2x1").split(",")]
        return Setup(env_title, "cpu", "CPU, gloo", layouts, keep_ok)
    if not count:
        raise SystemExit("--device cuda: torch sees no GPU here")
    layouts = [Layout.parse(t) for t in (args.layouts or ("1x1" if count == 1 else "1x1,1x2")).split(",")]
    for layout in layouts:
        if layout.hosts != 1 or layout.ranks > count:  # local hosts would all put LOCAL_RANK 0 on GPU 0
            raise SystemExit(f"--device cuda: layout {layout}: 1 host, one rank per GPU ({count} here)")
    return Setup(env_title, "cuda", f"GPU, nccl: {count} x {gpu_name}", layouts, keep_ok)


def serve_and_run(
    cwd: Path, script: Path, layout: Layout, env: dict[str, str], keep: bool, args: argparse.Namespace
) -> Served:
    """One serve, then ``--runs`` CLI runs back to back; the reservation is stopped whatever happens."""
    served = Served("--keep-ranks" if keep else "fresh ranks")
    reservation = Reservation(cwd, script, layout, env, keep_ranks=keep)
    try:
        served.serve_s = reservation.serve(args.timeout_s)
        for _ in range(args.runs):
            served.runs.append(reservation.run(args.timeout_s))
        served.modules = reservation.modules()
    except CaseFailed as e:
        served.error = str(e)
    finally:
        reservation.stop()
    return served


def measure(root: Path, name: str, layout: Layout, env: dict[str, str], keep_ok: bool, args: argparse.Namespace) -> Row:
    row, script = Row(name, layout), SCRIPTS / f"{name}.py"
    cwd = root / f"{name}-{layout}"
    cwd.mkdir()
    try:
        row.colds = [cold(script, layout, cwd, env, args.timeout_s) for _ in range(args.cold_repeats)]
    except CaseFailed as e:
        row.error = str(e)
        return row
    row.served.append(serve_and_run(cwd / "fresh", script, layout, env, False, args))
    if args.no_keep_ranks:
        return row
    if keep_ok:
        row.served.append(serve_and_run(cwd / "keep-ranks", script, layout, env, True, args))
    else:
        row.served.append(Served("--keep-ranks", error=NO_KEEP))
    return row


def cells(row: Row, runs: int) -> list[list[str]]:
    """The table's lines for one row: one per reservation (or one saying why none ran)."""
    width = 4 + runs + 3
    if row.error is not None:
        return [[row.name, "", row.error, *[""] * (width - 3)]]
    colds = " / ".join(f"{r.seconds:.2f}" for r in row.colds) + " s"
    lines = []
    for i, s in enumerate(row.served):
        head = [row.name if i == 0 else "", s.mode, colds if i == 0 else ""]
        if s.error == NO_KEEP:
            lines.append([*head, "n/a", *["n/a"] * runs, "", "", ""])
            continue
        line = [*head, f"{s.serve_s:.2f} s" if s.serve_s is not None else "-"]
        for r in s.runs:
            sums = "" if r.checksum == row.reference else " (checksum differs!)"
            line.append(f"{r.seconds:.2f} s {row.cold_s / r.seconds:.1f}x{sums}")
        if s.error is not None:
            line.append(f"failed: {s.error}")
        line += [""] * (4 + runs - len(line))
        last = s.runs[-1] if len(s.runs) == runs else None
        own = last.own if last is not None else None
        line.append(f"{own:.3f} / {last.seconds - own:.3f} s" if last is not None and own is not None else "")
        line.append(s.modules)
        bad = row.mismatches()
        line.append(f"{(row.reference or 'none')[:12]}{' DIFFERS' if bad else ' all equal'}" if i == 0 else "")
        lines.append(line)
    return lines


def verdicts(row: Row, device: str) -> list[str]:
    """One line per reservation against issue 37's targets."""
    if row.error is not None:
        return [f"{row.name} {row.layout}: {row.error}"]
    out = []
    for s in row.served:
        what = f"{row.name} {row.layout} {s.mode}"
        if s.error is not None or len(s.runs) < 2:
            out.append(f"{what}: {s.error or 'no re-run'}")
            continue
        rerun = s.runs[1:]
        ratios = [row.cold_s / r.seconds for r in rerun]
        line = (
            f"{what}: runs 2-{len(s.runs)} {min(ratios):.1f}x-{max(ratios):.1f}x cold torchrun "
            f"(>= {TARGET:.0f}x from run 2: {'met' if min(ratios) >= TARGET else 'NOT met'})"
        )
        limit = GPU_TARGETS.get(row.name) if device == "cuda" else None
        if limit is not None:
            slowest = max(r.seconds for r in rerun)
            line += f"; slowest re-run {slowest:.2f} s (<= {limit} s: {'met' if slowest <= limit else 'NOT met'})"
        out.append(line)
    bad = row.mismatches()
    out.append(f"{row.name} {row.layout}: checksums " + (f"DIFFER: {', '.join(bad)}" if bad else "all equal"))
    return out


def bench_env(root: Path, device: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}
    env.update(HF_HUB_OFFLINE="1", MONARCH_LEARN_PRELOAD="1", FW_DEVICE=device, MONARCH_CACHE_DIR=str(root / "cache"))
    if device == "cuda":  # cold and warm alike: cuBLAS deterministic (fwcommon sets it too, for other launches)
        env["CUBLAS_WORKSPACE_CONFIG"] = ":4096:8"
    return env


def run_all(args: argparse.Namespace, at: Setup) -> list[Row]:
    """Every case, in layout order; past ``--budget-s`` the rest are listed as skipped."""
    rows: list[Row] = []
    started, longest = time.monotonic(), 0.0
    with tempfile.TemporaryDirectory(prefix="monarch-fw-bench-") as tmp:
        root = Path(tmp)
        env = bench_env(root, at.device)
        for layout in at.layouts:
            for name in args.only.split(","):
                if args.budget_s and time.monotonic() - started + longest > args.budget_s:
                    rows.append(Row(name, layout, error=f"skipped: past --budget-s {args.budget_s:.0f}"))
                    continue
                t = time.monotonic()
                rows.append(measure(root, name, layout, env, at.keep_ok, args))
                longest = max(longest, time.monotonic() - t)
                for line in cells(rows[-1], args.runs):
                    print(f"  {layout}  " + "  ".join(c for c in line if c), flush=True)
    return rows


def report(rows: list[Row], args: argparse.Namespace, at: Setup) -> None:
    runs = [f"run {i + 1} (x cold)" for i in range(args.runs)]
    columns = (
        "script",
        "run-spmd",
        "cold torchrun",
        "serve",
        *runs,
        "last run: own / overhead",
        "warm mods",
        "checksum",
    )
    no_keep = any(s.error == NO_KEEP for row in rows for s in row.served)
    for layout in at.layouts:
        lines = [line for row in rows if row.layout == layout for line in cells(row, args.runs)]
        print_table(
            f"frameworks, {at.env_title}, {at.device_title}, {layout.label}: runs 1-{args.runs} after one serve",
            columns,
            lines,
            caption=f"{NO_KEEP}: `monarch run-spmd --help` has no --keep-ranks" if no_keep else None,
            width=240,
        )
    for row in rows:
        for line in verdicts(row, at.device):
            print("  " + line)
    start, bare = interpreter_start(), interpreter_start("-S")
    print(
        f"  interpreter start here (in every CLI run's overhead): python -c pass {start * 1000:.0f} ms, "
        f"without site-packages' .pth files (-S) {bare * 1000:.0f} ms"
    )


def main() -> None:
    args = parse_args()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # `timeout`: stop the reservations on the way out
    subprocess.run([sys.executable, "-m", "compileall", "-q", str(REPO / "monarch_cli")], capture_output=True)
    at = setup(args)
    keep = "accepted" if at.keep_ok else "not in this build"
    print(f"  {at.env_title}; {at.device_title}; {' '.join(MONARCH[1:])} run-spmd --keep-ranks: {keep}", flush=True)
    rows = run_all(args, at)
    report(rows, args, at)
    failed = [r.name for r in rows if r.error is not None and not r.error.startswith("skipped")]
    failed += [f"{r.name} {s.mode}" for r in rows for s in r.served if s.error not in (None, NO_KEEP)]
    mismatched = [r.name for r in rows if r.mismatches()]
    if failed or mismatched:
        raise SystemExit(f"failed: {', '.join(failed) or 'none'}; checksums differ: {', '.join(mismatched) or 'none'}")


if __name__ == "__main__":
    main()
