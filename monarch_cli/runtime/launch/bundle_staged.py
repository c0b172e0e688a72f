"""The bundle as a directory of files, for backends that cannot probe a node before it starts.

SkyPilot starts the node's script before the client can ask the node anything (Kubernetes does
not need this: its pods' bootstrap tells the client its platform first), so the client ships the
bundle for every platform a stock image may be: CPython 3.10-3.13 on x86_64 and on aarch64 (Arm
instances such as AWS Graviton) Linux with glibc >= 2.28 (manylinux_2_28, which pyzmq 27 needs;
every current PyTorch image has it), in one directory: the parts' zips (the code part is the
same for all) and an ``INDEX`` with one line per platform, ``cpXY-<machine> code-<hash>
deps-<hash>``. The node's script (:func:`setup_script`, :func:`environment_lines`) asks its
interpreter which line is its own, unzips those two parts with the standard library and runs
the agent from them. Nothing is installed by name, and the node needs no package index.
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
import shlex
import shutil
from pathlib import Path
from typing import Any

from ...config import EnvSettings
from ...errors import SchedulerError
from . import bundle

#: The Pythons a staged bundle carries wheels for (a node's own is picked at start).
PORTABLE_PYTHONS = ((3, 10), (3, 11), (3, 12), (3, 13))
#: The machines and the glibc a staged bundle targets (manylinux_2_28 wheels).
PORTABLE_MACHINES, PORTABLE_GLIBC = ("x86_64", "aarch64"), "2.28"
INDEX = "INDEX"
#: Staged directories the client keeps (the newest); older ones are removed when one is made.
KEEP_STAGED = 3


@dataclasses.dataclass
class Staged:
    """A directory holding every part a node may need, and which Python uses which."""

    directory: Path
    index: list[tuple[str, str, str]]  # (cpXY-<machine>, code part, deps part)
    parts: list[bundle.Part]
    skipped: list[str]  # "cp313-aarch64: no wheel of ..." for platforms left out

    @property
    def size(self) -> int:
        return sum(p.size for p in self.parts)

    @property
    def name(self) -> str:
        return self.directory.name

    def describe(self) -> str:
        pythons = ", ".join(f"{abi} ({code}, {deps})" for abi, code, deps in self.index)
        text = f"bundle {self.name} ({self.size / 1e6:.1f} MB in {len(self.parts)} zips; for {pythons})"
        return text + (f"; left out: {'; '.join(self.skipped)}" if self.skipped else "")

    def to_json(self) -> dict[str, Any]:
        return {
            "directory": str(self.directory),
            "index": [list(i) for i in self.index],
            "parts": [p.to_json() for p in self.parts],
            "bytes": self.size,
            "skipped": self.skipped,
        }


def portable_platform(python: tuple[int, int], machine: str = "x86_64") -> bundle.HostPlatform:
    return bundle.HostPlatform((*python, 0), "cpython", machine, "Linux", "glibc", PORTABLE_GLIBC)  # type: ignore[arg-type]


def stage(
    wheelhouse: str | None = None,
    pythons: tuple[tuple[int, int], ...] = PORTABLE_PYTHONS,
    machines: tuple[str, ...] = PORTABLE_MACHINES,
) -> Staged:
    """Build (or find in the cache) the parts for every Python in ``pythons`` on every one of
    ``machines``, linked into one directory. A platform with no wheel for a dependency is left
    out (and said); none at all is an error."""
    index: list[tuple[str, str, str]] = []
    parts: dict[str, bundle.Part] = {}
    skipped: list[str] = []
    first_error: SchedulerError | None = None
    for machine in machines:
        for python in pythons:
            host = portable_platform(python, machine)
            key = f"{host.abi}-{machine}"
            try:
                built = bundle.build(host, wheelhouse)
            except SchedulerError as e:
                skipped.append(f"{key}: {e}")
                first_error = first_error or e
                continue
            index.append((key, built.code.name, built.deps.name))
            for part in built.parts:
                parts[part.name] = part
    if not index:
        assert first_error is not None
        raise first_error
    text = "".join(f"{abi} {code} {deps}\n" for abi, code, deps in index)
    name = "bundle-" + hashlib.sha256(text.encode()).hexdigest()[:20]
    directory = bundle.cache_dir() / "staged" / name
    if not (directory / INDEX).exists():
        tmp = directory.with_name(f"{name}.{os.getpid()}.tmp")
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        for part in parts.values():
            try:
                os.link(part.path, tmp / part.path.name)
            except OSError:
                shutil.copy2(part.path, tmp / part.path.name)
        (tmp / INDEX).write_text(text)
        try:
            os.rename(tmp, directory)
        except OSError:  # another client process staged the same content first
            shutil.rmtree(tmp, ignore_errors=True)
        _prune(directory.parent)
    return Staged(directory, index, list(parts.values()), skipped)


def _prune(root: Path) -> None:
    staged = sorted(
        (p for p in root.iterdir() if p.is_dir() and "." not in p.name), key=lambda p: p.stat().st_mtime, reverse=True
    )
    for old in staged[KEEP_STAGED:]:
        shutil.rmtree(old, ignore_errors=True)


def _select(python: str, mount: str) -> str:
    """Shell lines that set ``$2 $3`` to this node's code and deps parts (or fail in one line)."""
    which = 'import platform, sys; print("cp%d%d-%s" % (*sys.version_info[:2], platform.machine()))'
    return (
        f'S={mount}; B="$HOME/.monarch-cli/bundles"\n'
        f'V="$({python} -c \'{which}\')" || {{ echo "monarch: --python {python} does not run on '
        'this node" >&2; exit 1; }\n'
        f'set -- $(grep "^$V " "$S/{INDEX}" || true)\n'
        'if [ -z "$3" ]; then echo "monarch: $V on this node: the bundle has wheels for '
        f'$(cut -d" " -f1 "$S/{INDEX}" | tr "\\n" " ")only" >&2; exit 1; fi\n'
    )


def setup_script(python: str, mount: str) -> str:
    """Unzip this node's two parts into a private ``~/.monarch-cli/bundles`` (stdlib; a part it has
    is kept when it holds what its name says, else replaced)."""
    return (
        "set -e\n"
        + _select(python, mount)
        + '(umask 077 && mkdir -p "$B")\n'
        + f'{python} -c {shlex.quote(bundle.UNPACK_SCRIPT)} "$B" {bundle.KEEP_PARTS} "$S/$2.zip" "$S/$3.zip"\n'
    )


def environment_lines(python: str, mount: str) -> str:
    """Export what runs the agent from this node's parts (after :func:`setup_script` ran)."""
    return _select(python, mount) + (
        f'export PYTHONPATH="$B/$2${{PYTHONPATH:+:$PYTHONPATH}}" {EnvSettings.py_spy.var}="$B/$3/bin/py-spy"\n'
    )


__all__ = [
    "Staged",
    "stage",
    "setup_script",
    "environment_lines",
    "PORTABLE_PYTHONS",
    "PORTABLE_MACHINES",
    "portable_platform",
]
