"""Learning what ranks import, so that later runs fork from a process that has it already.

Three sides, one module:

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
* **agent**: :class:`WarmRanks` keeps the fork server runs use, warms the next one in the
  background after each run taught it something new, swaps it in when ready, starts fresh
  when a loaded file changed, and persists what it learned per host and interpreter.
"""

from __future__ import annotations

import dataclasses
import hashlib
import importlib
import importlib.util
import json
import os
import shutil
import signal
import sys
import tempfile
import threading
import time
from typing import Any, Callable, Dict, FrozenSet, Iterable, List, Optional, Tuple

REPORT_KEY = "module_report"  # a rank spec's entry: the file it writes its imports to
LEARNED_ENV = "MONARCH_LEARNED_PRELOAD"  # a zygote's: the JSON list of modules to import
READY_ENV = "MONARCH_WARM_READY"  # a zygote's: where it writes what it loaded
CACHE_ENV = "MONARCH_CACHE_DIR"
_NEVER = {"__main__", "__mp_main__", "this", "antigravity"}  # antigravity opens a browser
_OWN = "monarch_cli"  # the zygote holds what it needs of monarch_cli itself
_MAX_OFFENDER_RETRIES = 5

# ------------------------------------------------------------------------ rank side
_at_start: FrozenSet[str] = frozenset()


def mark_start() -> None:
    """Remember what the rank holds before user code runs (the zygote's modules)."""
    global _at_start
    _at_start = frozenset(sys.modules)


def _norm(path: str) -> str:
    return os.path.normpath(os.path.abspath(path))


def _under(path: str, root: str) -> bool:
    return path == root or path.startswith(root.rstrip(os.sep) + os.sep)


def workspace_roots(spec: Dict[str, Any]) -> List[str]:
    """The user's own code: the run's cwd, the script's directory, PYTHONPATH entries inside them."""
    cwd = _norm(spec["cwd"])
    roots = [cwd]
    if spec.get("mode") == "script" and spec.get("program"):
        roots.append(os.path.dirname(_norm(os.path.join(cwd, spec["program"][0]))))
    for entry in spec.get("env", {}).get("PYTHONPATH", "").split(os.pathsep):
        if entry and any(_under(_norm(os.path.join(cwd, entry)), r) for r in roots[:2]):
            roots.append(_norm(os.path.join(cwd, entry)))
    return roots


def installed_roots(env: Dict[str, str], cwd: str) -> List[str]:
    """Where installed code lives: the standard library, site-packages, PYTHONPATH entries."""
    import site
    import sysconfig

    roots = {sysconfig.get_paths().get(k) for k in ("stdlib", "platstdlib", "purelib", "platlib")}
    try:
        roots.update(site.getsitepackages())
        roots.add(site.getusersitepackages())
    except AttributeError:  # a virtualenv's old site module
        pass
    roots.update(_norm(os.path.join(cwd, e)) for e in env.get("PYTHONPATH", "").split(os.pathsep) if e)
    return [_norm(r) for r in roots if r]


def is_installed(path: str, installed: Iterable[str], workspace: Iterable[str]) -> bool:
    """Not the user's code: the most specific root that holds ``path`` is not a workspace one
    (a virtualenv inside the project is installed code; a project under ``sys.prefix`` is not)."""
    best_installed = max((len(r) for r in installed if _under(path, r)), default=-1)
    best_workspace = max((len(r) for r in workspace if _under(path, r)), default=-1)
    return best_workspace < 0 or best_installed > best_workspace


def module_file(module: Any) -> Optional[str]:
    """The file a module was loaded from, if it is a plain file and the module is what it says."""
    spec = getattr(module, "__spec__", None)
    file = getattr(module, "__file__", None)
    if spec is None or not isinstance(file, str) or spec.name != getattr(module, "__name__", None):
        return None
    return file if os.path.isfile(file) else None


def candidates(modules: Dict[str, Any], spec: Dict[str, Any], skip: Iterable[str] = ()) -> List[Tuple[str, str]]:
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


def report_imports(spec: Dict[str, Any]) -> None:
    """At a rank's exit: write the installed modules it imported for its agent to learn."""
    path = spec.get(REPORT_KEY)
    if not path:
        return
    try:
        found = candidates(sys.modules, spec, skip=_at_start)
        tmp = f"{path}.{os.getpid()}.tmp"
        with open(tmp, "w") as f:
            json.dump(found, f)
        os.replace(tmp, path)
    except Exception:  # noqa: BLE001 - learning is an optimisation; never fail a rank over it
        pass


# ---------------------------------------------------------------------- zygote side
_env_at_start: Dict[str, str] = {}
#: Variables that preloaded modules added to the environment as they were imported (e.g.
#: torch._dynamo's TORCHINDUCTOR_CACHE_DIR): a warm rank gets them as defaults, as a fresh
#: interpreter importing those modules would.
env_added: Dict[str, str] = {}


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


def _thread_count() -> int:
    try:
        return len(os.listdir("/proc/self/task"))
    except OSError:
        return threading.active_count()


def _signal_handlers() -> Dict[int, Any]:
    found = {}
    for sig in signal.valid_signals():
        try:
            found[int(sig)] = signal.getsignal(sig)
        except (OSError, ValueError):
            pass
    return found


def _cuda_initialized() -> bool:
    cuda = sys.modules.get("torch.cuda")
    try:
        return bool(cuda is not None and cuda.is_initialized())
    except Exception:  # noqa: BLE001
        return False


def _what_changed(threads: int, handlers: Dict[int, Any], env: Dict[str, str]) -> Optional[str]:
    """Why this process can no longer be forked as a fresh interpreter, if it cannot."""
    if _cuda_initialized():
        return "it initialises CUDA"
    if _thread_count() > threads:
        time.sleep(0.02)  # a short-lived helper thread may be finishing
        if _thread_count() > threads:
            return "it starts a thread"
    if _signal_handlers() != handlers:
        return "it installs a signal handler"
    if any(os.environ.get(k) != v for k, v in env.items()):
        return "it changes or removes an environment variable"  # an addition is replayed in ranks
    return None


def import_learned(path: str) -> Tuple[List[str], Dict[str, str], Optional[Tuple[str, str]]]:
    """Import the modules listed in ``path``; returns (held, left out, offender): the listed
    modules now loaded, those left out and why, and the module that tainted this process.

    On an offender (name, why) the caller must not fork: the process is no longer clean.
    """
    with open(path) as f:
        wanted: List[Tuple[str, str]] = [tuple(x) for x in json.load(f)]  # type: ignore[misc]
    left_out: Dict[str, str] = {}
    threads, handlers, env = _thread_count(), _signal_handlers(), dict(os.environ)
    # ``python -m`` put the agent's cwd first on sys.path: a workspace module there must not
    # shadow an installed one while we import (ranks replace sys.path[0] anyway).
    path0 = sys.path.pop(0) if sys.path and sys.path[0] in ("", os.getcwd()) else None
    try:
        for name, file in wanted:
            if name in sys.modules:
                continue
            try:
                found = importlib.util.find_spec(name)
            except BaseException as e:  # noqa: BLE001 - a parent that fails to import
                left_out[name] = f"cannot be found: {type(e).__name__}"
                continue
            if found is None or not found.origin or _norm(found.origin) != file:
                left_out[name] = "resolves to another file here"
                continue
            out, err = sys.stdout, sys.stderr
            try:
                importlib.import_module(name)
            except BaseException as e:  # noqa: BLE001 - SystemExit and friends included
                left_out[name] = f"fails to import: {type(e).__name__}: {e}"[:200]
            finally:
                sys.stdout, sys.stderr = out, err
            why = _what_changed(threads, handlers, env)
            if why is not None:
                return [], left_out, (name, why)
    finally:
        if path0 is not None:
            sys.path.insert(0, path0)
    return [n for n, _ in wanted if n in sys.modules and n not in left_out], left_out, None


def loaded_files() -> Dict[str, Tuple[int, int]]:
    """Every loaded module file with its (mtime_ns, size), to tell later whether it changed."""
    files: Dict[str, Tuple[int, int]] = {}
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


def write_ready(path: str, held: List[str], left_out: Dict[str, str],
                offender: Optional[Tuple[str, str]]) -> None:
    """What a zygote tells its agent once it has loaded what it was asked to."""
    report = {"pid": os.getpid(), "modules": len(sys.modules), "held": held, "left_out": left_out,
              "offender": offender, "files": loaded_files() if offender is None else {}, "at": time.time()}
    tmp = f"{path}.tmp"
    with open(tmp, "w") as f:
        json.dump(report, f)
    os.replace(tmp, path)


# ----------------------------------------------------------------------- agent side
@dataclasses.dataclass
class _Warm:
    """One warm-rank fork server as the agent sees it."""

    zygote: Any
    learned: int  # how many learned modules it was asked to import
    started: float
    ready_file: str
    ready: Optional[Dict[str, Any]] = None
    children: int = 0
    retired: bool = False


class LearnedStore:
    """The learned modules of one host and interpreter, kept across agent restarts.

    ``$MONARCH_CACHE_DIR`` (default ``$XDG_CACHE_HOME/monarch-cli`` or ``~/.cache/monarch-cli``)
    holds one JSON file per host and interpreter, private to the user.
    """

    def __init__(self, host: str) -> None:
        key = hashlib.sha256(f"{sys.executable}\0{sys.version}\0{os.environ.get('PYTHONPATH', '')}".encode())
        self.path = os.path.join(cache_dir(), "warm", f"{_safe(host)}-{key.hexdigest()[:12]}.json")
        self.learned: Dict[str, str] = {}  # name -> file, in import order
        self.excluded: Dict[str, str] = {}  # name -> why
        try:
            with open(self.path) as f:
                data = json.load(f)
            self.learned = {str(n): str(p) for n, p in data.get("learned", [])}
            self.excluded = {str(n): str(w) for n, w in data.get("excluded", {}).items()}
        except (OSError, ValueError, TypeError, AttributeError):
            pass

    def add(self, found: Iterable[Tuple[str, str]]) -> int:
        new = 0
        for name, file in found:
            if name not in self.learned and name not in self.excluded:
                self.learned[name] = file
                new += 1
        return new

    def exclude(self, name: str, why: str) -> None:
        self.excluded[name] = why
        self.learned.pop(name, None)

    def wanted(self) -> List[Tuple[str, str]]:
        return [(n, p) for n, p in self.learned.items() if n not in self.excluded]

    def save(self) -> None:
        try:
            os.makedirs(os.path.dirname(self.path), mode=0o700, exist_ok=True)
            tmp = f"{self.path}.{os.getpid()}.tmp"
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            with os.fdopen(fd, "w") as f:
                json.dump({"learned": list(self.learned.items()), "excluded": self.excluded}, f)
            os.replace(tmp, self.path)
        except OSError:
            pass

    def forget(self) -> int:
        n = len(self.learned)
        self.learned, self.excluded = {}, {}
        try:
            os.unlink(self.path)
        except OSError:
            pass
        return n


def cache_dir() -> str:
    explicit = os.environ.get(CACHE_ENV)
    if explicit:
        return explicit
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "monarch-cli")


def _safe(name: str) -> str:
    return "".join(c if c.isalnum() or c in "-_." else "_" for c in name) or "host"


class WarmRanks:
    """The agent's warm-rank fork servers: the one runs fork from, and the next one warming.

    ``start(preload, learned_file, ready_file)`` starts a zygote process; ``watch``/``unwatch``
    register its socket with the agent's poller. Runs are never held up by learning: a new
    zygote gets no fork request before it says it is ready.
    """

    def __init__(self, host: str, preload: str, start: Callable[[str, Optional[str], str], Any],
                 watch: Callable[[Any], None], unwatch: Callable[[Any], None]) -> None:
        self.preload = preload
        self._start, self._watch, self._unwatch = start, watch, unwatch
        self.store = LearnedStore(host)
        self.current: Optional[_Warm] = None
        self.next: Optional[_Warm] = None
        self.retired: List[_Warm] = []
        self._dir: Optional[str] = None
        self._serial = 0
        self._again = bool(self.store.wanted())  # warm the learned set once the first zygote is ready
        self._retries = 0

    # ------------------------------------------------------------------ files
    @property
    def dir(self) -> str:
        if self._dir is None:
            self._dir = tempfile.mkdtemp(prefix="monarch-warm-")
        return self._dir

    def report_path(self, run_id: str, rank: int) -> str:
        return os.path.join(self.dir, f"run-{_safe(run_id)}-{rank}.json")

    def close(self) -> None:
        for w in self._all():
            w.zygote.kill()
        if self._dir is not None:
            shutil.rmtree(self._dir, ignore_errors=True)

    def _all(self) -> List[_Warm]:
        return [w for w in (self.current, self.next, *self.retired) if w is not None]

    # ------------------------------------------------------------------- zygotes
    def _spawn(self, learned: List[Tuple[str, str]]) -> _Warm:
        self._serial += 1
        learned_file = None
        if learned:
            learned_file = os.path.join(self.dir, f"learned-{self._serial}.json")
            with open(learned_file, "w") as f:
                json.dump(learned, f)
        ready_file = os.path.join(self.dir, f"ready-{self._serial}.json")
        zygote = self._start(self.preload, learned_file, ready_file)
        self._watch(zygote)
        return _Warm(zygote, len(learned), time.time(), ready_file)

    def for_run(self) -> Tuple[Any, List[str]]:
        """The zygote this run's warm ranks fork from, and notices for the user (a changed file)."""
        notices: List[str] = []
        cur = self.current
        if cur is not None and cur.zygote.process.poll() is not None:
            self._drop(cur)
            cur = None
        if cur is not None and cur.ready is not None:
            changed = _changed_file(cur.ready.get("files", {}))
            if changed is not None:
                notices.append(f"{changed} changed since the warm process loaded it; starting from a fresh one")
                self._retire(cur)
                if self.next is not None:  # it may have loaded the old file too
                    self._drop(self.next, kill=True)
                cur = None
        if cur is None:
            cur = self.current = self._spawn([])  # the explicit preload only: it may take forks at once
            self._again = bool(self.store.wanted())  # the learned set follows once it is ready
        return cur.zygote, notices

    def warm_up(self) -> None:
        if self.current is None:
            self.current = self._spawn([])

    def learn(self, run_id: str) -> None:
        """A run ended here: merge what its ranks imported; warm a new zygote if that is new."""
        if self._dir is None:
            return
        prefix = f"run-{_safe(run_id)}-"
        found: List[Tuple[str, str]] = []
        for name in os.listdir(self._dir):
            if name.startswith(prefix) and name.endswith(".json"):
                path = os.path.join(self._dir, name)
                try:
                    with open(path) as f:
                        found.extend((str(n), str(p)) for n, p in json.load(f))
                except (OSError, ValueError, TypeError):
                    pass
                try:
                    os.unlink(path)
                except OSError:
                    pass
        if self.store.add(found):
            self.store.save()
            self._retries = 0
        self._maybe_warm()

    def _maybe_warm(self) -> None:
        """Start the next zygote if the store has modules the current one lacks (one at a time:
        a zygote importing competes with the runs for the host's CPUs)."""
        cur = self.current
        if self.next is not None or (cur is not None and cur.ready is None):
            self._again = True
            return
        wanted = self.store.wanted()
        if not wanted:
            return
        if cur is not None:
            ready = cur.ready or {}
            have = set(ready.get("held", ())) | set(ready.get("left_out", {}))
            if all(n in have for n, _ in wanted):
                return
        self.next = self._spawn(wanted)

    def on_message(self, zygote: Any, msg: Tuple[Any, ...]) -> bool:
        """A message from one of our zygotes; True if it was ours to handle (not a fork/exit)."""
        warm = next((w for w in self._all() if w.zygote is zygote), None)
        if warm is None:
            return False
        kind = msg[0]
        if kind == "forked":
            warm.children += 1
        elif kind == "exit":
            warm.children -= 1
            if warm.retired and warm.children <= 0:
                self._drop(warm, kill=True)
        elif kind == "ready":
            self._ready(warm)
            return True
        return False

    def _ready(self, warm: _Warm) -> None:
        try:
            with open(warm.ready_file) as f:
                warm.ready = json.load(f)
        except (OSError, ValueError):
            warm.ready = {"modules": 0, "held": [], "left_out": {}, "files": {}, "at": time.time()}
        for name, why in warm.ready.get("left_out", {}).items():
            self.store.exclude(name, why)
        offender = warm.ready.get("offender")
        if offender:
            self.store.exclude(offender[0], offender[1])
        if warm.ready.get("left_out") or offender:
            self.store.save()
        if offender:  # it exits by itself; it never forked
            self._drop(warm, kill=True)
            self._retries += 1
            if self._retries <= _MAX_OFFENDER_RETRIES:
                self._maybe_warm()
            return
        if warm is self.next:
            if self.current is not None:
                self._retire(self.current)
            self.current, self.next = warm, None
        if self._again:
            self._again = False
            self._maybe_warm()

    def gone(self, zygote: Any) -> bool:
        """A zygote's socket closed; True if it was one of ours."""
        warm = next((w for w in self._all() if w.zygote is zygote), None)
        if warm is None:
            return False
        self._drop(warm)
        return True

    def _retire(self, warm: _Warm) -> None:
        """No more runs fork from it; it goes when its last rank has exited."""
        if warm is self.current:
            self.current = None
        warm.retired = True
        if warm.children <= 0:
            self._drop(warm, kill=True)
        elif warm not in self.retired:
            self.retired.append(warm)

    def _drop(self, warm: _Warm, kill: bool = False) -> None:
        if kill:
            warm.zygote.kill()
        try:
            self._unwatch(warm.zygote)
        except (KeyError, ValueError):
            pass
        if warm is self.current:
            self.current = None
        if warm is self.next:
            self.next = None
        if warm in self.retired:
            self.retired.remove(warm)
        for path in (warm.ready_file,):
            try:
                os.unlink(path)
            except OSError:
                pass

    def forget(self) -> int:
        """Forget what was learned; runs fork from a zygote with the explicit preload only."""
        n = self.store.forget()
        if self.next is not None:
            self._drop(self.next, kill=True)
        if self.current is not None and self.current.learned:
            self._retire(self.current)
            self.current = self._spawn([])
        self._again = False
        return n

    def info(self) -> Dict[str, Any]:
        """What ``monarch status`` shows of this host's warm process."""
        cur = self.current
        ready = cur.ready if cur is not None else None
        return {
            "pid": cur.zygote.process.pid if cur is not None else None,
            "ready": ready is not None,
            "modules": ready.get("modules") if ready else None,
            "learned_held": len(ready.get("held", ())) if ready else 0,
            "since": ready.get("at") if ready else None,
            "rss_bytes": _rss(cur.zygote.process.pid) if cur is not None else None,
            "learned": len(self.store.learned),
            "excluded": dict(self.store.excluded),
            "warming": self.next is not None,
            "store": self.store.path,
        }


def _changed_file(files: Dict[str, Any]) -> Optional[str]:
    for path, (mtime, size) in files.items():
        try:
            st = os.stat(path)
        except OSError:
            return path
        if st.st_mtime_ns != mtime or st.st_size != size:
            return path
    return None


def _rss(pid: int) -> Optional[int]:
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None
