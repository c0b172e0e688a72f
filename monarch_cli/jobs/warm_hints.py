"""What the first run after ``serve`` will import, known before it runs (client side).

A warm process learns from runs, so without help the first runs after every ``serve`` start
from one that holds torch only (a Trainer script's first re-runs took 2-7 s, not 0.3). Two
sources tell the agents more at serve time, as plain module names (hosts resolve each to their
own installed file, or skip it):

* **the source**: the served script's imports, read with :mod:`ast` (never run), and those of
  the workspace modules it imports, recursively; ``from pkg import Name`` becomes
  ``pkg:Name``, which the warm process resolves as the ``from`` statement would (a lazy
  package's submodule: ``transformers:Trainer`` loads ``transformers.trainer``);
* **history**: what earlier reservations of this workspace held for the same program, which
  :meth:`~.job.Job.stop` asks one host for and keeps in ``.monarch/warm-learned.json`` (the
  client's, 0600; refused if another user owns or can write it).

Workspace modules are never hinted: the warm process must not hold the user's code.
"""

from __future__ import annotations

import ast
import json
import os
from pathlib import Path

from ..sysutil import UnsafePath, atomic_write, check_private
from .torchrun import parse_command

HISTORY_FILE = "warm-learned.json"
#: A workspace read no further than this many files (a script that imports a big tree of its own).
MAX_FILES = 500
#: Hints kept per program (what a Trainer script imports is ~4,500 modules; this is a cap, not a goal).
MAX_NAMES = 20_000


def program_key(argv: list[str]) -> str | None:
    """The served program as history keys it (``script:train.py``, ``module:pkg.train``), or None."""
    try:
        spec = parse_command(argv)
    except Exception:  # noqa: BLE001 - not a command we can read: nothing to hint
        return None
    if not spec.program or spec.mode not in ("script", "module"):
        return None
    return f"{spec.mode}:{spec.program[0]}"


def source_hints(argv: list[str], cwd: str | Path) -> list[str]:
    """The installed modules the served program's source (and its workspace modules') import."""
    key = program_key(argv)
    if key is None:
        return []
    mode, _, target = key.partition(":")
    base = Path(cwd)
    if mode == "script":
        entry = (base / target).resolve()
        roots = [entry.parent, base.resolve()]
        files = [entry] if entry.is_file() else []
    else:
        roots = [base.resolve()]
        files = _module_files(target, roots)
        if not files:
            return [target]  # an installed module run with -m: hint the module itself
    return _Scan(roots).run(files)


class _Scan:
    def __init__(self, roots: list[Path]) -> None:
        self.roots = roots
        self.names: dict[str, None] = {}
        self.seen: set[Path] = set()
        self.queue: list[Path] = []

    def run(self, files: list[Path]) -> list[str]:
        self.queue.extend(files)
        while self.queue and len(self.seen) < MAX_FILES:
            file = self.queue.pop(0)
            if file in self.seen:
                continue
            self.seen.add(file)
            try:
                tree = ast.parse(file.read_bytes(), str(file))
            except (OSError, SyntaxError, ValueError):
                continue
            for node in _imports(tree):
                self._visit(node, file)
        return list(self.names)

    def _visit(self, node: ast.Import | ast.ImportFrom, file: Path) -> None:
        if isinstance(node, ast.Import):
            for alias in node.names:
                self._name(alias.name)
            return
        if node.level:  # relative: the workspace's own package
            base = file.parent
            for _ in range(node.level - 1):
                base = base.parent
            target = base.joinpath(*(node.module or "").split(".")) if node.module else base
            self.queue.extend(_files_at(target))
            for alias in node.names:
                self.queue.extend(_files_at(target / alias.name))
            return
        module = node.module or ""
        if module == "__future__":
            return
        if self._name(module):
            for alias in node.names:
                if alias.name != "*":
                    self.names.setdefault(f"{module}:{alias.name}")
        else:
            for alias in node.names:
                self.queue.extend(_module_files(f"{module}.{alias.name}", self.roots))

    def _name(self, name: str) -> bool:
        """Hint an installed module (True), or queue a workspace one's files (False)."""
        files = _module_files(name, self.roots)
        if files or _in_workspace(name, self.roots):
            self.queue.extend(files)
            return False
        self.names.setdefault(name)
        return True


def _imports(tree: ast.AST) -> list[ast.Import | ast.ImportFrom]:
    """Every import statement, but not those under ``if TYPE_CHECKING:`` (never run)."""
    found: list[ast.Import | ast.ImportFrom] = []
    stack = [tree]
    while stack:
        node = stack.pop()
        if isinstance(node, ast.If) and _is_type_checking(node.test):
            stack.extend(node.orelse)
            continue
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            found.append(node)
        stack.extend(reversed(list(ast.iter_child_nodes(node))))
    return found


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _in_workspace(name: str, roots: list[Path]) -> bool:
    top = name.split(".")[0]
    return any((r / top).is_dir() or (r / f"{top}.py").is_file() for r in roots)


def _module_files(name: str, roots: list[Path]) -> list[Path]:
    """The workspace files that ``import name`` runs (its packages' ``__init__``s too), if any."""
    parts = name.split(".")
    for root in roots:
        found = []
        for i in range(1, len(parts) + 1):
            found.extend(_files_at(root.joinpath(*parts[:i])))
        if found:
            return found
    return []


def _files_at(target: Path) -> list[Path]:
    if (target / "__init__.py").is_file():
        return [target / "__init__.py"]
    if target.with_suffix(".py").is_file():
        return [target.with_suffix(".py")]
    return []


# --------------------------------------------------------------------- history
def _history_path(state_dir: Path) -> Path:
    return state_dir / HISTORY_FILE


def load_history(state_dir: Path) -> dict[str, list[str]]:
    """What earlier reservations of this workspace held, per program ({} if none or not ours)."""
    path = _history_path(state_dir)
    try:
        if not check_private(path):
            return {}
        data = json.loads(path.read_text())
    except (UnsafePath, OSError, ValueError):
        return {}
    if not isinstance(data, dict):
        return {}
    return {str(k): [str(n) for n in v][:MAX_NAMES] for k, v in data.items() if isinstance(v, list)}


def remember(state_dir: Path, program: str, names: list[str]) -> None:
    """Keep what a reservation held for ``program`` (replacing the last one's: it stays the size of
    what one program imports, not the union of everything ever run here)."""
    if not names or not state_dir.is_dir():
        return
    history = load_history(state_dir)
    history[program] = list(dict.fromkeys(names))[:MAX_NAMES]
    try:
        atomic_write(_history_path(state_dir), json.dumps(history), 0o600)
    except OSError:
        pass


def forget_history(state_dir: Path) -> None:
    try:
        os.unlink(_history_path(state_dir))
    except OSError:
        pass


def hints(state_dir: Path, argv: list[str], cwd: str | Path) -> list[str]:
    """Everything to hint for serving ``argv`` in ``cwd``: history first (import order), then source."""
    key = program_key(argv)
    if key is None:
        return []
    learned = load_history(state_dir).get(key, [])
    return list(dict.fromkeys([*learned, *source_hints(argv, cwd)]))
