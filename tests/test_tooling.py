"""The type-check ratchet can only tighten: a module listed as still having errors must still have them."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from .conftest import REPO

_BLOCK = re.compile(r"\[\[tool\.mypy\.overrides\]\]\n# RATCHET.*?ignore_errors = true\n", re.S)


def _ratchet() -> list[str]:
    block = _BLOCK.search((REPO / "pyproject.toml").read_text())
    assert block, "the ratchet block is not where this test looks for it"
    return re.findall(r'^\s+"([\w.]+)",$', block.group(0), re.M)


@pytest.mark.slow
def test_every_module_in_the_mypy_ratchet_still_has_errors(tmp_path: Path) -> None:
    """Take a module off the list once it is clean, so that it stays clean."""
    text = (REPO / "pyproject.toml").read_text()
    unratcheted = _BLOCK.sub("", text)
    assert _ratchet() and unratcheted != text
    config = tmp_path / "pyproject.toml"
    config.write_text(unratcheted)
    done = subprocess.run(
        [sys.executable, "-m", "mypy", "--config-file", str(config), "--cache-dir", str(REPO / ".mypy_cache")],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=600,
    )
    failing = {
        line.split(":")[0][:-3].replace("/", ".").removesuffix(".__init__")
        for line in done.stdout.splitlines()
        if ": error:" in line
    }
    clean = sorted(set(_ratchet()) - failing)
    assert not clean, f"clean now, take them off [[tool.mypy.overrides]] in pyproject.toml: {clean}"
