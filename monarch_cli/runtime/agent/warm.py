"""The agent's side of learned warm processes (see :mod:`..rank.preload` for the rank and zygote sides).

:class:`WarmRanks` keeps the fork server that runs fork from, warms the next one in the
background after a run taught it something new, swaps it in when it is ready, starts fresh
when a file it loaded changed, and keeps what this reservation's runs taught it and what the
client hinted (:class:`LearnedStore`).
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import time
from collections.abc import Callable, Iterable
from typing import Any

from ...config import EnvSettings, env
from ...sysutil import private_tmpdir
from .filewatch import FileWatch

_MAX_OFFENDER_RETRIES = 5
#: A warm-up of learned modules waits while a run younger than this is running here: it takes
#: seconds of CPU (transformers, Lightning...), and a first run of a script on a small host
#: was 3-4 s slower beside it (2 local hosts x 1 rank, Lightning: 9.4-10.4 s against 5.1-6.5 s
#: without it). A longer run (real training) is not held back by it for long.
POSTPONE_WHILE_RUN_YOUNGER_S = 30.0


@dataclasses.dataclass
class _Warm:
    """One warm-rank fork server as the agent sees it."""

    zygote: Any
    learned: int  # how many learned modules it was asked to import
    started: float
    ready_file: str
    ready: dict[str, Any] | None = None
    children: int = 0  # ranks asked of it and not yet exited
    retired: bool = False
    files: FileWatch | None = None  # the files it loaded, watched from when it is ready
    in_place: bool = False  # importing more itself (LearnMore), not ready meanwhile


class LearnedStore:
    """What this reservation's warm processes are to hold, in import order: hints (module names
    the client sent: read from the served script's source, or learned by earlier reservations of
    its workspace) and what this reservation's runs were seen to import.

    It lives as long as the agent, in memory: the set is scoped to this reservation's commands.
    (It was once kept per host name on disk, and grew into the union of every script ever run
    on a host called ``local0``: 2,062 modules, ~8 s to warm before a bare all-reduce.) What is
    worth keeping goes back to the client (:meth:`names`), which ships it with the next serve.
    """

    def __init__(self) -> None:
        self.learned: dict[str, str | None] = {}  # name -> file (None: a hint, any installed file here)
        self.excluded: dict[str, str] = {}  # name -> why
        self.absent: set[str] = set()  # hints that are no module here

    def add(self, found: Iterable[tuple[str, str | None]]) -> int:
        new = 0
        for name, file in found:
            known = self.learned.get(name, "")
            if name in self.excluded or name in self.absent or (known != "" and (known is not None or file is None)):
                continue
            self.learned[name] = file  # (a learned file replaces a hint of the same name)
            new += known == ""
        return new

    def exclude(self, name: str, why: str) -> None:
        self.excluded[name] = why
        self.learned.pop(name, None)

    def wanted(self) -> list[tuple[str, str | None]]:
        return [(n, p) for n, p in self.learned.items() if n not in self.excluded and n not in self.absent]

    def names(self) -> list[str]:
        """What to remember for the next reservation: the modules (not this host's files) held."""
        return [n for n, _ in self.wanted()]

    def forget(self) -> int:
        n = len(self.learned)
        self.learned, self.excluded, self.absent = {}, {}, set()
        return n


def _safe(name: str) -> str:
    return "".join(c if c.isalnum() or c in "-_." else "_" for c in name) or "host"


#: Learning is on unless this is 0/false/no in the environment ``monarch serve`` starts agents
#: with. (It was opt-in while DDP scripts hung at exit in 1 run of 3 when forked from a learned
#: warm process: a torch teardown race that rank.start._settle_gloo_teardown now sidesteps.)
LEARN_ENV = EnvSettings.learn_preload.var


def learning_enabled() -> bool:
    return env.learn_preload


class WarmRanks:
    """The agent's warm-rank fork servers: the one runs fork from, and the next one warming.

    ``start(preload, learned_file, ready_file)`` starts a zygote process; ``watch``/``unwatch``
    register its socket with the agent's poller. Runs are never held up by learning: a new
    zygote gets no fork request before it says it is ready.
    """

    def __init__(
        self,
        host: str,
        preload: str,
        start: Callable[[str, str | None, str], Any],
        watch: Callable[[Any], None],
        unwatch: Callable[[Any], None],
        running_since: Callable[[], float | None] = lambda: None,
    ) -> None:
        self.preload = preload
        self._start, self._watch, self._unwatch = start, watch, unwatch
        self._running_since = running_since  # time.monotonic() the oldest live rank here started
        self._spares = 0  # warm ranks the last run had here: spares to keep
        self._postponed = False
        self._keeping = False  # the last run kept its ranks: learn nothing meanwhile
        self.host = host
        self.store = LearnedStore()
        self.current: _Warm | None = None
        self.next: _Warm | None = None
        self.retired: list[_Warm] = []
        self._dir: str | None = None
        self._serial = 0
        self.learning = learning_enabled()
        # warm the learned set once the first zygote is ready
        self._again = self.learning and bool(self.store.wanted())
        self._retries = 0

    # ------------------------------------------------------------------ files
    @property
    def dir(self) -> str:
        if self._dir is None:
            self._dir = private_tmpdir("warm")
        return self._dir

    def report_path(self, run_id: str, rank: int) -> str:
        return os.path.join(self.dir, f"run-{_safe(run_id)}-{rank}.json")

    def close(self) -> None:
        for w in self._all():
            w.zygote.kill()
        if self._dir is not None:
            shutil.rmtree(self._dir, ignore_errors=True)

    def _all(self) -> list[_Warm]:
        return [w for w in (self.current, self.next, *self.retired) if w is not None]

    # ------------------------------------------------------------------- zygotes
    def _spawn(self, learned: list[tuple[str, str | None]]) -> _Warm:
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

    def for_run(self, keep: bool = False) -> tuple[Any, list[str]]:
        """The zygote this run's warm ranks fork from, and notices for the user (a changed file).
        While runs keep their ranks (``keep``), nothing is learned: kept ranks hold what they
        imported, and a warm-up would hold up the hand-over of the next run to them."""
        self._keeping = keep
        notices: list[str] = []
        cur = self.current
        if cur is not None and cur.zygote.process.poll() is not None:
            self._drop(cur)
            cur = None
        if cur is not None and cur.files is not None:  # (it is ready: its files are watched from then)
            changed = cur.files.changed()
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
            self._again = bool(self.store.wanted())  # the learned set follows once it is ready

    def zygotes(self) -> list[Any]:
        """Every warm-rank fork server alive now (the one runs fork from, the next, retired ones)."""
        return [w.zygote for w in self._all()]

    def learn(self, run_id: str) -> None:
        """A run ended here: merge what its ranks imported; warm a new zygote if that is new."""
        if self._dir is None or not self.learning:
            return
        prefix = f"run-{_safe(run_id)}-"
        found: list[tuple[str, str]] = []
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
            self._retries = 0
        self._maybe_warm()

    def _maybe_warm(self) -> None:
        """Start the next zygote if the store has modules the current one lacks (one at a time:
        a zygote importing competes with the runs for the host's CPUs)."""
        if not self.learning or self._retries > _MAX_OFFENDER_RETRIES or self._keeping:
            return  # (until a run teaches something new: each try costs a whole warm-up)
        since = self._running_since()
        if since is not None and time.monotonic() - since < POSTPONE_WHILE_RUN_YOUNGER_S:
            self._postponed = True  # tick() tries again once the run has ended or grown old
            return
        self._postponed = False
        cur = self.current
        if self.next is not None or (cur is not None and cur.ready is None):
            self._again = True
            return
        wanted = self.store.wanted()
        if not wanted:
            return
        if cur is not None and self._holds_all(cur, wanted):
            return
        if cur is not None and not cur.retired:
            if cur.children <= 0:
                self._learn_in_place(cur, wanted)
                return
            if since is None:  # its last ranks said they exit; the kernel has not freed them yet
                self._postponed = True  # (their exit, or tick(), tries again)
                return
        self.next = self._spawn(wanted)

    def _learn_in_place(self, warm: _Warm, wanted: list[tuple[str, str | None]]) -> None:
        """Have the idle warm process runs fork from import what is new itself: no second process
        importing torch and everything again beside the next run (on a 2-core host, runs 2-4 after
        serve took 3-4 s each while a new warm process was built beside them). A run that comes
        meanwhile forks once it is done (its ranks would import the same modules themselves)."""
        self._serial += 1
        learned_file = os.path.join(self.dir, f"learned-{self._serial}.json")
        with open(learned_file, "w") as f:
            json.dump(wanted, f)
        self._unlink(warm.ready_file)
        warm.ready_file = os.path.join(self.dir, f"ready-{self._serial}.json")
        warm.ready, warm.in_place, warm.learned = None, True, len(wanted)
        if warm.files is not None:
            warm.files.close()
            warm.files = None
        warm.zygote.learn_more(learned_file, warm.ready_file)

    @staticmethod
    def _holds_all(warm: _Warm, wanted: list[tuple[str, str | None]]) -> bool:
        ready = warm.ready or {}
        have = {*ready.get("held", ()), *ready.get("left_out", {}), *ready.get("absent", ())}
        return all(n in have for n, _ in wanted)

    def hint(self, names: list[str]) -> int:
        """Modules the client expects this reservation's runs to import (read from the served
        script, or learned by earlier reservations of its workspace): warm them now, so that the
        first run after serve forks from a process that holds them. Returns how many were new."""
        if not self.learning:
            return 0
        new = self.store.add((str(n), None) for n in names)
        if not new:
            return 0
        self._retries = 0
        cur = self.current
        if cur is not None and cur.ready is None and cur.children == 0 and self.next is None:
            self._drop(cur, kill=True)  # (still importing the explicit preload: start over with the hints)
            self.current = self._spawn(self.store.wanted())
        else:
            self._maybe_warm()
        return new

    def settled(self) -> bool:
        """Whether the warm process runs fork from holds everything wanted (nothing left to warm)."""
        cur = self.current
        if cur is None or cur.ready is None or self.next is not None or self._again or self._postponed:
            return False
        if not self.learning or self._keeping or self._retries > _MAX_OFFENDER_RETRIES:
            return True
        return self._holds_all(cur, self.store.wanted())

    def tick(self) -> None:
        """A warm-up postponed for a run: start it once that run has ended or grown old."""
        if self._postponed:
            self._maybe_warm()

    def on_message(self, zygote: Any, msg: Any) -> bool:
        """A message from one of our zygotes; True if it was ours to handle (not a fork/exit)."""
        warm = next((w for w in self._all() if w.zygote is zygote), None)
        if warm is None:
            return False
        kind = msg.KIND
        if kind == "exit":
            self._child_ended(warm)
        elif kind == "ready":
            self._ready(warm)
            return True
        return False

    def keep_spares(self, count: int, busy: set[int]) -> None:
        """A run that forked ``count`` warm ranks here ended: have that many forked ahead for the
        next one (:mod:`.zygote`'s spares), in the warm process it will fork from: the current
        one, which may have replaced the run's own meanwhile. Not while ranks of it run
        (``busy``: zygote pids); that run's end asks again."""
        if count <= 0:
            return
        self._spares = count
        cur = self.current
        if cur is not None and cur.ready is not None and cur.zygote.process.pid not in busy:
            cur.zygote.spares(count)

    def rank_kept(self, zygote_pid: int) -> None:
        """A rank of ``zygote_pid``'s ended its run and stays for the next (``--keep-ranks``): it no
        longer counts as a running child (the zygote will not say it exited)."""
        warm = next((w for w in self._all() if w.zygote.process.pid == zygote_pid), None)
        if warm is not None:
            self._child_ended(warm)

    def _child_ended(self, warm: _Warm) -> None:
        """One rank of ``warm``'s exited or was kept: a retired one with none left goes (its kept
        ranks with it: they hold its stale files), a postponed warm-up may start."""
        warm.children -= 1
        if warm.retired and warm.children <= 0:
            self._drop(warm, kill=True)
        elif warm.children <= 0 and self._postponed:
            self._maybe_warm()

    def fork_asked(self, zygote: Any) -> None:
        """A rank was asked of ``zygote``: it counts as a child from now, not from its ``forked`` reply,
        so a zygote retired meanwhile (the next one became ready) is not killed with forks in flight
        (those ranks would never start, and their run would wait for them for good)."""
        warm = next((w for w in self._all() if w.zygote is zygote), None)
        if warm is not None:
            warm.children += 1

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
        self.store.absent.update(warm.ready.get("absent", ()))
        in_place, warm.in_place = warm.in_place, False
        if offender:  # a new one exits by itself (it never forked); one learning in place runs what it has cold
            if in_place:
                self._retire(warm)
            else:
                self._drop(warm, kill=True)
            self._retries += 1
            self._maybe_warm()
            return
        warm.files = FileWatch(warm.ready.get("files", {}))  # (a stat of each once, here, not in a run)
        if warm is self.next:
            if self.current is not None:
                self._retire(self.current)
            self.current, self.next = warm, None
        if warm is self.current and self._spares and self._running_since() is None:
            # The next run forks from this one: its spares now, as the last run's end would have
            # asked of the one it replaces or of this one before it learned (else that run's ranks
            # wait for forks).
            warm.zygote.spares(self._spares)
        if self._again:
            self._again = False
            self._maybe_warm()

    def gone(self, zygote: Any) -> bool:
        """A zygote's socket closed; True if runs were forking from it (it wants replacing)."""
        warm = next((w for w in self._all() if w.zygote is zygote), None)
        if warm is None:
            return False
        was_current = warm is self.current
        self._drop(warm)
        return was_current

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
        if warm.files is not None:
            warm.files.close()
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
        self._unlink(warm.ready_file)

    @staticmethod
    def _unlink(path: str) -> None:
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

    def info(self) -> dict[str, Any]:
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
            "warming": self.next is not None or (cur is not None and cur.in_place),
            "spares": self._spares,  # rank children kept forked ahead for the next run
            "learning": self.learning,
            "settled": self.settled(),
            "hinted": sum(1 for f in self.store.learned.values() if f is None),
        }


def _rss(pid: int) -> int | None:
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None
