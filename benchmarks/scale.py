"""How the client's cost grows with hosts: real local agents for small N, emulated ones beyond.

For each N, every command is a fresh ``monarch`` process, as a user runs it; its CPU is read
from ``wait4`` and its peak RSS from its ``VmHWM`` (the agents, which outlive ``serve``, are
not counted):

* real agents (local scheduler, ``--preload ''``: a trivial one-rank-per-host script):
  ``serve``, a re-run (best of 3), ``status``; the agents' idle CPU and memory;
* emulated agents (tests/emulated_cluster.py: real CURVE sockets and protocol, many agents
  per process; 8 ranks per host that exit at once): the relays' check ``serve`` makes, a re-run,
  ``status``, and, in one driver process, connect-and-handshake, a run's dispatch-to-all-exits
  and a host lost mid-run;
* both: ``stack``, ``diagnose`` and ``stop`` on a live run whose ranks hang (what a user
  inspects; nothing running, they would time a store read).

Prints a table, the per-host slopes (least squares over the real Ns) and writes
docs/img/scale.svg. Run it alone: ``flock /work/.heavy.lock python benchmarks/scale.py``.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

TRIVIAL = "import os; print('step 1 loss 2.31 rank', os.environ['RANK'])\n"
HANGS = "import time; print('step 1', flush=True); time.sleep(3600)\n"


def _cli_usage(
    args: list[str], cwd: Path, env: dict[str, str], timeout: float = 600, argv: list[str] | None = None
) -> dict[str, Any]:
    """One ``monarch`` command (or ``argv``): wall seconds, CPU seconds (user+sys, with the children it
    waited for, from ``wait4``), peak RSS MB (``VmHWM``, polled while it runs)."""
    with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
        started = time.monotonic()
        cmd = argv if argv is not None else [sys.executable, "-m", "monarch_cli", *args]
        proc = subprocess.Popen(cmd, cwd=cwd, env=env, stdout=out, stderr=err)
        deadline = started + timeout
        peak_kb = 0
        while True:
            peak_kb = max(peak_kb, _vm_hwm_kb(proc.pid))
            pid, status, usage = os.wait4(proc.pid, os.WNOHANG)
            if pid:
                break
            if time.monotonic() > deadline:
                proc.kill()
            time.sleep(0.01)
        wall = time.monotonic() - started
        proc.returncode = os.waitstatus_to_exitcode(status)
        out.seek(0)
        err.seek(0)
        res = {"wall": wall, "rc": proc.returncode, "out": out.read().decode(errors="replace")}
        res["err"] = err.read().decode(errors="replace")
    res["cpu"] = usage.ru_utime + usage.ru_stime
    res["rss"] = (
        peak_kb / 1024
    )  # (ru_maxrss would floor it at this benchmark's own peak: Linux carries that across exec)
    if res["rc"] != 0:
        print(f"  ! monarch {' '.join(args[:2])} exited {res['rc']}: {res['err'][-400:]}", file=sys.stderr)
    return res


def _vm_hwm_kb(pid: int) -> int:
    """A running process's peak RSS so far (its last reading before exit is within a 10 ms poll of the peak)."""
    try:
        with open(f"/proc/{pid}/status") as f:
            return next((int(line.split()[1]) for line in f if line.startswith("VmHWM:")), 0)
    except (OSError, ValueError):
        return 0


def _own_bytes(pids: list[int]) -> int | None:
    """Physical memory mapped by ``pids`` and by no other process, each page counted once.

    Summing USS would miss the pages a warm process shares with its spares (forked from it:
    mapped twice, unique to neither), and summing PSS would add shares of libraries every
    Python on the machine maps. A page is the host's own when the kernel's map count for it
    (``/proc/kpagecount``) is no more than the times these processes map it. Needs root (page
    frame numbers); None without."""
    import collections
    import struct

    mapped: collections.Counter[int] = collections.Counter()
    for pid in pids:
        try:
            with open(f"/proc/{pid}/maps") as f:
                ranges = [line.split()[0] for line in f if not line.rstrip().endswith("[vsyscall]")]
            fd = os.open(f"/proc/{pid}/pagemap", os.O_RDONLY)
        except OSError:
            continue  # gone meanwhile
        try:
            for r in ranges:
                lo, hi = (int(x, 16) for x in r.split("-"))
                data = os.pread(fd, (hi - lo) // 4096 * 8, lo // 4096 * 8)
                for (entry,) in struct.iter_unpack("<Q", data):
                    if entry >> 63 and entry & ((1 << 55) - 1):  # present, frame number visible
                        mapped[entry & ((1 << 55) - 1)] += 1
        finally:
            os.close(fd)
    if not mapped:
        return None
    own = 0
    try:
        with open("/proc/kpagecount", "rb") as counts:
            for pfn, n in mapped.items():
                counts.seek(pfn * 8)
                if struct.unpack("<Q", counts.read(8))[0] <= n:
                    own += 4096
    except OSError:
        return None
    return own


def _agents_footprint(state: Path) -> tuple[float, float]:
    """(mean CPU % of a core per agent over 10 s idle, mean MB of agent + its children per host:
    what they map and no other process does, or the sum of their PSS where that cannot be read)."""
    import psutil

    from monarch_cli.jobs.state import load_state

    pids = [h.pid for h in load_state(state).hosts if h.pid]
    procs = [psutil.Process(p) for p in pids]
    before = [p.cpu_times() for p in procs]
    time.sleep(10)
    after = [p.cpu_times() for p in procs]
    cpu = sum((a.user + a.system) - (b.user + b.system) for a, b in zip(after, before)) / 10 / len(procs) * 100
    mem = []
    for p in procs:
        tree = [p, *p.children(recursive=True)]
        own = _own_bytes([q.pid for q in tree])
        mem.append((own if own is not None else sum(q.memory_full_info().pss for q in tree)) / 2**20)
    return cpu, sum(mem) / len(mem)


def _cli_json(command: str, state: Path, cwd: Path, env: dict[str, str]) -> Any:
    """``monarch COMMAND --json``'s object (untimed: a poll); ValueError if it printed none."""
    done = subprocess.run(
        [sys.executable, "-m", "monarch_cli", command, "--json", "--state", str(state)],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
    )
    return json.loads(done.stdout)


def _settle(state: Path, cwd: Path, env: dict[str, str], timeout: float = 300) -> None:
    """Wait until every host's warm process holds what the runs taught it (``monarch warm``):
    a re-run timed while 128 warm processes are being rebuilt on 2 cores measures the rebuild."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            warm = [h.get("warm") for h in _cli_json("warm", state, cwd, env)["hosts"]]
        except (ValueError, KeyError, TypeError):
            warm = [None]
        if all(w and w["ready"] and not w["warming"] for w in warm):
            return
        time.sleep(1)
    print("  ! the warm processes did not settle; timing the re-run anyway", file=sys.stderr)


def _inspect_hung_run(
    run: list[str], ranks: int, state: Path, cwd: Path, env: dict[str, str], row: dict[str, Any]
) -> Any:
    """Start ``run`` (ranks that hang, as a run a user inspects does), wait until all ``ranks`` are
    running, then time ``stack`` and ``diagnose`` on it. Returns the run's process (``stop`` ends it)."""
    hung = subprocess.Popen(
        [sys.executable, "-m", "monarch_cli", *run],
        cwd=cwd,
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    deadline = time.monotonic() + 600
    running = 0
    while running < ranks and time.monotonic() < deadline and hung.poll() is None:
        try:
            running = sum(h.get("ranks_running") or 0 for h in _cli_json("status", state, cwd, env)["hosts"])
        except (ValueError, KeyError, TypeError):
            running = 0
    if running < ranks:
        print(f"  ! only {running} of {ranks} ranks started; stack and diagnose not timed", file=sys.stderr)
        return hung
    sk = _cli_usage(["stack", "--state", str(state), "--json"], cwd, env, timeout=900)
    row["stack"], row["stack_cpu"] = sk["wall"], sk["cpu"]
    try:
        groups = json.loads(sk["out"])["groups"]
        row["stack_ranks"], row["stack_groups"] = sum(len(g["ranks"]) for g in groups), len(groups)
    except (ValueError, KeyError, TypeError):
        row["stack_ranks"] = row["stack_groups"] = None
    dg = _cli_usage(["diagnose", "--state", str(state), "--json"], cwd, env, timeout=900)
    row["diagnose"], row["diagnose_cpu"] = dg["wall"], dg["cpu"]
    try:
        row["diagnose_verdict"] = json.loads(dg["out"])["verdict"]
    except (ValueError, KeyError, TypeError):
        row["diagnose_verdict"] = None
    return hung


def _end(hung: Any) -> None:
    """The hung run, once ``stop`` has told it: it exits by itself (killed if not, and said so)."""
    if hung is None:
        return
    try:
        hung.wait(120)
    except subprocess.TimeoutExpired:
        print("  ! the hung run did not end after stop; killed", file=sys.stderr)
        hung.kill()
        hung.wait()


def bench_real(n: int, work: Path) -> dict[str, Any]:
    d = work / f"real{n}"
    d.mkdir(parents=True)
    (d / "trivial.py").write_text(TRIVIAL)
    (d / "hangs.py").write_text(HANGS)
    # A cache of its own: what this user's other runs taught warm processes (torch, ...) is not
    # "a host without preload".
    env = {**os.environ, "PYTHONPATH": str(REPO), "NO_COLOR": "1", "MONARCH_CACHE_DIR": str(d / "cache")}
    state = d / ".monarch" / "job_state.pkl"
    row: dict[str, Any] = {"n": n, "kind": "real"}
    s = _cli_usage(["serve", "--hosts", str(n), "--preload", "", "--state", str(state)], d, env)
    row["serve"], row["serve_cpu"] = s["wall"], s["cpu"]
    hung = None
    try:
        run = ["run-spmd", "--state", str(state), "--no-sync", "--", "torchrun", "--nproc-per-node=1", "trivial.py"]
        _cli_usage(run, d, env)  # the first run teaches the warm process; time the re-run
        _settle(state, d, env)  # once what it taught is held: the re-run users see all day
        # Best of 3 (RSS: the worst): one re-run's CPU varies by more than the 1 ms/host line's margin.
        runs = [_cli_usage(run, d, env) for _ in range(3)]
        row["run"], row["run_cpu"] = min(r["wall"] for r in runs), min(r["cpu"] for r in runs)
        row["rss"] = max(r["rss"] for r in runs)
        st = _cli_usage(["status", "--state", str(state), "--json"], d, env)
        row["status"], row["status_cpu"] = st["wall"], st["cpu"]
        row["idle_cpu_pct"], row["host_mb"] = _agents_footprint(state)
        hang = ["run-spmd", "--state", str(state), "--no-sync", "--", "torchrun", "--nproc-per-node=1", "hangs.py"]
        hung = _inspect_hung_run(hang, n, state, d, env, row)
    finally:
        sp = _cli_usage(["stop", "--state", str(state)], d, env)  # with the hung run live: it is told
        row["stop"], row["stop_cpu"] = sp["wall"], sp["cpu"]
        _end(hung)
    return row


DRIVER = """
import io, json, resource, sys, time
from pathlib import Path
from monarch_cli.jobs import job_load
job = job_load(Path(sys.argv[1]))
t, c = time.monotonic(), time.process_time()
hs = job.hostset()
connect, connect_cpu = time.monotonic() - t, time.process_time() - c
from monarch_cli.jobs.plan import plan_spmd
from monarch_cli.jobs.spmd import SpmdRunner, new_run_id
from monarch_cli.jobs.torchrun import parse_command
from monarch_cli.jobs.output import OutputSink
spec = parse_command(["torchrun", "--nproc-per-node=8", "train.py"])
runner = SpmdRunner(hs, Path(sys.argv[2]))
out = []
for i in range(3):
    run_id = new_run_id()
    launches = plan_spmd(spec, hs, run_id, cold=False, master_port=29500, environ={"EMULATED_OUTPUT": "epoch 3 loss 2.31\\n"})
    sink = OutputSink(Path(sys.argv[2]) / run_id, {l.rank: l.label for l in launches}, stdout=io.BytesIO(), stderr=io.BytesIO())
    t, c = time.monotonic(), time.process_time()
    exits = runner.run(launches, run_id, sink)
    out.append((time.monotonic() - t, time.process_time() - c, len(exits)))
    sink.close()
rss = int(next(l.split()[1] for l in open("/proc/self/status") if l.startswith("VmHWM:"))) / 1024  # not ru_maxrss: Linux carries the parent's peak into it across fork+exec
# A host lost mid-run: ranks that hang, then one host stops answering heartbeats.
import threading
run_id = new_run_id()
launches = plan_spmd(spec, hs, run_id, cold=False, master_port=29500, environ={"EMULATED_HANG": "1"})
sink = OutputSink(Path(sys.argv[2]) / run_id, {l.rank: l.label for l in launches}, stdout=io.BytesIO(), stderr=io.BytesIO())
runner.grace = 1.0
done = {}
th = threading.Thread(target=lambda: done.setdefault("exits", runner.run(launches, run_id, sink)))
run_started = time.monotonic()
th.start()
beats = hs.mb._beats
deadline = time.monotonic() + 300
# Mid-run: once every host has acknowledged its ranks (a host lost before then, its request
# lost with it, fails the run's start instead: a different path).
sent = False
while time.monotonic() < deadline:
    waiting = bool(hs.mb._pending)
    sent = sent or waiting
    if sent and not waiting and len(beats.answered) >= len(hs.hosts):
        break
    time.sleep(0.01)
from tests.emulated_cluster import PER_PROCESS
victim_index = len(hs.hosts) // 2
victim = hs.hosts[victim_index].name
muted_at = time.monotonic()
(Path(sys.argv[3]) / f"emu{victim_index // PER_PROCESS * PER_PROCESS}.addr.mute").write_text(victim + "\\n")
th.join(600)
(Path(sys.argv[3]) / f"emu{victim_index // PER_PROCESS * PER_PROCESS}.addr.mute").write_text("unmute " + victim)  # the CLI rows: all hosts back
named = [e for e in done["exits"] if e.lost]
lost_after = run_started + max(e.duration for e in named) - muted_at if named else None
ended = time.monotonic() - muted_at
sink.close()
print(json.dumps({"connect": connect, "connect_cpu": connect_cpu, "dispatch": min(o[0] for o in out),
                  "dispatch_cpu": min(o[1] for o in out), "exits": out[-1][2], "rss": rss,
                  "lost_named": sorted({e.host for e in named}) == [victim], "lost_after": lost_after,
                  "lost_run_end": ended}))
"""


def bench_emulated(n: int, work: Path) -> dict[str, Any]:
    from tests.emulated_cluster import emulated_job

    d = work / f"emulated{n}"
    d.mkdir(parents=True)
    env = {**os.environ, "PYTHONPATH": str(REPO), "NO_COLOR": "1"}
    state = d / ".monarch" / "job_state.pkl"
    row: dict[str, Any] = {"n": n, "kind": "emulated"}
    t = time.monotonic()
    _, cluster = emulated_job(n, state, check=False)
    row["emulator_start"] = time.monotonic() - t
    try:
        # What `serve` does once its agents are up: ask every host (through relays from 64 hosts,
        # whose connections are then kept), as a fresh process. Emulated rows' "serve" is this.
        check = "import sys; from monarch_cli.jobs import job_load; sys.exit(len(job_load(sys.argv[1]).check_relays()))"
        ch = _cli_usage([], d, env, timeout=900, argv=[sys.executable, "-c", check, str(state)])
        row["serve"], row["serve_cpu"] = ch["wall"], ch["cpu"]
        drv = subprocess.run(
            [sys.executable, "-c", DRIVER, str(state), str(d / "driver-logs"), str(state.parent / "emulated")],
            env=env,
            capture_output=True,
            text=True,
            timeout=900,
        )
        if drv.returncode != 0:
            print(f"  ! driver failed: {drv.stderr[-1500:]}", file=sys.stderr)
        else:
            row.update({f"drv_{k}": v for k, v in json.loads(drv.stdout.strip().splitlines()[-1]).items()})
        run = ["run-spmd", "--state", str(state), "--no-sync", "-e", "EMULATED_OUTPUT=epoch 3 loss 2.31\n"]
        run += ["--", "torchrun", "--nproc-per-node=8", "train.py"]
        r = _cli_usage(run, d, env, timeout=900)
        row["run"], row["run_cpu"], row["rss"] = r["wall"], r["cpu"], r["rss"]
        row["run_lines"] = r["out"].count("\n")
        st = _cli_usage(["status", "--state", str(state), "--json"], d, env, timeout=900)
        row["status"], row["status_cpu"] = st["wall"], st["cpu"]
        hang = ["run-spmd", "--state", str(state), "--no-sync", "-e", "EMULATED_HANG=1"]
        hang += ["--", "torchrun", "--nproc-per-node=8", "train.py"]
        hung = _inspect_hung_run(hang, n * 8, state, d, env, row)
        sp = _cli_usage(["stop", "--state", str(state)], d, env, timeout=900)
        row["stop"], row["stop_cpu"] = sp["wall"], sp["cpu"]
        _end(hung)
    finally:
        cluster.close()
    return row


def _slope(rows: list[dict[str, Any]], key: str) -> float | None:
    pts = [(r["n"], r[key]) for r in rows if r.get(key) is not None]
    if len(pts) < 2:
        return None
    mx = sum(x for x, _ in pts) / len(pts)
    my = sum(y for _, y in pts) / len(pts)
    var = sum((x - mx) ** 2 for x, _ in pts)
    return sum((x - mx) * (y - my) for x, y in pts) / var if var else None


def _fmt(v: Any, unit: str = "s") -> str:
    if v is None:
        return "-"
    return f"{v:.2f}" if unit == "s" else f"{v:.0f}"


def write_svg(rows: list[dict[str, Any]], path: Path) -> None:
    """Seconds against hosts (both log scales), one line per command: a small hand-made SVG (no matplotlib here)."""
    import math

    series = {"serve": "#1f77b4", "run": "#d62728", "status": "#2ca02c", "stack": "#9467bd"}
    series |= {"diagnose": "#e377c2", "stop": "#8c564b"}
    w, h, left, bottom, top, right = 640, 400, 60, 50, 30, 110
    xs = [r["n"] for r in rows]
    values = [r[k] for r in rows for k in series if r.get(k)]
    # Decades on both axes: 0.2 s and 20 s lines are both read off the same plot.
    lo = math.floor(math.log10(min(values, default=0.1)))
    hi = max(math.ceil(math.log10(max(values, default=1.0))), lo + 1)

    def px(n: float) -> float:
        lo, hi = math.log2(min(xs)), math.log2(max(xs)) or 1
        return left + (math.log2(n) - lo) / ((hi - lo) or 1) * (w - left - right)

    def py(v: float) -> float:
        return h - bottom - (math.log10(max(v, 10**lo)) - lo) / (hi - lo) * (h - bottom - top)

    parts = [
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{w}" height="{h}" font-family="sans-serif" font-size="11">'
    ]
    parts.append(f'<rect width="{w}" height="{h}" fill="white"/>')
    parts.append(f'<text x="{left}" y="18" font-size="13">monarch-cli: seconds per command against hosts</text>')
    parts.append(f'<line x1="{left}" y1="{h - bottom}" x2="{w - right}" y2="{h - bottom}" stroke="black"/>')
    parts.append(f'<line x1="{left}" y1="{top}" x2="{left}" y2="{h - bottom}" stroke="black"/>')
    for n in xs:
        parts.append(f'<text x="{px(n):.0f}" y="{h - bottom + 15}" text-anchor="middle">{n}</text>')
    parts.append(
        f'<text x="{(w - right + left) / 2:.0f}" y="{h - 12}" text-anchor="middle">hosts (log scale; ≥1,024 emulated)</text>'
    )
    parts.append(
        f'<text x="14" y="{(h - bottom + top) / 2:.0f}" transform="rotate(-90 14 {(h - bottom + top) / 2:.0f})" '
        'text-anchor="middle">seconds (log scale)</text>'
    )
    for e in range(lo, hi + 1):
        v = 10.0**e
        parts.append(f'<text x="{left - 6}" y="{py(v) + 4:.0f}" text-anchor="end">{v:g}</text>')
        parts.append(f'<line x1="{left}" y1="{py(v):.0f}" x2="{w - right}" y2="{py(v):.0f}" stroke="#ddd"/>')
    for i, (key, color) in enumerate(series.items()):
        pts = [(px(r["n"]), py(r[key])) for r in rows if r.get(key) is not None]
        if pts:
            d = " ".join(f"{x:.1f},{y:.1f}" for x, y in pts)
            parts.append(f'<polyline points="{d}" fill="none" stroke="{color}" stroke-width="2"/>')
            parts.extend(f'<circle cx="{x:.1f}" cy="{y:.1f}" r="3" fill="{color}"/>' for x, y in pts)
        parts.append(f'<rect x="{w - right + 15}" y="{top + 18 * i}" width="12" height="3" fill="{color}"/>')
        parts.append(f'<text x="{w - right + 32}" y="{top + 18 * i + 5}">{key}</text>')
    parts.append("</svg>")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join(parts) + "\n")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--real", default="1,4,16,64,128", help="host counts run as real local agents (up to 8 per core)"
    )
    parser.add_argument("--emulated", default="1024,4096", help="host counts run emulated")
    parser.add_argument("--svg", default=str(REPO / "docs" / "img" / "scale.svg"))
    args = parser.parse_args()
    # Every command starts from written bytecode, as an installed tool's does: where
    # PYTHONDONTWRITEBYTECODE is set (this sandbox), a module edited since its .pyc was written
    # was compiled again by every CLI process (~5 ms for telemetry_store alone).
    subprocess.run([sys.executable, "-m", "compileall", "-q", str(REPO / "monarch_cli")], capture_output=True)
    os.environ.pop("PYTHONDONTWRITEBYTECODE", None)
    work = Path(tempfile.mkdtemp(prefix="monarch-scale-"))
    rows: list[dict[str, Any]] = []
    try:
        from monarch_cli.schedulers.local.scheduler import LocalScheduler

        cap = LocalScheduler().max_hosts()  # 8 per core: 16 on a 2-core machine
        for n in [int(x) for x in args.real.split(",") if x]:
            if n > cap:
                print(f"real agents: {n} hosts skipped: the local scheduler takes at most {cap} here", file=sys.stderr)
                continue
            print(f"real agents: {n} host(s)...", file=sys.stderr, flush=True)
            rows.append(bench_real(n, work))
            print(f"  {rows[-1]}", file=sys.stderr, flush=True)
        for n in [int(x) for x in args.emulated.split(",") if x]:
            print(f"emulated agents: {n} hosts...", file=sys.stderr, flush=True)
            rows.append(bench_emulated(n, work))
            print(f"  {rows[-1]}", file=sys.stderr, flush=True)
    except BaseException:
        shutil.rmtree(work, ignore_errors=True)
        raise
    cols = ["hosts", "serve s", "run s", "status s", "stack s", "diagnose s", "stop s", "serve CPU", "run CPU"]
    cols += ["run RSS MB"]
    cols += ["connect s", "dispatch→exits s", "idle agent %core", "host MB"]
    table = []
    for r in rows:
        table.append(
            [
                f"{r['n']:,}{'' if r['kind'] == 'real' else ' (emulated, x8 ranks)'}",
                _fmt(r.get("serve")),
                _fmt(r.get("run")),
                _fmt(r.get("status")),
                _fmt(r.get("stack")),
                _fmt(r.get("diagnose")),
                _fmt(r.get("stop")),
                _fmt(r.get("serve_cpu")),
                _fmt(r.get("run_cpu")),
                _fmt(r.get("rss"), "mb"),
                _fmt(r.get("drv_connect")),
                _fmt(r.get("drv_dispatch")),
                f"{r['idle_cpu_pct']:.2f}" if "idle_cpu_pct" in r else "-",
                _fmt(r.get("host_mb"), "mb"),
            ]
        )
    import platform

    print(f"monarch-cli scale: one fresh CLI process per command; {platform.node()}, {os.cpu_count()} cores")
    print("| " + " | ".join(cols) + " |")
    print("|" + "---|" * len(cols))
    for line in table:
        print("| " + " | ".join(line) + " |")
    real = [r for r in rows if r["kind"] == "real"]
    print("per-host slopes over the real agents (least squares, ms per host):")
    for key in ("serve", "serve_cpu", "run", "run_cpu", "status", "stack", "diagnose", "stop"):
        s = _slope(real, key)
        print(f"  {key:<10} {'-' if s is None else f'{s * 1000:.2f}'}")
    print(
        "stack, diagnose and stop on a live run whose ranks hang (stacks captured and their groups; diagnose's verdict):"
    )
    for r in rows:
        print(
            f"  {r['n']:,} hosts: {r.get('stack_ranks', '-')} stacks in {r.get('stack_groups', '-')} group(s), "
            f"diagnose: {r.get('diagnose_verdict', '-')}"
        )
    emulated = [r for r in rows if r["kind"] == "emulated"]
    if emulated:
        print("emulated (driver process: connect-and-handshake; dispatch-to-all-exits, best of 3; its RSS):")
        for r in emulated:
            print(
                f"  {r['n']:,} hosts: connect {_fmt(r.get('drv_connect'))} s (CPU {_fmt(r.get('drv_connect_cpu'))} s), "
                f"dispatch→exits {_fmt(r.get('drv_dispatch'))} s (CPU {_fmt(r.get('drv_dispatch_cpu'))} s, "
                f"{r.get('drv_exits', '-')} exits), driver RSS {_fmt(r.get('drv_rss'), 'mb')} MB, "
                f"CLI run printed {r.get('run_lines', '-')} lines; a host muted mid-run: named "
                f"{r.get('drv_lost_named')} after {_fmt(r.get('drv_lost_after'))} s, run ended "
                f"{_fmt(r.get('drv_lost_run_end'))} s after the mute"
            )
    if real and any(r["kind"] == "emulated" for r in rows):
        write_svg(rows, Path(args.svg))
        print(f"plot: {args.svg}")
    else:  # a partial run does not replace the plot of a whole one
        print("plot: not written (it needs real and emulated rows)")
    print(json.dumps(rows), flush=True)
    shutil.rmtree(work, ignore_errors=True)  # (tens of thousands of log files: after the figures)
    return 0


if __name__ == "__main__":
    sys.exit(main())
