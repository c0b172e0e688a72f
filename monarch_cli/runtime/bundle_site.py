"""Where a shipped bundle's parts sit on a host, seen from inside it (stdlib only, imported early).

A host that got our code from the client (docs/bundle.md) runs with ``PYTHONPATH`` naming only
``bundles/code-<hash>``, which holds the ``monarch_cli`` package and a ``DEPS`` file naming the
sibling ``deps-<hash>`` directory of our dependencies' unpacked wheels. That directory is
*appended* to ``sys.path`` (:func:`add_dependencies`, run when ``monarch_cli`` is imported), so
in every process of ours, the ranks included, the user's own installed packages (torch, and a
pyzmq or psutil the user has) come first and ours only fill what is missing: nothing of the
user's script is shadowed.
"""

from __future__ import annotations

import os
import sys

#: The file beside the ``monarch_cli`` package of a bundle that names its dependencies' directory.
DEPS_FILE = "DEPS"
#: Within a ``deps-<hash>`` directory: the importable tree and the wheels' scripts (py-spy).
SITE_DIR = "site"
BIN_DIR = "bin"


def code_dir() -> str | None:
    """The bundle directory this ``monarch_cli`` was imported from; None for an ordinary install."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    parent = os.path.dirname(root)
    return parent if os.path.isfile(os.path.join(parent, DEPS_FILE)) else None


def deps_dir() -> str | None:
    code = code_dir()
    if code is None:
        return None
    with open(os.path.join(code, DEPS_FILE)) as f:
        name = f.read().strip()
    return os.path.join(os.path.dirname(code), name)


def add_dependencies() -> None:
    """Put the bundle's dependencies at the END of ``sys.path`` (after site-packages), once."""
    deps = deps_dir()
    if deps is None:
        return
    site = os.path.join(deps, SITE_DIR)
    if site not in sys.path:
        sys.path.append(site)


def keep_importable(env: dict[str, str]) -> None:
    """A rank's environment whose ``PYTHONPATH`` the user set still finds this bundle's code."""
    code = code_dir()
    if code is None:
        return
    parts = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    if code not in parts:
        env["PYTHONPATH"] = os.pathsep.join([*parts, code])


__all__ = ["DEPS_FILE", "SITE_DIR", "BIN_DIR", "code_dir", "deps_dir", "add_dependencies", "keep_importable"]
