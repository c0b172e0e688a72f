from __future__ import annotations

import ast
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from monarch_cli import config, configure
from monarch_cli.config import settings
from monarch_cli.errors import OptionError

from .conftest import REPO, one_line_error


def test_configure_changes_and_validates_settings():
    old = settings().call_timeout
    try:
        assert configure(call_timeout=3.5).call_timeout == 3.5
    finally:
        configure(call_timeout=old)
    with pytest.raises(TypeError, match="unknown setting"):
        configure(no_such_thing=1)
    with pytest.raises(ValueError, match="transport"):
        configure(transport="carrier-pigeon")


# ---------------------------------------------------------------------- MONARCH_* settings
PACKAGE = REPO / "monarch_cli"
NAME = re.compile(r"_?MONARCH_[A-Z_]*[A-Z]")


def _declared() -> set[str]:
    """Every MONARCH_* name config.py declares: the settings' variables and the internal hand-offs."""
    names = {var.var for var in config.VARS} | set(config.INTERNAL)
    return names | {config.AGENT_READY_PREFIX.strip()}


def _docstrings(tree: ast.AST) -> set[int]:
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            body = node.body
            if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
                found.add(id(body[0].value))
    return found


def _spelled_out(source: str, where: str) -> list[str]:
    """``MONARCH_*`` names in ``source``'s code strings (not its docstrings or comments): each must come from config."""
    tree = ast.parse(source, where)
    docs = _docstrings(tree)
    return [
        f"{where}:{node.lineno}: {name}"
        for node in ast.walk(tree)
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docs
        for name in NAME.findall(node.value)
    ]


def test_every_monarch_variable_is_declared_once_in_config() -> None:
    """No module spells a variable's name in code (it uses ``config``'s field or constant), and every name
    a docstring, comment or template mentions is one config.py declares."""
    spelled, unknown = [], []
    for path in sorted(PACKAGE.rglob("*")):
        if path.suffix not in (".py", ".sbatch", ".sh", ".yaml", ".txt") or "__pycache__" in path.parts:
            continue
        rel = str(path.relative_to(REPO))
        text = path.read_text()
        unknown += [f"{rel}: {n}" for n in sorted(set(NAME.findall(text)) - _declared())]
        if path.suffix == ".py" and path.name != "config.py" and "templates" not in path.parts:
            spelled += _spelled_out(text, rel)
        elif path.suffix != ".py":
            spelled += [f"{rel}: {n}" for n in NAME.findall(text)]
    assert not unknown, "MONARCH_* names config.py does not declare:\n" + "\n".join(unknown)
    assert not spelled, "MONARCH_* names spelled outside config.py (use its field or constant):\n" + "\n".join(spelled)
    source = (PACKAGE / "config.py").read_text()
    twice = [n for n in _declared() if len(re.findall(rf'"{n}[ "]', source)) != 1]
    assert not twice, f"declared other than once in config.py: {twice}"


def test_the_name_check_catches_a_spelled_name() -> None:
    source = '"""Reads $MONARCH_STATE."""\nimport os\nx = os.environ.get("MONARCH_STATE")\ny = f"{x} MONARCH_HOST=1"\n'
    assert _spelled_out(source, "m.py") == ["m.py:3: MONARCH_STATE", "m.py:4: MONARCH_HOST"]


def test_a_setting_reads_its_variable_when_asked(monkeypatch: pytest.MonkeyPatch) -> None:
    """Fresh each time (a child reads what its parent set); empty is unset unless it means something."""
    monkeypatch.delenv("MONARCH_KEEP_RUNS", raising=False)
    assert config.env.keep_runs == config.EnvSettings.keep_runs.default == 20
    monkeypatch.setenv("MONARCH_KEEP_RUNS", " 3 ")
    assert config.env.keep_runs == 3
    monkeypatch.setenv("MONARCH_KEEP_RUNS", "")
    assert config.env.keep_runs == 20
    flag = config.EnvSettings.telemetry
    assert [flag.read({flag.var: w}) for w in ("0", "off", "No", "1", "TRUE", "")] == [False] * 3 + [True] * 3
    spy = config.EnvSettings.py_spy
    assert spy.read({spy.var: ""}) == "" and spy.read({}) is None  # empty: no py-spy; unset: look for one
    with pytest.raises(OptionError, match=r"^MONARCH_TELEMETRY: expected one of 1/0, true/false, yes/no, on/off"):
        flag.read({flag.var: "maybe"})
    with pytest.raises(OptionError, match=r"^MONARCH_STALL_TIMEOUT: expected a number of seconds, got '-1'$"):
        config.EnvSettings.stall_timeout.read({"MONARCH_STALL_TIMEOUT": "-1"})


def test_every_setting_is_documented() -> None:
    """docs/runtime.md's table is the one config.py generates; every field says what it does and who reads it."""
    for var in config.VARS:
        assert var.var.startswith(config.PREFIX) and var.doc and var.name, var.var
        assert set(var.readers.split(", ")) <= {"client", "agent", "rank"}, var.var
    assert len({var.var for var in config.VARS}) == len(config.VARS)
    docs = (REPO / "docs" / "runtime.md").read_text()
    table = docs.split("<!-- settings:begin -->\n", 1)[1].split("<!-- settings:end -->", 1)[0]
    assert table == config.settings_markdown(), "docs/runtime.md's Settings table is stale: regenerate it"


def _monarch(*args: str, cwd: Path, **env: str) -> subprocess.CompletedProcess:
    clean = {k: v for k, v in os.environ.items() if not k.startswith(config.PREFIX)}
    return subprocess.run(
        [sys.executable, "-m", "monarch_cli", *args],
        cwd=cwd,
        env={**clean, "PYTHONPATH": str(REPO), **env},
        capture_output=True,
        text=True,
        timeout=120,
        stdin=subprocess.DEVNULL,
    )


def test_version_json_lists_the_settings_and_never_a_secret(tmp_path: Path) -> None:
    secrets = {
        "MONARCH_KEYS": "k-secret-in-env",
        "MONARCH_RESERVATION_KEYS": "r-secret-in-env",
        "MONARCH_OTLP_ENDPOINT": "https://user:TOKEN-in-url@collector:4318",
    }
    done = _monarch("version", "--json", cwd=tmp_path, MONARCH_STALL_TIMEOUT="90", MONARCH_DEBUG="0", **secrets)
    assert done.returncode == 0, done.stderr
    listed = json.loads(done.stdout)["settings"]
    assert listed["stall_timeout"] | {"doc": ""} == {
        "variable": "MONARCH_STALL_TIMEOUT",
        "value": 90.0,
        "source": "env",
        "default": None,
        "read_by": "client",
        "doc": "",
    }
    assert listed["keep_runs"]["source"] == "default" and listed["keep_runs"]["value"] == 20
    assert listed["otlp_endpoint"] == listed["otlp_endpoint"] | {"value": "<redacted>", "source": "env"}
    assert set(listed) == {var.name for var in config.VARS}
    table = _monarch("version", "--settings", cwd=tmp_path, MONARCH_STALL_TIMEOUT="90", **secrets)
    assert table.returncode == 0 and "MONARCH_STALL_TIMEOUT" in table.stdout and "90.0 (env)" in table.stdout
    for printed in (done, table):
        for secret in ("k-secret", "r-secret", "TOKEN"):
            assert secret not in printed.stdout + printed.stderr


def test_a_bad_value_is_one_line_naming_its_variable(tmp_path: Path) -> None:
    """Read at import (the telemetry store's) and read by a run (the stall timeout): one line, non-zero.
    `monarch version` still lists it, with the error, for a bug report."""
    bad = _monarch("sql", "select 1", cwd=tmp_path, MONARCH_TELEMETRY_RUNS="lots")
    one_line_error(bad, "MONARCH_TELEMETRY_RUNS: expected a whole number (0 or more), got 'lots'")
    assert bad.returncode == 2
    state = {"MONARCH_STATE": str(tmp_path / ".monarch" / "job_state.pkl")}
    served = _monarch("serve", "--hosts", "1", cwd=tmp_path, **state)
    assert served.returncode == 0, served.stderr
    try:
        run = _monarch("run-spmd", "--", "python", "-c", "print(1)", cwd=tmp_path, MONARCH_STALL_TIMEOUT="abc", **state)
        one_line_error(run, "MONARCH_STALL_TIMEOUT: expected a number of seconds, got 'abc'")
    finally:
        assert _monarch("stop", cwd=tmp_path, **state).returncode == 0
    listed = _monarch("version", "--json", cwd=tmp_path, MONARCH_STALL_TIMEOUT="abc")
    assert listed.returncode == 0
    assert json.loads(listed.stdout)["settings"]["stall_timeout"]["error"].startswith("MONARCH_STALL_TIMEOUT:")
