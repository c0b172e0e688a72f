"""A fork trial: evidence, not a rule, that a warm process whose imports started threads can still
be forked into ranks.

Threads do not survive ``fork()``: a library whose threads hold a lock, or whose work waits on
them, can hang or fail in the child. Many handle it (OpenBLAS, pyarrow and scikit-learn's
OpenMP pools re-create their threads in the child; a process that had imported pyarrow,
scikit-learn and transformers with 32 threads forked children that ran pyarrow compute and a
scikit-learn fit without trouble). So a learned module that starts threads is no longer left
out for that alone (with everything that imports it, transformers included): the warm process
forks a child that exercises what is loaded, with a deadline, and holds the module if the child
finishes cleanly. The child runs no user code and is thrown away; it is the warm process's own
test, done once per warm-up, only for imports that started threads.

What the child does: the interpreter's own machinery (an import, a thread, a collection, a
write to stdio), then one small piece of real work in each thread-pool library that is loaded
(torch and numpy matrix products on several threads, pyarrow compute, a scikit-learn fit). A
library that refuses forks outright (an ``os.register_at_fork`` hook that aborts, a deadlock in
its atfork handler) fails the trial at once.
"""

from __future__ import annotations

import gc
import os
import select
import signal
import sys
import threading
import time
from collections.abc import Callable

#: How long the child may take (a scikit-learn fit imports more of it: seconds on a busy host).
TRIAL_DEADLINE_S = 60.0


def _torch() -> None:
    torch = sys.modules["torch"]
    if torch.cuda._is_in_bad_fork():  # (torch's own mark: CUDA was initialised before the fork)
        raise RuntimeError("CUDA was initialised in the warm process; a forked rank cannot use it")
    torch.set_num_threads(min(4, os.cpu_count() or 1))
    a = torch.ones(256, 256)
    float((a @ a).sum())


def _numpy() -> None:
    np = sys.modules["numpy"]
    a = np.ones((256, 256))
    float((a @ a).sum())


def _pyarrow() -> None:
    import pyarrow as pa
    import pyarrow.compute as pc

    pc.sum(pa.array(range(100_000))).as_py()
    pa.Table.from_pydict({"x": list(range(1000))}).sort_by("x")


def _sklearn() -> None:
    np = sys.modules["numpy"]
    from sklearn.linear_model import LogisticRegression

    x = np.arange(200, dtype=float).reshape(100, 2)
    LogisticRegression().fit(x, (x[:, 0] > 100).astype(int))


#: One small piece of work in each thread-pool library, run when its package is loaded.
PROBES: dict[str, Callable[[], None]] = {
    "torch": _torch,
    "numpy": _numpy,
    "pyarrow": _pyarrow,
    "sklearn": _sklearn,
}


def _exercise() -> None:
    """In the child: what any rank does first, then each loaded library's probe."""
    import importlib

    importlib.import_module("json.decoder")
    worker = threading.Thread(target=lambda: None)
    worker.start()
    worker.join()
    gc.collect()
    sys.stdout.write("")
    sys.stdout.flush()
    for package, probe in PROBES.items():
        if package in sys.modules:
            probe()


def _child(write_fd: int) -> None:
    code = 0
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, 1)
        os.dup2(devnull, 2)
        _exercise()
        os.write(write_fd, b"ok")
    except BaseException as e:  # noqa: BLE001 - whatever it is, the trial failed and says why
        os.write(write_fd, f"failed: {type(e).__name__}: {e}"[:300].encode(errors="replace"))
        code = 1
    os._exit(code)


def run_trial(deadline: float = TRIAL_DEADLINE_S) -> str | None:
    """Fork a child that exercises what this process holds; None if it finished cleanly within
    ``deadline``, else what went wrong ("hung for 60 s", "died of SIGSEGV", "failed: ...")."""
    read_fd, write_fd = os.pipe()
    sys.stdout.flush()
    sys.stderr.flush()
    gc.freeze()  # as before every fork from a warm process: the child's collection copies no page (1.1 -> 0.3 s)
    pid = os.fork()
    if pid == 0:
        os.close(read_fd)
        _child(write_fd)
    os.close(write_fd)
    try:
        said = _read_until(read_fd, time.monotonic() + deadline)
    finally:
        os.close(read_fd)
    if said is None:
        os.kill(pid, signal.SIGKILL)
    _, status = os.waitpid(pid, 0)
    if said is None:
        return f"hung for {deadline:.0f} s"
    if said == b"ok" and os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0:
        return None
    if said and said != b"ok":
        return said.decode(errors="replace")
    if os.WIFSIGNALED(status):
        return f"died of {signal.Signals(os.WTERMSIG(status)).name}"
    return f"exited with status {os.waitstatus_to_exitcode(status)}"


def _read_until(fd: int, deadline: float) -> bytes | None:
    """Everything the child writes until it closes the pipe; None at the deadline."""
    data = b""
    while True:
        left = deadline - time.monotonic()
        if left <= 0:
            return None
        try:
            ready, _, _ = select.select([fd], [], [], left)
        except InterruptedError:
            continue
        if not ready:
            return None
        chunk = os.read(fd, 4096)
        if not chunk:
            return data
        data += chunk
