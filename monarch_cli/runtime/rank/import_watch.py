"""Seeing imports as they happen, one module at a time (nested imports included).

Two uses: a warm rank hosts torch's rendezvous store only once the script imports
``torch.distributed`` (:func:`after_import`), so a script that never imports torch never
loads it; and a warm process learning modules finds exactly which module started a thread or
installed a signal handler, rather than blaming the name it was asked for (:class:`ImportWatch`).

Both sit first on ``sys.meta_path`` while they are needed, hand every lookup to the other
finders, and wrap the loader they return; the module gets its own loader back before its code
runs, so nothing of this is visible to it afterwards.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any


class _Loader:
    """Calls ``done(name, imported)`` after the module is created (an extension's ``dlopen``)
    and after its code ran; everything else is the real loader's."""

    def __init__(self, real: Any, name: str, done: Callable[[str, bool], None]) -> None:
        self._real, self._name, self._done = real, name, done

    def __getattr__(self, attr: str) -> Any:
        return getattr(self._real, attr)

    def create_module(self, spec: Any) -> Any:
        create = getattr(self._real, "create_module", None)
        module = create(spec) if create is not None else None
        self._done(self._name, False)  # not imported yet, but an extension's dlopen may start threads
        return module

    def exec_module(self, module: Any) -> None:
        module.__loader__ = self._real
        if getattr(module, "__spec__", None) is not None:
            module.__spec__.loader = self._real
        try:
            self._real.exec_module(module)
        except BaseException:
            self._done(self._name, False)
            raise
        self._done(self._name, True)


class _Finder:
    def __init__(self, wanted: Callable[[str], bool], done: Callable[[str, bool], None]) -> None:
        self._wanted, self._done = wanted, done
        self._busy = False

    def find_spec(self, name: str, path: Any = None, target: Any = None) -> Any:
        if self._busy or not self._wanted(name):
            return None
        self._busy = True
        try:
            for finder in sys.meta_path:
                find = getattr(finder, "find_spec", None)
                if finder is self or find is None:
                    continue
                spec = find(name, path, target)
                if spec is not None:
                    break
            else:
                return None
        finally:
            self._busy = False
        if spec.loader is not None and hasattr(spec.loader, "exec_module"):
            spec.loader = _Loader(spec.loader, name, self._done)
        return spec

    def remove(self) -> None:
        try:
            sys.meta_path.remove(self)  # type: ignore[arg-type]
        except ValueError:
            pass


def after_import(name: str, callback: Callable[[], None]) -> None:
    """Run ``callback`` once ``name`` has been imported (now, if it already is)."""
    if name in sys.modules:
        callback()
        return

    def done(loaded: str, ok: bool) -> None:
        if ok and loaded == name:
            finder.remove()
            callback()

    finder = _Finder(lambda n: n == name, done)
    sys.meta_path.insert(0, finder)  # type: ignore[arg-type]


class ImportWatch:
    """``check()`` runs after each module (nested ones first) is loaded; the first module after
    which it says something changed is the culprit: ``(name, why)``."""

    def __init__(self, check: Callable[[str], str | None]) -> None:
        self._check = check
        self.culprit: tuple[str, str] | None = None
        self._finder = _Finder(lambda _n: self.culprit is None, self._done)

    def _done(self, name: str, _ok: bool) -> None:
        if self.culprit is None:
            why = self._check(name)
            if why is not None:
                self.culprit = (name, why)

    def __enter__(self) -> ImportWatch:
        sys.meta_path.insert(0, self._finder)  # type: ignore[arg-type]
        return self

    def __exit__(self, *_: object) -> None:
        self._finder.remove()
