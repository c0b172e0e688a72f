"""Kept ranks (``run-spmd --keep-ranks``): a warm rank that survives its run and runs the next one.

Monarch's SPMD actor runs the script in a live process: a re-run keeps the imports, the CUDA
context and what ``torch.compile`` built in memory. A kept rank does the same, and starts every
run as a fresh interpreter would see it, except for what a library keeps in memory:

* **fresh script globals**: the script runs as a new ``__main__`` each time;
* **the workspace's modules are imported again** each run (fresh globals; an edit takes effect),
  from code objects cached by file, size and mtime, so an unchanged function is the same code
  object run after run and ``torch.compile``'s compiled graphs (keyed on code objects) are
  found instead of recompiled;
* **the default process group is destroyed** at the run's end, if the script left it;
* **seeds, framework singletons, environment, cwd, signals, stdio** are reset as for any warm
  rank (``rank.start.become_rank``, ``rank.fresh``);
* **logging and warnings filters** go back to what they were before the run: handlers and levels
  the script set are removed;
* ``atexit`` handlers the run registered run at its end, as at an interpreter's exit, and only
  those (the warm process's own, torch's, stay for the process's real end); non-daemon threads
  the run started are joined first, as at exit.

The rank is **not kept** (it exits as any rank, and the next run forks a fresh one) when its run
left what cannot be reset, and its last output line says why: a thread running the workspace's
code, a changed ``sys.path``, a process group that will not be destroyed, or an exit by signal.
Threads of installed libraries (torch's compile workers) are library state, kept as modules are.
"""

from __future__ import annotations

import atexit
import gc
import os
import sys
import threading
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from . import preload

if TYPE_CHECKING:
    from ..protocol import RankSpec


class KeptRun:
    """What a kept rank remembers of the process before a run, to put it back after."""

    def __init__(self, spec: RankSpec) -> None:
        self.workspace = preload.workspace_roots(spec)
        self.threads = set(threading.enumerate())
        self.path = list(sys.path[1:])
        self.atexit: list[tuple[Callable[..., Any], tuple[Any, ...], dict[str, Any]]] = []
        self._register, self._unregister = atexit.register, atexit.unregister
        self.logging = _logging_state()
        import warnings

        self.warnings = list(warnings.filters)
        atexit.register = self._on_register  # type: ignore[assignment]
        atexit.unregister = self._on_unregister  # type: ignore[assignment]
        _cache_code()

    def _on_register(self, func: Callable[..., Any], *args: Any, **kwargs: Any) -> Callable[..., Any]:
        self.atexit.append((func, args, kwargs))
        return func

    def _on_unregister(self, func: Callable[..., Any]) -> None:
        self.atexit = [entry for entry in self.atexit if entry[0] is not func]
        self._unregister(func)

    def finish(self) -> None:
        """The run's end, as an interpreter's exit would be for what the run made: its non-daemon
        threads joined, its ``atexit`` handlers run (last registered first), stdio flushed."""
        for thread in self._user_threads():
            if not thread.daemon:
                thread.join()
        atexit.register, atexit.unregister = self._register, self._unregister  # type: ignore[assignment]
        while self.atexit:
            func, args, kwargs = self.atexit.pop()
            try:
                func(*args, **kwargs)
            except BaseException:  # noqa: BLE001 - as the interpreter: print and go on
                import traceback

                traceback.print_exc()
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except Exception:  # noqa: BLE001 - a reader gone
                pass

    def _user_threads(self) -> list[threading.Thread]:
        """Threads the run started that run the workspace's code. Those of installed libraries
        (torch's compile pool, tqdm's monitor) are library state, kept as modules are: a fresh
        interpreter's exit would have stopped them, and the next run would start them again."""
        frames = sys._current_frames()
        return [
            t
            for t in threading.enumerate()
            if t not in self.threads
            and t.is_alive()
            and not t.name.startswith("monarch-")
            and self._runs_workspace_code(frames.get(t.ident or -1))
        ]

    def check(self) -> str | None:
        """Why the process cannot be kept for the next run, if it cannot (cheap: asked before the
        run's end is reported; :meth:`reset` does the rest after)."""
        return self._unresettable()

    def reset(self) -> str | None:
        """Put the process back for the next run (after its end was reported: the client's wait
        does not include this); why it cannot be kept after all, if it cannot."""
        why = _destroy_process_group()
        if why is not None:
            return why
        _restore_logging(self.logging)
        import warnings

        warnings.filters[:] = self.warnings  # type: ignore[index]
        warnings._filters_mutated()  # type: ignore[attr-defined]
        for name in [n for n, m in list(sys.modules.items()) if self._is_workspace(m)]:
            _keep_compiled(name, sys.modules.pop(name))
        gc.collect()
        _release_cuda_cache()
        return None

    def _unresettable(self) -> str | None:
        for thread in self._user_threads():
            return f"a thread it started ({thread.name}) is still running"
        now = sys.path[1:]
        added = [p for p in now if p not in self.path]
        if any(p not in now for p in self.path) or any(not self._library_path(p) for p in added):
            return "it changed sys.path"
        return None

    def _library_path(self, entry: str) -> bool:
        """An entry a library adds for itself (setuptools' vendored packages, inductor's cache),
        kept as the library's state: under installed code or torch.compile's caches."""
        roots = preload.installed_roots({}, os.getcwd())
        roots += [v for k in ("TORCHINDUCTOR_CACHE_DIR", "TRITON_CACHE_DIR") if (v := os.environ.get(k))]
        full = os.path.abspath(entry) if entry and not entry.endswith("__path_hook__") else entry
        return not self._in_workspace(full) and (
            entry.endswith("__path_hook__") or any(preload._under(full, r) for r in roots)
        )

    def _runs_workspace_code(self, frame: Any) -> bool:
        while frame is not None:
            if self._in_workspace(frame.f_code.co_filename):
                return True
            frame = frame.f_back
        return False

    def _in_workspace(self, path: str) -> bool:
        full = os.path.abspath(path)
        return any(preload._under(full, r) for r in self.workspace)

    def _is_workspace(self, module: Any) -> bool:
        if getattr(module, "__name__", None) == "__main__":
            return True
        file = preload.module_file(module)
        return file is not None and self._in_workspace(file)


def _destroy_process_group() -> str | None:
    dist = sys.modules.get("torch.distributed")
    try:
        if dist is not None and dist.is_available() and dist.is_initialized():
            dist.destroy_process_group()
    except Exception as e:  # noqa: BLE001 - it cannot be reset: the next run starts fresh
        return f"its process group could not be destroyed ({type(e).__name__}: {e})"
    return None


def _release_cuda_cache() -> None:
    """What the run allocated and no longer holds goes back to the device (a fresh process holds none)."""
    cuda = sys.modules.get("torch.cuda")
    try:
        if cuda is not None and cuda.is_initialized():
            cuda.empty_cache()
    except Exception:  # noqa: BLE001 - best effort
        pass


_LoggingState = tuple[Any, dict[str, tuple[int, list[Any], bool, bool]], int]


def _logging_state() -> _LoggingState | None:
    logging = sys.modules.get("logging")
    if logging is None:
        return None
    loggers = {
        name: (lg.level, list(lg.handlers), lg.propagate, lg.disabled)
        for name, lg in logging.Logger.manager.loggerDict.items()
        if isinstance(lg, logging.Logger)
    }
    root = logging.getLogger()
    loggers[""] = (root.level, list(root.handlers), root.propagate, root.disabled)
    return logging, loggers, logging.root.manager.disable


def _restore_logging(state: _LoggingState | None) -> None:
    logging = sys.modules.get("logging")
    if logging is None:
        return
    before = state[1] if state is not None else {}
    current = {n: lg for n, lg in logging.Logger.manager.loggerDict.items() if isinstance(lg, logging.Logger)}
    current[""] = logging.getLogger()
    for name, logger in current.items():
        level, handlers, propagate, disabled = before.get(name, (logging.NOTSET, [], True, False))
        if name == "" and name not in before:
            level = logging.WARNING
        logger.setLevel(level)
        logger.handlers[:] = handlers
        logger.propagate, logger.disabled = propagate, disabled
    logging.root.manager.disable = state[2] if state is not None else 0


_code: dict[tuple[str, int, int], Any] = {}
#: What ``torch.compile`` put in a workspace module's globals (or the script's), by (module name,
#: file): its compiled code looks them up there, so the module imported again next run gets them.
_compiled: dict[tuple[str, str], dict[str, Any]] = {}
_COMPILED_PREFIXES = ("__compiled_fn", "__resume_at", "__import_", "__builtins_dict__")


def _keep_compiled(name: str, module: Any) -> None:
    file = getattr(module, "__file__", None)
    names = {k: v for k, v in vars(module).items() if k.startswith(_COMPILED_PREFIXES)}
    if isinstance(file, str) and names:
        _compiled[(name, os.path.abspath(file))] = names


def carry_compiled(name: str, file: str, namespace: dict[str, Any]) -> None:
    """Give a module run again (``name``, from ``file``) what ``torch.compile`` put in its last globals."""
    namespace.update(_compiled.get((name, os.path.abspath(file)), {}))


def cached_compile(path: str, source: bytes) -> Any:
    """The script's code object, the same one while the file is unchanged (see :func:`_cache_code`)."""
    st = os.stat(path)
    key = (path, st.st_mtime_ns, st.st_size)
    code = _code.get(key)
    if code is None:
        code = _code[key] = compile(source, path, "exec", dont_inherit=True)
    return code


def _cache_code() -> None:
    """Every source module a kept rank imports gets its code object from a cache keyed by file,
    mtime and size: a workspace module imported again next run is new (fresh globals) but runs the
    same code objects while unchanged, which is what ``torch.compile``'s caches key on."""
    from importlib.machinery import SourceFileLoader

    if getattr(SourceFileLoader.get_code, "_monarch_cached", False):
        return
    original = SourceFileLoader.get_code

    def get_code(self: Any, fullname: str) -> Any:
        path = self.get_filename(fullname)
        try:
            st = os.stat(path)
        except OSError:
            return original(self, fullname)
        key = (path, st.st_mtime_ns, st.st_size)
        code = _code.get(key)
        if code is None:
            code = _code[key] = original(self, fullname)
        return code

    exec_original = SourceFileLoader.exec_module

    def exec_module(self: Any, module: Any) -> None:
        carry_compiled(module.__name__, self.get_filename(module.__name__), module.__dict__)
        exec_original(self, module)

    get_code._monarch_cached = True  # type: ignore[attr-defined]
    SourceFileLoader.get_code = get_code  # type: ignore[method-assign]
    SourceFileLoader.exec_module = exec_module  # type: ignore[method-assign]


#: The kept run in progress in this rank, if it is one (``rank.start`` asks at the run's end).
current: KeptRun | None = None
