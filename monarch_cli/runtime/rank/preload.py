"""Learning what ranks import, so that later runs fork from a process that has it already.

The rank and zygote sides (the agent's is in :mod:`..agent.warm`):

* **rank**: at exit, :func:`report_imports` writes the installed modules (standard library,
  site-packages, libraries outside the workspace) the rank imported that its zygote did not
  hold. Modules of the user's workspace (the run's cwd, the script's directory, the
  ``PYTHONPATH`` entries inside them) are never reported, so edits keep taking effect.
* **zygote**: :func:`import_learned` imports the learned modules one by one and checks after
  each that no thread was started, no signal handler or environment variable changed and
  CUDA was not initialised (forking such a process is unsafe or would differ from a fresh
  interpreter); a module that does is reported as an offender and the zygote exits. A
  module that fails to import, or resolves to another file here, is left out quietly.
  :func:`write_ready` records every loaded module file's mtime and size.
* **agent**: :class:`..agent.warm.WarmRanks` (its own module) decides which zygote runs fork from.
"""

from __future__ import annotations

import importlib
import importlib.util
import itertools
import json
import os
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any, Final

from ... import config
from .import_watch import ImportWatch

if TYPE_CHECKING:
    from ..protocol import RankSpec

REPORT_KEY: Final = "module_report"  # a rank spec's entry: the file it writes its imports to
LEARNED_ENV = config.LEARNED_PRELOAD_ENV  # a zygote's: the JSON list of modules to import
READY_ENV = config.WARM_READY_ENV  # a zygote's: where it writes what it loaded
_NEVER = {"__main__", "__mp_main__", "this", "antigravity"}  # antigravity opens a browser
_OWN = "monarch_cli"  # the zygote holds what it needs of monarch_cli itself

# ------------------------------------------------------------------------ rank side
_at_start: frozenset[str] = frozenset()
_count_at_start = 0
#: Where installed code lives, as the warm process saw it (the part no rank's environment changes).
_installed_base: list[str] | None = None
#: How many preloaded modules a script may delete and import again and still have every
#: module it imported reported (beyond that, learning misses some: slower, never wrong).
_REIMPORT_SLACK = 256


def mark_start() -> None:
    """In the warm process, once before its first fork: remember what it holds, so that each
    rank finds its own imports without going through every module (a forked rank that touches
    an object copies the page it lives on: ~4,000 module names cost a rank ~10 ms)."""
    global _at_start, _count_at_start, _installed_base
    _at_start = frozenset(sys.modules)
    _count_at_start = len(sys.modules)
    _installed_base = _base_roots()


def _new_modules() -> dict[str, Any]:
    """The modules imported since :func:`mark_start`: new entries go to the end of
    ``sys.modules`` (a dict keeps insertion order), so only its tail is read."""
    modules = sys.modules
    tail = max(len(modules) - _count_at_start, 0) + _REIMPORT_SLACK
    names = list(itertools.islice(reversed(modules), tail))  # (one C call: no thread imports meanwhile)
    found: dict[str, Any] = {}
    for name in reversed(names):  # in import order, as the warm process will import them
        module = modules.get(name) if name not in _at_start else None
        if module is not None:
            found[name] = module
    return found


def _norm(path: str) -> str:
    return os.path.normpath(os.path.abspath(path))


def _under(path: str, root: str) -> bool:
    return path == root or path.startswith(root.rstrip(os.sep) + os.sep)


def workspace_roots(spec: RankSpec) -> list[str]:
    """The user's own code: the run's cwd, the script's directory, PYTHONPATH entries inside them."""
    cwd = _norm(spec["cwd"])
    roots = [cwd]
    if spec.get("mode") == "script" and spec.get("program"):
        roots.append(os.path.dirname(_norm(os.path.join(cwd, spec["program"][0]))))
    for entry in spec.get("env", {}).get("PYTHONPATH", "").split(os.pathsep):
        if entry and any(_under(_norm(os.path.join(cwd, entry)), r) for r in roots[:2]):
            roots.append(_norm(os.path.join(cwd, entry)))
    return roots


def _base_roots() -> list[str]:
    import site
    import sysconfig

    roots = {sysconfig.get_paths().get(k) for k in ("stdlib", "platstdlib", "purelib", "platlib")}
    try:
        roots.update(site.getsitepackages())
        roots.add(site.getusersitepackages())
    except AttributeError:  # a virtualenv's old site module
        pass
    return [r for r in roots if r]


def installed_roots(env: dict[str, str], cwd: str) -> list[str]:
    """Where installed code lives: the standard library, site-packages, PYTHONPATH entries."""
    roots = set(_installed_base if _installed_base is not None else _base_roots())
    roots.update(_norm(os.path.join(cwd, e)) for e in env.get("PYTHONPATH", "").split(os.pathsep) if e)
    return [_norm(r) for r in roots]


def is_installed(path: str, installed: Iterable[str], workspace: Iterable[str]) -> bool:
    """Not the user's code: the most specific root that holds ``path`` is not a workspace one
    (a virtualenv inside the project is installed code; a project under ``sys.prefix`` is not)."""
    best_installed = max((len(r) for r in installed if _under(path, r)), default=-1)
    best_workspace = max((len(r) for r in workspace if _under(path, r)), default=-1)
    return best_workspace < 0 or best_installed > best_workspace


def module_file(module: Any) -> str | None:
    """The file a module was loaded from, if it is a plain file and the module is what it says."""
    spec = getattr(module, "__spec__", None)
    file = getattr(module, "__file__", None)
    if spec is None or not isinstance(file, str) or spec.name != getattr(module, "__name__", None):
        return None
    return file if os.path.isfile(file) else None


def candidates(modules: dict[str, Any], spec: RankSpec, skip: Iterable[str] = ()) -> list[tuple[str, str]]:
    """The (name, file) pairs among ``modules`` that a warm process may import for this run."""
    skip = set(skip)
    workspace = workspace_roots(spec)
    installed = installed_roots(spec.get("env", {}), spec["cwd"])
    found = []
    for name, module in list(modules.items()):
        if name in skip or name in _NEVER or name.endswith(".__main__") or name.split(".")[0] == _OWN:
            continue
        file = module_file(module)
        if file is not None and is_installed(_norm(file), installed, workspace):
            found.append((name, _norm(file)))
    return found


def report_imports(spec: RankSpec) -> None:
    """At a rank's exit: write the installed modules it imported for its agent to learn."""
    path = spec.get(REPORT_KEY)
    if not path:
        return
    try:
        found = candidates(_new_modules(), spec)
        tmp = f"{path}.{os.getpid()}.tmp"
        with open(tmp, "w") as f:
            json.dump(found, f)
        os.replace(tmp, path)
    except Exception:  # noqa: BLE001 - learning is an optimisation; never fail a rank over it
        pass


# ---------------------------------------------------------------------- zygote side
_env_at_start: dict[str, str] = {}
#: Variables that preloaded modules added to the environment as they were imported (e.g.
#: torch._dynamo's TORCHINDUCTOR_CACHE_DIR): a warm rank gets them as defaults, as a fresh
#: interpreter importing those modules would.
env_added: dict[str, str] = {}


def note_environment() -> None:
    """In a zygote, before anything is preloaded."""
    global _env_at_start
    _env_at_start = dict(os.environ)


def finish_environment() -> None:
    """In a zygote, once everything is preloaded: what the imports added."""
    global env_added
    env_added = {k: v for k, v in os.environ.items() if k not in _env_at_start}


def apply_environment() -> None:
    """In a warm rank, after its environment was set: the preloaded modules' defaults."""
    for key, value in env_added.items():
        os.environ.setdefault(key, value)


#: Variables the warm process's imports read, with the value they saw and the module that read
#: it: a rank whose environment says otherwise would not get what a fresh interpreter gets.
env_reads: dict[str, tuple[str | None, str]] = {}
_OS_FILES = {os.__file__, getattr(sys.modules.get("_collections_abc"), "__file__", ""), "<frozen os>", __file__}


def _reader() -> str:
    frame = sys._getframe(2)
    while frame is not None and (
        frame.f_code.co_filename in _OS_FILES or frame.f_code.co_filename.startswith("<frozen")
    ):
        frame = frame.f_back  # type: ignore[assignment]
    return str(frame.f_globals.get("__name__", "?")) if frame is not None else "?"


def watch_env_reads() -> Callable[[], None]:
    """In a zygote, while it imports: note every ``os.environ`` read (``os.getenv`` included);
    returns the function that stops it (before the first fork)."""
    cls = type(os.environ)
    original = cls.__getitem__
    seen: dict[str, tuple[str | None, list[str]]] = {}  # key -> (value, the modules that read it)

    def note(key: str, value: str | None) -> None:
        readers = seen.setdefault(key, (value, []))[1]
        reader = _reader()
        if reader not in readers:
            readers.append(reader)

    def getitem(self: Any, key: str) -> str:
        if self is not os.environ or sys._getframe(1).f_code.co_name in ("__iter__", "copy"):
            return original(self, key)  # items(), values(), copy(): not a read of one variable
        try:
            value = original(self, key)
        except KeyError:
            note(key, None)
            raise
        note(key, value)
        return value

    cls.__getitem__ = getitem  # type: ignore[method-assign]

    def stop() -> None:
        cls.__getitem__ = original  # type: ignore[method-assign]
        # A module that read (nearly) every variable was copying the environment, not asking
        # for one of them (fsspec.config collects FSSPEC_*): its reads say nothing.
        present: dict[str, int] = {}
        for value, readers in seen.values():
            for reader in readers if value is not None else ():
                present[reader] = present.get(reader, 0) + 1
        copiers = {r for r, n in present.items() if n > 8 and n >= 0.9 * len(os.environ)}
        for key, (value, readers) in seen.items():
            meant = [r for r in readers if r not in copiers]
            if meant:
                env_reads[key] = (value, meant[0])

    return stop


#: Set for each rank by the launcher (those read at import are reset for the rank, see
#: rank/fresh.py), or by the shell; a difference in them never makes a rank start cold.
_PER_RANK = {
    "RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "GROUP_WORLD_SIZE", "ROLE_RANK",
    "ROLE_WORLD_SIZE", "ROLE_NAME", "MASTER_ADDR", "MASTER_PORT", "NODE_RANK", "OMP_NUM_THREADS",
    "PYTHONUNBUFFERED", "PWD", "OLDPWD", "SHLVL", "_", "COLUMNS", "LINES",
    # read at import, and their readers set again in each rank (rank/fresh.py)
    "TRANSFORMERS_VERBOSITY", "SLURM_PROCID", "JSM_NAMESPACE_RANK", "CUDA_VISIBLE_DEVICES",
}  # fmt: skip


def env_conflict(env: dict[str, str]) -> str | None:
    """Why a rank with environment ``env`` must not run in this warm process: a variable that one
    of its imports read at import time has another value for the rank (the first one found)."""
    for key, (seen, reader) in env_reads.items():
        if key in _PER_RANK or key.startswith((config.PREFIX, "TORCHELASTIC_")):
            continue
        value = env.get(key, env_added.get(key))  # the rank gets the imports' additions as defaults
        if value == seen or (seen is None and key in env_added and value == env_added[key]):
            continue  # (the second: the module read it unset and set its default, as it will in a fresh one)
        now = "unset" if value is None else repr(value)
        then = "unset" if seen is None else repr(seen)
        return f"{key} is {now} for this run, but {reader} read it as {then} when the warm process imported it"
    return None


def _thread_ids() -> set[int]:
    """This process's threads (native ones too), by kernel thread id."""
    try:
        return {int(t) for t in os.listdir("/proc/self/task")}
    except OSError:
        return {t.native_id or 0 for t in threading.enumerate()}


def _signal_handlers() -> dict[int, Any]:
    """Every signal's handler, through ``_signal`` (``signal.getsignal`` makes an enum of each
    number: 1.1 s of a 3.3 s warm-up of DDP's 828 modules, checked after each one)."""
    import _signal

    found = {}
    for sig in _SIGNALS:
        try:
            found[sig] = _signal.getsignal(sig)
        except (OSError, ValueError):
            pass
    return found


_SIGNALS = [int(s) for s in signal.valid_signals()]


def _environment() -> dict[bytes, bytes]:
    """The process environment as ``os.environ`` keeps it (its raw dict: compared in C)."""
    return dict(os.environ._data)  # type: ignore[attr-defined]


def _env_changed(before: dict[bytes, bytes]) -> bool:
    """A variable changed or removed since ``before`` (an addition is replayed in ranks)."""
    return not before.items() <= os.environ._data.items()  # type: ignore[attr-defined]


def _cuda_driver_loaded() -> bool:
    """Whether the CUDA driver library is in this process (a ``dlopen`` that loads nothing):
    a module that loads it (Triton's driver, a CUDA Python binding) may have initialised it behind
    torch's back, and a rank forked after that cannot use CUDA ("Cannot re-initialize CUDA in
    forked subprocess", seen on an H100 after torch.compile's modules were learned)."""
    import ctypes

    try:
        ctypes.CDLL("libcuda.so.1", mode=os.RTLD_NOLOAD | os.RTLD_LAZY)
        return True
    except OSError:
        return False


def _cuda_initialized() -> bool:
    cuda = sys.modules.get("torch.cuda")
    try:
        return bool(cuda is not None and cuda.is_initialized())
    except Exception:  # noqa: BLE001
        return False


def _what_changed(threads: set[int], handlers: dict[int, Any], env: dict[bytes, bytes]) -> str | None:
    """Why this process can no longer be forked as a fresh interpreter, if it cannot (threads: it
    had ``threads``, and has others that outlive a short wait)."""
    if _cuda_initialized():
        return "it initialises CUDA"
    if _thread_ids() - threads:
        time.sleep(0.02)  # a short-lived helper thread may be finishing
        if _thread_ids() - threads:
            return _THREAD
    if _signal_handlers() != handlers:
        return "it installs a signal handler"
    if _env_changed(env):
        return "it changes or removes an environment variable"
    return None


_THREAD = "it starts a thread"
#: Shared libraries whose threads are safe across fork(): OpenBLAS (bundled by numpy and scipy)
#: starts its thread pool when loaded, stops it in a ``pthread_atfork`` handler and starts it
#: again on demand in the child. ``import torch`` loads numpy's: every default warm process,
#: which preloads torch, already holds such a pool. (No trial is needed for them.)
FORK_SAFE_LIBRARIES = ("openblas",)


def _mapped_libraries() -> set[str]:
    try:
        with open("/proc/self/maps") as f:
            return {line.split(None, 5)[5].strip() for line in f if line.count(" ") >= 5 and ".so" in line}
    except (OSError, IndexError):
        return set()


def _fork_safe_threads(libraries_before: set[str]) -> bool:
    """Whether the threads just started belong to a library known to handle fork()."""
    new = _mapped_libraries() - libraries_before
    return any(lib in os.path.basename(path).lower() for path in new for lib in FORK_SAFE_LIBRARIES)


def _blame(wanted: str, culprit: tuple[str, str], left_out: dict[str, str]) -> tuple[str, str]:
    """The learned module to leave out, and why: itself, or the module it imports that did it
    (which is left out too, so that its own entry says what it does)."""
    name, why = culprit
    if name == wanted:
        return wanted, why
    left_out.setdefault(name, why)
    return wanted, f"it imports {name}, which {why.removeprefix('it ')}"


class _Watcher:
    """What :func:`import_learned` checks after each module: a change that makes this process
    unsafe to fork is the culprit at once; new threads are only noted (the modules that started
    them), for a fork trial once the whole import is done (:mod:`.fork_trial`)."""

    def __init__(self) -> None:
        self.threads, self.handlers, self.env = _thread_ids(), _signal_handlers(), _environment()
        self.libraries = _mapped_libraries()
        self.cuda_driver = _cuda_driver_loaded()  # (already there: torch's own, before anything was learned)
        self.started_threads: list[str] = []  # modules of the current import that started threads

    def check(self, loaded: str) -> str | None:
        if not self.cuda_driver and _cuda_driver_loaded():
            return "it loads the CUDA driver (a rank forked after it could not use CUDA)"
        why = _what_changed(self.threads, self.handlers, self.env)
        if why != _THREAD:
            return why
        if not _fork_safe_threads(self.libraries):
            self.started_threads.append(loaded)
        self.threads, self.libraries = _thread_ids(), _mapped_libraries()  # the new baseline
        return None

    def trial(self, wanted: str) -> tuple[str, str] | None:
        """After ``wanted``'s import: fork a child that exercises what is loaded (the culprit if it fails)."""
        starters, self.started_threads = self.started_threads, []
        if not starters:
            return None
        from .fork_trial import run_trial

        failed = run_trial()
        if failed is None:
            return None
        return starters[0], f"it starts a thread, and a process forked after it {failed}"


def _resolve(name: str, file: str | None, installed: Callable[[str], bool]) -> str | None:
    """Why ``name`` is not to be imported here, if it is not: it must be the file a rank
    imported (a learned entry) or, for a hint (no file: read from the script's source or an
    earlier reservation), installed code here (never the user's, which must stay fresh)."""
    module, _, _attr = name.partition(":")
    found = importlib.util.find_spec(module)
    if found is None or not found.origin:
        return "not found here" if file is None else "resolves to another file here"
    if file is not None:
        return None if _norm(found.origin) == file else "resolves to another file here"
    return None if found.origin in ("built-in", "frozen") or installed(_norm(found.origin)) else "is workspace code"


def _import_one(name: str) -> None:
    """Import ``name``; ``module:attr`` (a hint from ``from module import attr``) also gets the
    attribute, which loads a lazy package's submodule (``transformers:Trainer``)."""
    module, _, attr = name.partition(":")
    loaded = importlib.import_module(module)
    if attr and getattr(loaded, attr, None) is None and hasattr(loaded, "__path__"):
        importlib.import_module(f"{module}.{attr}")  # what ``from module import attr`` does next


Imported = tuple[list[str], dict[str, str], list[str], tuple[str, str] | None]


def import_learned(path: str) -> Imported:
    """Import the modules listed in ``path``; returns (held, left out, absent, offender): the
    listed modules now loaded, those left out and why, the hints that are no module here, and
    the module that tainted this process.

    Each entry is ``[name, file]`` (learned from a rank: that file only) or ``[name, null]`` (a
    hint: whatever installed module the name resolves to here; missing ones are skipped).
    On an offender (name, why) the caller must not fork: the process is no longer clean.
    """
    with open(path) as f:
        wanted: list[tuple[str, str | None]] = [(str(n), p) for n, p in json.load(f)]
    left_out: dict[str, str] = {}
    skipped: set[str] = set()
    watcher = _Watcher()
    roots = installed_roots(dict(os.environ), os.getcwd())

    def installed(file: str) -> bool:
        return any(_under(file, root) for root in roots)

    # ``python -m`` put the agent's cwd first on sys.path: a workspace module there must not
    # shadow an installed one while we import (ranks replace sys.path[0] anyway).
    path0 = sys.path.pop(0) if sys.path and sys.path[0] in ("", os.getcwd()) else None
    try:
        for name, file in wanted:
            if name in sys.modules:
                continue
            out, err = sys.stdout, sys.stderr
            with ImportWatch(watcher.check) as watch:  # find_spec imports the parent packages
                try:
                    why_not = _resolve(name, file, installed)
                    if why_not is None:
                        _import_one(name)
                    elif file is None:
                        skipped.add(name)  # a hint that is no module here: nothing to say
                    else:
                        left_out[name] = why_not
                except BaseException as e:  # noqa: BLE001 - SystemExit and friends included
                    if file is None:
                        skipped.add(name)  # a hint read from source: the script may guard it too
                    else:
                        left_out[name] = f"fails to import: {type(e).__name__}: {e}"[:200]
                finally:
                    sys.stdout, sys.stderr = out, err
            culprit = watch.culprit or (None if (why := watcher.check(name)) is None else (name, why))
            culprit = culprit or watcher.trial(name)
            if culprit is not None:
                return [], left_out, sorted(skipped), _blame(name, culprit, left_out)
    finally:
        if path0 is not None:
            sys.path.insert(0, path0)
    held = [n for n, _ in wanted if n.partition(":")[0] in sys.modules and n not in left_out and n not in skipped]
    return held, left_out, sorted(skipped), None


def loaded_files() -> dict[str, tuple[int, int]]:
    """Every loaded module file with its (mtime_ns, size), to tell later whether it changed."""
    files: dict[str, tuple[int, int]] = {}
    for module in list(sys.modules.values()):
        file = module_file(module)
        if file is None or file in files:
            continue
        try:
            st = os.stat(file)
        except OSError:
            continue
        files[file] = (st.st_mtime_ns, st.st_size)
    return files


def write_ready(path: str, imported: Imported) -> None:
    """What a zygote tells its agent once it has loaded what it was asked to."""
    held, left_out, absent, offender = imported
    report = {
        "pid": os.getpid(),
        "modules": len(sys.modules),
        "held": held,
        "left_out": left_out,
        "absent": absent,
        "offender": offender,
        "files": loaded_files() if offender is None else {},
        "env_reads": env_reads,
        "at": time.time(),
    }
    tmp = f"{path}.tmp"
    with open(tmp, "w") as f:
        json.dump(report, f)
    os.replace(tmp, path)
