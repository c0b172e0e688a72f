"""No module is exempt from the type check: mypy's configuration ignores no module's errors."""

from __future__ import annotations

import re

import pytest

from .conftest import REPO

# ``ignore_errors = ...`` as a TOML key (not in a comment), under [tool.mypy] or any [[tool.mypy.overrides]]
_IGNORE_ERRORS = re.compile(r"^[ \t]*ignore_errors[ \t]*=", re.M)


def _exempt(pyproject: str) -> list[str]:
    """Where ``pyproject`` lets mypy ignore errors: the modules of each override that does (``*``:
    every module, for the global setting)."""
    try:
        import tomllib
    except ModuleNotFoundError:  # Python 3.10: only the text can be read
        return ["?"] * len(_IGNORE_ERRORS.findall(pyproject))
    mypy = tomllib.loads(pyproject).get("tool", {}).get("mypy", {})
    exempt = ["*"] if mypy.get("ignore_errors") else []
    for override in mypy.get("overrides", []):
        if override.get("ignore_errors"):
            modules = override.get("module", [])
            exempt += [modules] if isinstance(modules, str) else modules
    return exempt


def test_no_module_is_exempt_from_mypy() -> None:
    """Fix a module's type errors; do not add an ``ignore_errors`` override for it."""
    text = (REPO / "pyproject.toml").read_text()
    assert "[tool.mypy]" in text, "mypy's configuration is not where this test looks for it"
    exempt = _exempt(text)
    assert not exempt, f"mypy ignores the errors of {exempt}: fix them and drop ignore_errors from pyproject.toml"


@pytest.mark.parametrize(
    "config",
    [
        '[tool.mypy]\nfiles = ["x"]\n\n[[tool.mypy.overrides]]\nmodule = ["x.a", "x.b"]\nignore_errors = true\n',
        '[tool.mypy]\nfiles = ["x"]\n\n[[tool.mypy.overrides]]\nmodule = "x.a"\nignore_errors = true\n',
        '[tool.mypy]\nfiles = ["x"]\nignore_errors = true\n',
    ],
)
def test_the_check_sees_an_exemption(config: str) -> None:
    """The test above can fail: it finds an override (or the global setting) that ignores errors."""
    assert _exempt(config)
