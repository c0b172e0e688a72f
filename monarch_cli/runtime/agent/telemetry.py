"""The agent's side of telemetry: samples of its ranks' processes, their step times, their stacks.

* About once a second, for every live rank, the agent sends the rank's owner (the
  ``run-spmd`` client) an :class:`~..protocol.Telemetry` message:
  process state, CPU, RSS, threads (psutil), the GPU it uses (NVML, when the host has
  GPUs and ``nvidia-ml-py`` is installed; otherwise those fields are None), and the step
  records the rank's optimizer hook stored since (see :mod:`..rank.telemetry`).
* ``telemetry_sample``: the same, now, for any holder of the keys (``monarch top``).
* ``telemetry_stacks``: every live rank's Python stack, captured in parallel in a thread
  with ``py-spy dump``; a rank py-spy cannot attach to is asked for the interpreter's own
  dump (faulthandler, on :data:`~..rank.telemetry.STACK_SIGNAL`).
* when a rank ends, its last step records go to its owner just before its exit is reported
  (:meth:`TelemetryHost.rank_ended`), so the run's ``steps`` are complete when it returns.
"""

from __future__ import annotations

import json
import os
import queue
import re
import shutil
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from ...config import env
from ...sysutil import private_tmpdir
from .. import protocol
from ..rank.telemetry import STACK_SIGNAL, STEP_HEADER, STEP_TIME, paths

if TYPE_CHECKING:
    from .core import AgentCore
    from .ranks import _Rank

PUSH_INTERVAL = env.telemetry_interval  # read once, when the agent imports this module
_PY_SPY_TIMEOUT = 5.0
_DUMP_WAIT = 3.0  # an upper bound: dumps that finish sooner end the wait (a loaded host is slow to schedule them)
_FH_THREAD = re.compile(r"^(?:Current thread|Thread) (0x[0-9a-f]+)")
_FH_FRAME = re.compile(r'^\s+File "(.*)", line (\d+) in (.*)$')

Sample = tuple[Any, ...]  # a row of the samples table
Step = tuple[Any, ...]  # a row of the steps table


class TelemetryHost:
    def __init__(self, agent: AgentCore) -> None:
        self.agent = agent
        self.dir = private_tmpdir("telemetry")  # 0700: step and stack files of our ranks
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_r, False)
        os.set_blocking(self._wake_w, False)
        agent.watch_fd(self._wake_r)
        self._done: queue.Queue[tuple[str, int, bool, Any]] = queue.Queue()
        self._procs: dict[int, Any] = {}  # pid -> psutil.Process (cpu_percent needs the previous call)
        self._offsets: dict[str, int] = {}  # step file -> steps read
        self._pending: dict[tuple[str, int], list[Step]] = {}  # step rows not yet sent to the owner
        self._last_step: dict[tuple[str, int], Step] = {}
        self._next_push = 0.0
        self._gpu: _Gpu | None = None
        self._gpu_tried = False

    def info(self) -> dict[str, Any]:
        return {"telemetry_dir": self.dir}

    # ------------------------------------------------------------ requests
    def handlers(self) -> dict[type, Callable[[Any, list[Any]], None]]:
        """The messages this part of the agent answers."""
        return {protocol.TelemetrySample: self._on_sample, protocol.TelemetryStacks: self._on_stacks}

    def _on_sample(self, msg: protocol.TelemetrySample, _body: list[Any]) -> None:
        ranks = self._live(msg.run_id)
        self._read_steps(ranks)
        self.agent.reply(
            msg.reply_to,
            msg.cid,
            True,
            {
                "host": self.agent.host,
                "samples": self._sample(ranks),
                "steps": {r.rank: self._last_step.get((r.run_id, r.rank)) for r in ranks},
            },
        )

    def _on_stacks(self, msg: protocol.TelemetryStacks, _body: list[Any]) -> None:
        ranks = [r for r in self._live(msg.run_id) if msg.ranks is None or r.rank in msg.ranks]
        targets = [(r.run_id, r.rank, r.pid) for r in ranks]
        threading.Thread(
            target=self._capture, args=(msg.reply_to, msg.cid, targets, bool(msg.native)), daemon=True
        ).start()

    def tick(self, events: dict[Any, int]) -> None:
        if self._wake_r in events:
            try:
                while os.read(self._wake_r, 4096):
                    pass
            except BlockingIOError:
                pass
        while True:
            try:
                reply_to, cid, ok, value = self._done.get_nowait()
            except queue.Empty:
                break
            self.agent.reply(reply_to, cid, ok, value)
        now = time.monotonic()
        if now >= self._next_push:
            self._next_push = now + PUSH_INTERVAL
            self._push()

    def close(self) -> None:
        shutil.rmtree(self.dir, ignore_errors=True)

    # ------------------------------------------------------------- samples
    def _live(self, run_id: str | None) -> list[_Rank]:
        live = [r for r in self.agent.ranks.by_pid.values() if r.status is None and r.pid is not None]
        if run_id is None and live:
            run_id = max(r.run_id for r in live)
        return sorted((r for r in live if r.run_id == run_id), key=lambda r: r.rank)

    def _push(self) -> None:
        live = [r for r in self.agent.ranks.by_pid.values() if r.status is None and r.pid is not None and r.sampled]
        for pid in set(self._procs) - {r.pid for r in live}:
            del self._procs[pid]
        if not live:
            return
        self._read_steps(live)
        groups: dict[tuple[str, str], list[_Rank]] = {}
        for r in live:
            groups.setdefault((r.owner, r.run_id), []).append(r)
        for (owner, run_id), ranks in groups.items():
            steps: list[Step] = []
            for r in ranks:
                steps += self._pending.pop((run_id, r.rank), [])
            self.agent.send(owner, protocol.Telemetry(run_id, self.agent.host, self._sample(ranks), steps))

    def _sample(self, ranks: list[_Rank]) -> list[Sample]:
        import psutil

        gpu = self._gpu_sample()
        rows: list[Sample] = []
        now = time.time()
        for r in ranks:
            pid = r.pid
            assert pid is not None, "only running ranks are sampled"
            proc = self._procs.get(pid)
            try:
                if proc is None:
                    proc = self._procs[pid] = psutil.Process(pid)
                with proc.oneshot():
                    state = proc.status()
                    cpu = proc.cpu_percent(None)
                    rss = proc.memory_info().rss / 2**20
                    threads = proc.num_threads()
            except (psutil.Error, OSError):
                continue
            g = gpu.get(pid, (None, None, None, None, None))
            rows.append((r.run_id, r.rank, self.agent.host, now, pid, state, cpu, round(rss, 1), threads, *g))
        return rows

    def _gpu_sample(self) -> dict[int, tuple[Any, ...]]:
        if not self._gpu_tried:
            self._gpu_tried = True
            self._gpu = _Gpu.open()
        if self._gpu is None:
            return {}
        try:
            return self._gpu.by_pid()
        except Exception:  # noqa: BLE001 - a driver hiccup must not stop the agent
            return {}

    # --------------------------------------------------------------- steps
    def _read_steps(self, ranks: list[_Rank]) -> None:
        for r in ranks:
            self._read_file(r.run_id, r.rank, paths(self.dir, r.run_id, r.rank)["steps"])

    def _read_file(self, run_id: str, rank: int, path: str) -> None:
        """The steps the rank's hook stored since the last read (the format: :data:`..rank.telemetry.STEP_HEADER`)."""
        done = self._offsets.get(path, 0)  # steps already read
        first = max(done - 1, 0)  # the previous step's time too: dt_ms is the difference
        try:
            with open(path, "rb") as f:
                head = f.read(STEP_HEADER.size)
                if len(head) < STEP_HEADER.size:
                    return
                count, anchor, prev = STEP_HEADER.unpack(head)
                if count <= done:
                    return
                f.seek(STEP_HEADER.size + first * STEP_TIME.size)
                data = f.read((count - first) * STEP_TIME.size)
        except OSError:
            return
        times = [t for (t,) in STEP_TIME.iter_unpack(data[: len(data) - len(data) % STEP_TIME.size])]
        if done:
            prev, times = times[0], times[1:]
        rows: list[Step] = []
        for t in times:
            if t < prev or t <= 0.0:  # not stored yet (a weakly ordered CPU): read it next time
                break
            rows.append((run_id, rank, done + len(rows) + 1, anchor + t, (t - prev) * 1000.0))
            prev = t
        if not rows:
            return
        self._offsets[path] = done + len(rows)
        self._pending.setdefault((run_id, rank), []).extend(rows)
        self._last_step[(run_id, rank)] = rows[-1]

    def rank_ended(self, rank: _Rank) -> None:
        """The rank is gone (called just before its exit is reported): send its last step records, drop its files."""
        key = (rank.run_id, rank.rank)
        files = paths(self.dir, rank.run_id, rank.rank)
        self._read_file(rank.run_id, rank.rank, files["steps"])
        steps = self._pending.pop(key, [])
        if steps:
            self.agent.send(rank.owner, protocol.Telemetry(rank.run_id, self.agent.host, [], steps))
        self._last_step.pop(key, None)
        for path in files.values():
            self._offsets.pop(path, None)
            try:
                os.unlink(path)
            except OSError:
                pass

    # -------------------------------------------------------------- stacks
    def _capture(self, reply_to: str, cid: int, targets: list[tuple[str, int, int]], native: bool) -> None:
        try:
            result = capture_stacks(self.dir, self.agent.host, targets, native)
            self._done.put((reply_to, cid, True, result))
        except Exception as e:  # noqa: BLE001
            self._done.put((reply_to, cid, False, f"stack capture failed on {self.agent.host}: {e}"))
        try:
            os.write(self._wake_w, b"x")
        except OSError:
            pass


def py_spy_path() -> str | None:
    """``env.py_spy`` if set (empty: do not use py-spy), else py-spy next to this Python or on PATH."""
    forced = env.py_spy
    if forced is not None:
        return forced or None
    beside = os.path.join(os.path.dirname(sys.executable), "py-spy")
    return beside if os.access(beside, os.X_OK) else shutil.which("py-spy")


def capture_stacks(
    directory: str, host: str, targets: list[tuple[str, int, int]], native: bool
) -> list[dict[str, Any]]:
    """Each target's stack: py-spy for all at once, the interpreter's own dump for the rest."""
    spy = py_spy_path()
    started: dict[int, Any] = {}
    errors: dict[int, str] = {}
    if spy:
        for _, _, pid in targets:
            cmd = [spy, "dump", "--pid", str(pid), "--json", *(["--native"] if native else [])]
            try:
                started[pid] = subprocess.Popen(
                    cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, stdin=subprocess.DEVNULL
                )
            except OSError as e:
                errors[pid] = f"py-spy: {e.strerror or e}"
    else:
        errors = {pid: "py-spy not available" for _, _, pid in targets}
    out: dict[int, dict[str, Any]] = {}
    for run_id, rank, pid in targets:
        entry = {
            "run_id": run_id,
            "rank": rank,
            "host": host,
            "pid": pid,
            "ts": time.time(),
            "method": "py-spy",
            "threads": [],
            "error": None,
        }
        out[pid] = entry
        proc = started.get(pid)
        if proc is None:
            continue
        try:
            stdout, stderr = proc.communicate(timeout=_PY_SPY_TIMEOUT)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.communicate()
            errors[pid] = "py-spy timed out"
            continue
        if proc.returncode != 0:
            text = stderr.decode("utf-8", "replace").strip().splitlines()
            errors[pid] = "py-spy: " + (text[0] if text else f"exit {proc.returncode}")
            continue
        try:
            entry["threads"] = _from_py_spy(json.loads(stdout), pid)
        except (ValueError, KeyError, TypeError) as e:
            errors[pid] = f"py-spy output unreadable: {e}"
    fallback = [(run_id, rank, pid) for run_id, rank, pid in targets if pid in errors]
    if fallback:
        dumps = _faulthandler_dumps(directory, fallback)
        for _run_id, _rank, pid in fallback:
            entry = out[pid]
            threads = dumps.get(pid)
            if threads:
                entry.update(method="faulthandler", threads=threads, fallback=errors[pid])
            else:
                entry.update(method="none", error=f"{errors[pid]}; and no faulthandler dump")
    return [out[pid] for _, _, pid in targets]


def _from_py_spy(data: list[dict[str, Any]], pid: int) -> list[dict[str, Any]]:
    threads = []
    for t in data:
        frames = [
            {"function": f.get("name"), "file": f.get("filename"), "line": f.get("line")} for f in t.get("frames", [])
        ]
        threads.append(
            {
                "name": t.get("thread_name") or hex(t.get("thread_id") or 0),
                "main": t.get("thread_name") == "MainThread" or t.get("os_thread_id") == pid,
                "frames": frames,
            }
        )
    return threads


def _faulthandler_dumps(directory: str, targets: list[tuple[str, int, int]]) -> dict[int, list[dict[str, Any]]]:
    """Signal each rank to dump its own threads (faulthandler) and read the dumps back."""
    files: dict[int, tuple[str, int]] = {}
    for run_id, rank, pid in targets:
        path = paths(directory, run_id, rank)["stack"]
        try:
            size = os.path.getsize(path)
        except OSError:
            continue
        if size == 0:  # the rank has not registered the handler: the signal would kill it
            continue
        try:
            os.kill(pid, STACK_SIGNAL)
        except OSError:
            continue
        files[pid] = (path, size)
    deadline = time.monotonic() + _DUMP_WAIT
    sizes: dict[int, int] = {}
    stable = 0
    while files and time.monotonic() < deadline:
        time.sleep(0.02)
        now = {pid: os.path.getsize(path) for pid, (path, _) in files.items()}
        grown = all(now[pid] > before for pid, (_, before) in files.items())
        stable = stable + 1 if grown and now == sizes else 0
        sizes = now
        if stable >= 2:
            break
    out = {}
    for pid, (path, before) in files.items():
        with open(path, "rb") as f:
            head = f.readline().decode("ascii", "replace").split()
            f.seek(before)
            text = f.read().decode("utf-8", "replace")
        main = head[1] if len(head) == 2 else None
        out[pid] = parse_faulthandler(text, main)
    return out


def parse_faulthandler(text: str, main_ident: str | None) -> list[dict[str, Any]]:
    threads: list[dict[str, Any]] = []
    for line in text.splitlines():
        m = _FH_THREAD.match(line)
        if m:
            ident = m.group(1)
            main = main_ident is not None and int(ident, 16) == int(main_ident, 16)
            threads.append({"name": "MainThread" if main else ident, "main": main, "frames": []})
            continue
        m = _FH_FRAME.match(line)
        if m and threads:
            threads[-1]["frames"].append({"function": m.group(3), "file": m.group(1), "line": int(m.group(2))})
    return threads


class _Gpu:
    """NVML (``nvidia-ml-py``, pure ctypes) when the host has NVIDIA GPUs; else never opened."""

    def __init__(self, nvml: Any) -> None:
        self.nvml = nvml
        self.handles = [nvml.nvmlDeviceGetHandleByIndex(i) for i in range(nvml.nvmlDeviceGetCount())]

    @classmethod
    def open(cls) -> _Gpu | None:
        try:
            if not any(n.startswith("nvidia") and n[6:].isdigit() for n in os.listdir("/dev")):
                return None
            import pynvml

            pynvml.nvmlInit()
            return cls(pynvml)
        except Exception:  # noqa: BLE001 - no driver, no library: GPU columns stay empty
            return None

    def by_pid(self) -> dict[int, tuple[Any, ...]]:
        """pid -> (gpu index, util %, process memory MiB, power W, temperature C)."""
        nv = self.nvml
        out: dict[int, tuple[Any, ...]] = {}
        for i, h in enumerate(self.handles):
            util = _try(lambda h=h: float(nv.nvmlDeviceGetUtilizationRates(h).gpu))
            power = _try(lambda h=h: nv.nvmlDeviceGetPowerUsage(h) / 1000.0)
            temp = _try(lambda h=h: float(nv.nvmlDeviceGetTemperature(h, nv.NVML_TEMPERATURE_GPU)))
            procs = _try(lambda h=h: nv.nvmlDeviceGetComputeRunningProcesses(h)) or []
            for p in procs:
                used = getattr(p, "usedGpuMemory", None)
                out[p.pid] = (i, util, round(used / 2**20, 1) if used else None, power, temp)
        return out


def _try(fn: Any) -> Any:
    try:
        return fn()
    except Exception:  # noqa: BLE001
        return None
