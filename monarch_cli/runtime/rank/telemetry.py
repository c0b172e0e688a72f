"""Inside every rank, before the user's code: what the host agent needs to observe it.

* ``prctl(PR_SET_PTRACER, agent)``: where Yama restricts ptrace, the rank's own agent (and
  py-spy, its child) may still read its stack; no root needed.
* ``faulthandler`` on :data:`STACK_SIGNAL`: the interpreter's own dump of every thread,
  appended to a file the agent reads, for when py-spy cannot attach.
* a global ``optimizer.step()`` post-hook that stores the step's end time (one float) in a
  file the agent reads, through a shared memory map: no system call per step (a ``write``
  per step cost 2.5-4 % of a 0.5 ms CPU step on a VM, far more than its own 1 µs), and a
  time is in the page cache the moment it is stored, so a rank that hangs or is killed
  right after leaves it readable.
  No change to the user's code. In a cold rank torch is not imported yet: the hook is
  installed when ``torch.optim.optimizer`` is.
"""

from __future__ import annotations

import ctypes
import mmap
import os
import signal
import struct
import sys
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from ..protocol import RankSpec

STACK_SIGNAL = signal.SIGRTMIN + 7
#: The step file, all little-endian 8-byte fields: the number of steps stored (int64); the unix
#: time minus the monotonic time when the hook was installed; the monotonic time then; then
#: the monotonic time at the end of each step. One float per step is all the hook stores.
STEP_HEADER = struct.Struct("<qdd")
STEP_TIME = struct.Struct("<d")
_STEP_COUNT = struct.Struct("<q")
_STEP_FILE_START = STEP_HEADER.size + 4096 * STEP_TIME.size  # grows by doubling
_PR_SET_PTRACER = 0x59616D61
_OPTIMIZER_MODULE = "torch.optim.optimizer"


def paths(directory: str, run_id: str, rank: int) -> dict[str, str]:
    base = os.path.join(directory, f"{run_id}.{rank}")
    return {"steps": base + ".steps", "stack": base + ".stack"}


def install(spec: RankSpec) -> None:
    """Called by the launcher in the rank process; never lets a failure reach the user's run."""
    info = spec.get("telemetry")
    if not info:
        return
    try:
        _allow_tracer(info.get("agent_pid"))
        directory = info.get("dir")
        if directory and os.path.isdir(directory):
            files = paths(directory, info["run_id"], int(spec["rank"]))
            _install_stack_dump(files["stack"])
            _install_step_hook(files["steps"])
    except Exception as e:  # noqa: BLE001 - telemetry is best effort
        print(f"monarch: telemetry not installed in this rank: {e}", file=sys.stderr)


def _allow_tracer(agent_pid: int | None) -> None:
    if not agent_pid or not os.path.exists("/proc/sys/kernel/yama"):
        return  # without Yama nothing restricts ptrace (PR_SET_PTRACER would be EINVAL): spare the rank the dlopen
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PTRACER, int(agent_pid), 0, 0, 0)  # EINVAL without Yama: nothing to allow
    except (OSError, AttributeError):
        pass


def _install_stack_dump(path: str) -> None:
    import faulthandler

    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC, 0o600)
    faulthandler.register(STACK_SIGNAL, file=fd, all_threads=True, chain=False)
    # Written after registering: a non-empty file tells the agent the signal is safe to send.
    os.write(fd, f"main 0x{threading.main_thread().ident:016x}\n".encode())


class _StepTimer:
    """The post-hook: times the steps of the first optimizer that steps (one per training step).

    As little Python as can be per step: in a 0.5 ms CPU step each extra line here showed
    up as a fraction of a per cent (benchmarks/telemetry.py, "in context").
    """

    def __init__(self, path: str) -> None:
        self.fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        self.map = self._map(_STEP_FILE_START)
        self.owner: int | None = None
        self.steps = 0
        self.end = _STEP_FILE_START
        now = time.monotonic()  # durations from the monotonic clock; the wall clock may be stepped
        STEP_HEADER.pack_into(self.map, 0, 0, time.time() - now, now)

    def _map(self, size: int) -> mmap.mmap:
        os.ftruncate(self.fd, size)
        return mmap.mmap(self.fd, size)  # MAP_SHARED: the agent's reads see every store at once

    def __call__(self, optimizer: Any, _args: Any, _kwargs: Any) -> None:
        if id(optimizer) != self.owner:
            if self.owner is not None:
                return
            self.owner = id(optimizer)
        at = STEP_HEADER.size + self.steps * 8
        try:
            if at == self.end:
                old, self.map = self.map, self._map(2 * self.end)
                self.end *= 2
                old.close()
            STEP_TIME.pack_into(self.map, at, time.monotonic())
            self.steps += 1
            _STEP_COUNT.pack_into(self.map, 0, self.steps)  # after the time: the count never covers a missing one
        except (OSError, ValueError):
            pass


_step_hook: Any = None  # the hook's handle: a kept rank's next run replaces it


def _install_step_hook(path: str) -> None:
    timer = _StepTimer(path)

    def register(module: Any) -> None:
        global _step_hook
        if _step_hook is not None:
            _step_hook.remove()
        _step_hook = module.register_optimizer_step_post_hook(timer)

    module = sys.modules.get(_OPTIMIZER_MODULE)
    if module is not None:
        register(module)
    else:
        sys.meta_path.insert(0, _AfterImport(_OPTIMIZER_MODULE, register))


class _AfterImport:
    """A meta-path finder that runs ``then(module)`` right after ``name`` is first imported."""

    def __init__(self, name: str, then: Callable[[Any], None]) -> None:
        self.name = name
        self.then = then

    def find_spec(self, fullname: str, path: Any, target: Any = None) -> Any:
        if fullname != self.name:
            return None
        sys.meta_path.remove(self)
        for finder in sys.meta_path:
            find = getattr(finder, "find_spec", None)
            spec = find(fullname, path, target) if find else None
            if spec is not None:
                break
        else:
            return None
        loader = spec.loader
        if loader is None or not hasattr(loader, "exec_module"):
            return spec
        run = loader.exec_module
        then = self.then

        def exec_module(module: Any) -> None:
            run(module)
            try:
                then(module)
            except Exception:  # noqa: BLE001
                pass

        loader.exec_module = exec_module
        return spec
