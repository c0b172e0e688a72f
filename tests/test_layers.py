"""The package's shape: every module imports on its own, dependencies run one way, commands import little.

cli -> jobs -> schedulers -> runtime -> (config, errors, shutdown, sysutil, templates, version)

Inside runtime/: agent -> actor -> mailbox -> launch -> rank -> protocol -> transport -> (its leaf modules).
No import cycle between any two modules of the package.
"""

from __future__ import annotations

import ast
import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from .conftest import REPO

PACKAGE = REPO / "monarch_cli"
#: Each package's layer; a module may import its own layer and the ones below, never above.
LAYERS = {
    "cli": 4,
    "jobs": 3,
    "schedulers": 2,
    "runtime": 1,
    "config": 0,
    "errors": 0,
    "sysutil": 0,
    "shutdown": 0,
    "templates": 0,
    "telemetry": 0,
    "version": 0,
    "dashboard": 4,
    "mcp": 4,
}
#: The top-level modules of the package itself (``monarch_cli/__init__.py`` re-exports the runtime lazily).
ROOT = {"__init__": 1, "__main__": 4}


def _modules() -> list[str]:
    names = []
    for path in sorted(PACKAGE.rglob("*.py")):
        rel = path.relative_to(REPO).with_suffix("")
        parts = list(rel.parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        if "templates" in parts and parts[-1] != "templates":
            continue  # example scripts shipped as data, not modules of the package
        names.append(".".join(parts))
    return names


def _layer(module: str) -> int:
    parts = module.split(".")
    if len(parts) == 1:
        return ROOT["__init__"]
    if parts[1] in ROOT:
        return ROOT[parts[1]]
    return LAYERS[parts[1]]


def _imports(path: Path, module: str) -> list[tuple[int, str]]:
    """Every monarch_cli module ``path`` imports (at any depth of the file), with its line."""
    tree = ast.parse(path.read_text(), str(path))
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(node.lineno, a.name) for a in node.names if a.name.startswith("monarch_cli")]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            if target.startswith("monarch_cli"):
                if node.module is None or target.count(".") == 0:
                    found += [(node.lineno, f"{target}.{a.name}") for a in node.names]
                else:
                    found.append((node.lineno, target))
    return found


def test_no_module_imports_a_higher_layer() -> None:
    wrong: list[str] = []
    for path in sorted(PACKAGE.rglob("*.py")):
        rel = path.relative_to(REPO).with_suffix("")
        parts = list(rel.parts)
        if "templates" in parts:
            continue
        module = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        mine = _layer(module)
        for line, target in _imports(path, module):
            if target.split(".")[1:2] in (["__init__"], []):
                continue
            try:
                theirs = _layer(target)
            except KeyError:
                continue
            if theirs > mine:
                wrong.append(f"{path.relative_to(REPO)}:{line} imports {target}")
    assert not wrong, (
        "imports against the layering (cli -> jobs -> schedulers -> runtime -> config/errors):\n" + "\n".join(wrong)
    )


#: Optional-weight libraries and the only modules that may import them (lazily: a command that does not use them
#: never pays for them; `test_commands_import_only_what_they_need` checks the commands).
RUNTIME_LAYERS = {
    "agent": 7,  # the host agent, its handlers, its warm processes: on each host
    "actor": 6,  # the actor API and the proc process
    "mailbox": 5,  # a process's messaging endpoint and its futures (client, procs)
    "launch": 4,  # the agent's command line, local agent starts: in the client
    "rank": 3,  # inside a rank: messages only, never the mailbox or the agent (it must stay light)
    "protocol": 2,  # every message, defined once
    "transport": 1,  # encoding, keys, authenticated sockets
}
#: Modules directly in runtime/ (errors, exit statuses, titles, workspace, DAP pieces) are leaves shared by all.
RUNTIME_LEAF = 0


def _runtime_layer(module: str) -> int | None:
    """``module``'s layer inside runtime/, or None outside it (``monarch_cli.runtime`` itself re-exports lazily)."""
    parts = module.split(".")
    if parts[:2] != ["monarch_cli", "runtime"] or len(parts) == 2:
        return None
    return RUNTIME_LAYERS.get(parts[2], RUNTIME_LEAF)


def _runtime_upward(path: Path, module: str) -> list[str]:
    mine = _runtime_layer(module)
    if mine is None:
        return []
    wrong = []
    for line, target in _imports(path, module):
        theirs = _runtime_layer(target)
        if theirs is not None and theirs > mine:
            wrong.append(
                f"{path.name}:{line} imports {target}"
                if REPO not in path.parents
                else f"{path.relative_to(REPO)}:{line} imports {target}"
            )
    return wrong


def test_runtime_subpackages_import_only_lower_ones() -> None:
    wrong = [w for path in sorted((PACKAGE / "runtime").rglob("*.py")) for w in _runtime_upward(path, _module(path))]
    assert not wrong, "imports against runtime/'s layering (" + " -> ".join(RUNTIME_LAYERS) + "):\n" + "\n".join(wrong)


def test_the_runtime_layer_check_catches_an_upward_import(tmp_path: Path) -> None:
    """A rank module importing the mailbox is reported; the same import from the agent is not."""
    fake = tmp_path / "fake.py"
    fake.write_text("from ..mailbox.mailbox import Mailbox\n")
    assert _runtime_upward(fake, "monarch_cli.runtime.rank.fake") == [
        "fake.py:1 imports monarch_cli.runtime.mailbox.mailbox"
    ]
    assert _runtime_upward(fake, "monarch_cli.runtime.agent.fake") == []  # downward: fine
    assert _runtime_layer("monarch_cli.runtime.protocol.base") > _runtime_layer("monarch_cli.runtime.transport.wire")
    assert _runtime_layer("monarch_cli.runtime.agent.host") > _runtime_layer("monarch_cli.runtime.actor.proc")


def _module(path: Path) -> str:
    parts = list(path.relative_to(REPO).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _import_graph(modules: dict[str, Path]) -> dict[str, set[str]]:
    """Module -> the package's modules it imports: at module level, inside functions, and under TYPE_CHECKING.

    Type-only imports count too: they are how a reader (and a type checker) sees a dependency, and the
    handler <-> agent "cycle" this test was written against was one. ``from pkg import name`` counts
    as an import of ``pkg.name`` where that is a module, else of ``pkg``.
    """
    graph: dict[str, set[str]] = {}
    for module, path in modules.items():
        package = module if path.name == "__init__.py" else module.rpartition(".")[0]
        found: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                found |= {a.name for a in node.names}
            elif isinstance(node, ast.ImportFrom):
                base = package.split(".")[: len(package.split(".")) - node.level + 1] if node.level else []
                target = ".".join(base + ([node.module] if node.module else []))
                for a in node.names:
                    found.add(f"{target}.{a.name}" if f"{target}.{a.name}" in modules else target)
        resolved = set()
        for target in found:
            while target and target not in modules:
                target = target.rpartition(".")[0]
            if target and target != module:
                resolved.add(target)
        graph[module] = resolved
    return graph


def _cycles(graph: dict[str, set[str]]) -> list[frozenset[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[frozenset[str]] = []
    for root in graph:
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph.get(child, ())))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = set()
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.add(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(frozenset(component))
    return found


#: Cycles the package still has, as a ratchet: a new cycle fails the test, and so does one listed here that is gone
#: (strike it). Empty since issue 19 (jobs' model module, the SkyPilot package's provisioner module).
KNOWN_CYCLES: set[frozenset[str]] = set()


def test_no_import_cycles_between_modules() -> None:
    modules = {_module(p): p for p in sorted(PACKAGE.rglob("*.py")) if "templates" not in p.parts}
    found = set(_cycles(_import_graph(modules)))
    new = [" <-> ".join(sorted(c)) for c in found - KNOWN_CYCLES]
    gone = [" <-> ".join(sorted(c)) for c in KNOWN_CYCLES - found]
    assert not new, "modules that import each other (directly or round a loop):\n" + "\n".join(new)
    assert not gone, "no longer a cycle, strike it from KNOWN_CYCLES:\n" + "\n".join(gone)
    assert not any(m.startswith("monarch_cli.runtime") for c in found for m in c)


def test_the_cycle_check_catches_a_planted_cycle(tmp_path: Path) -> None:
    """The check itself can fail: two modules importing each other, one of them only inside a function."""
    (tmp_path / "a.py").write_text("from . import b\n")
    (tmp_path / "b.py").write_text("def f():\n    from .a import x\n")
    (tmp_path / "c.py").write_text("from .a import y\n")
    graph = _import_graph({"pkg.a": tmp_path / "a.py", "pkg.b": tmp_path / "b.py", "pkg.c": tmp_path / "c.py"})
    assert graph == {"pkg.a": {"pkg.b"}, "pkg.b": {"pkg.a"}, "pkg.c": {"pkg.a"}}
    assert _cycles(graph) == [frozenset({"pkg.a", "pkg.b"})]


OWNED = {
    "paramiko": {"monarch_cli/schedulers/ssh/scheduler.py", "monarch_cli/schedulers/skypilot/ssh_access.py"},
    "pathspec": {"monarch_cli/runtime/workspace/scan.py"},
    "torchx": {"monarch_cli/schedulers/torchx/appdef.py", "monarch_cli/schedulers/torchx/scheduler.py"},
    "kubernetes": {
        f"monarch_cli/schedulers/kubernetes/{name}.py" for name in ("api", "pods", "port_forward", "scheduler")
    },
    "sky": {"monarch_cli/schedulers/skypilot/sdk.py"},
    # the `mcp` extra (and what only it brings): `monarch mcp`'s server, nothing else
    "mcp": {"monarch_cli/mcp/server.py"},
    "anyio": {"monarch_cli/mcp/server.py"},
    "jsonschema": {"monarch_cli/mcp/server.py"},
    "fastapi": {"monarch_cli/dashboard/__init__.py", "monarch_cli/dashboard/app.py"},
    "uvicorn": {"monarch_cli/dashboard/__init__.py"},
    "starlette": {"monarch_cli/dashboard/app.py"},
    "opentelemetry": {"monarch_cli/jobs/otlp.py"},
}


def test_heavy_libraries_are_imported_only_where_needed() -> None:
    wrong = []
    for path in sorted(PACKAGE.rglob("*.py")):
        rel = str(path.relative_to(REPO))
        for node in ast.walk(ast.parse(path.read_text(), rel)):
            names = (
                [a.name for a in node.names]
                if isinstance(node, ast.Import)
                else [node.module or ""]
                if isinstance(node, ast.ImportFrom) and not node.level
                else []
            )
            for name in names:
                owners = OWNED.get(name.split(".")[0])
                if owners is not None and rel not in owners:
                    wrong.append(f"{rel}:{node.lineno} imports {name}")
    assert not wrong, "\n".join(wrong)


def test_the_layer_check_catches_an_upward_import(tmp_path: Path) -> None:
    """The check itself can fail: a scheduler importing the job layer is reported."""
    fake = tmp_path / "fake.py"
    fake.write_text("from ..jobs.state import JobState\n")
    assert _imports(fake, "monarch_cli.schedulers.fake") == [(1, "monarch_cli.jobs.state")]
    assert _layer("monarch_cli.jobs.state") > _layer("monarch_cli.schedulers.fake")


def _import_alone(module: str) -> tuple[str, int, str]:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    done = subprocess.run(
        [sys.executable, "-c", f"import {module}"], capture_output=True, text=True, timeout=120, env=env, cwd=REPO
    )
    return module, done.returncode, done.stderr.strip().splitlines()[-1] if done.stderr.strip() else ""


def test_every_module_imports_first_in_a_fresh_interpreter() -> None:
    """No import cycle hides behind import order: each module is the first one imported, in its own process."""
    modules = [m for m in _modules() if not m.endswith("__main__")]
    assert "monarch_cli.schedulers" in modules and len(modules) > 40
    with ThreadPoolExecutor(max_workers=4) as pool:
        results = list(pool.map(_import_alone, modules))
    failed = [f"{m}: {why}" for m, code, why in results if code != 0]
    assert not failed, "\n".join(failed)


def _loaded_by(argv: list[str], cwd: Path, before: str = "") -> dict[str, bool]:
    """Run the CLI with ``argv`` in a fresh interpreter and report which heavy modules it loaded."""
    code = (
        f"import sys\n{before}\n"
        "from monarch_cli.cli import app\n"
        f"try:\n    app({argv!r})\nexcept SystemExit:\n    pass\n"
        "heavy = ['zmq', 'cloudpickle', 'monarch_cli.runtime.agent.host', 'monarch_cli.runtime.mailbox.mailbox', "
        "'monarch_cli.jobs.spmd', 'torch', 'paramiko', 'pathspec', 'mcp', 'fastapi', 'opentelemetry']\n"
        "print({m: m in sys.modules for m in heavy})\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=cwd,
        env={**os.environ, "PYTHONPATH": str(REPO)},
    )
    assert done.returncode == 0, done.stderr
    return ast.literal_eval(done.stdout.strip().splitlines()[-1])


def test_commands_import_only_what_they_need(tmp_path: Path) -> None:
    run = tmp_path / ".monarch" / "logs" / "20260101-000000-abcd"
    run.mkdir(parents=True)
    (run / "rank0.log").write_text("hello\n")
    logs = _loaded_by(["logs", "--rank", "0"], tmp_path)
    assert not any(logs.values()), f"`monarch logs` loaded {[m for m, on in logs.items() if on]}"
    for argv in (
        ["--help"],
        ["serve", "--help"],
        ["debug", "--help"],
        ["mcp", "--help"],
        ["sbatch", "--dry-run", "--", "python", "t.py"],
    ):
        loaded = _loaded_by(argv, tmp_path)
        assert not any(loaded.values()), f"`monarch {' '.join(argv)}` loaded {[m for m, on in loaded.items() if on]}"
    # the check can tell: the job API does load the runtime
    assert _loaded_by(["--help"], tmp_path, before="import monarch_cli.jobs.job")["zmq"] is True
