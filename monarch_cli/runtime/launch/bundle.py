"""The zero-install bundle: this client's own code and its runtime dependencies, for one host.

Hosts need nothing of ours (docs/bundle.md): the client probes a host's interpreter (Python
version, implementation, machine, libc) in the same round trip that lists the bundle parts the
host already holds, then builds, once per content, two content-addressed zips:

- ``deps-<hash>``: the agent's and ranks' third-party dependencies as wheels for the host's
  platform and Python, from ``--wheelhouse DIR`` or a client-side cache filled once from the
  client's package index (``pip download --only-binary=:all: --platform ... --python-version
  ...``), unzipped into ``site/`` (scripts such as py-spy into ``bin/``);
- ``code-<hash>``: the ``monarch_cli`` package exactly as it is on disk (edited or not) and a
  ``DEPS`` file naming its dependencies' part.

Each part is named by the hash of the files it unpacks to, and unpacked by a stdlib-only script
(:data:`UNPACK_SCRIPT`; wheels are zips, no pip on the host) into ``<remote-dir>/bundles/``,
which checks every part against its name before it is used (:mod:`.bundle_host`); a host that
holds a part already gets nothing, and the oldest parts beyond a few are pruned. paramiko, typer
and rich are client-only.
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
import re
import subprocess
import sys
import threading
import zipfile
from pathlib import Path
from typing import Any

from ...errors import SchedulerError
from ...sysutil import atomic_write
from ...sysutil import cache_dir as _cache_dir
from .. import bundle_site
from .bundle_host import FORMAT, PROBE_SCRIPT, UNPACK_SCRIPT, parse_probe, probe_command, tree_digest

#: The oldest Python the agent and ranks run on (pyproject's requires-python).
MIN_PYTHON = (3, 10)
#: Distributions the agent and ranks import (cli, paramiko, typer and rich stay on the client).
RUNTIME_DEPENDENCIES = (
    "pyzmq",
    "cloudpickle",
    "psutil",
    "setproctitle",
    "debugpy",
    "pathspec",
    "py-spy",
    "nvidia-ml-py",
)
#: Parts of each kind a host keeps (the newest by use); older ones are removed when a part is shipped.
KEEP_PARTS = 3


@dataclasses.dataclass(frozen=True)
class HostPlatform:
    """A host's interpreter as the probe saw it."""

    python: tuple[int, int, int]
    implementation: str
    machine: str
    system: str
    libc: str
    libc_version: str

    @classmethod
    def from_probe(cls, data: dict[str, Any]) -> HostPlatform:
        return cls(
            tuple(data["python"][:3]),  # type: ignore[arg-type]
            str(data["implementation"]),
            str(data["machine"]),
            str(data["system"]),
            str(data.get("libc") or ""),
            str(data.get("libc_version") or ""),
        )

    @classmethod
    def this_machine(cls) -> HostPlatform:
        import platform

        libc, version = platform.libc_ver()
        return cls(
            tuple(sys.version_info[:3]),  # type: ignore[arg-type]
            sys.implementation.name,
            platform.machine(),
            platform.system(),
            libc,
            version,
        )

    @property
    def abi(self) -> str:
        return f"cp{self.python[0]}{self.python[1]}"

    def describe(self) -> str:
        libc = f", {self.libc} {self.libc_version}" if self.libc else ""
        return f"{self.system} {self.machine}{libc}, {self.implementation} {'.'.join(map(str, self.python))}"

    def key(self) -> str:
        """The wheel cache's directory for this platform."""
        return f"{self.abi}-{self.platforms()[0]}"

    def platforms(self) -> list[str]:
        """Wheel platform tags this host runs, most specific first (what pip's ``--platform`` takes)."""
        arch = self.machine
        if self.system != "Linux":
            raise SchedulerError(f"hosts running {self.system} are not supported (Linux only)")
        if self.libc != "glibc":
            raise SchedulerError(f"only glibc Linux hosts are supported, not {self.libc or 'an unknown libc'}")
        major, _, minor = self.libc_version.partition(".")
        try:
            top = int(minor.split(".")[0]) if major == "2" else 17
        except ValueError:
            top = 17
        tags = [f"manylinux_2_{m}_{arch}" for m in range(top, 4, -1)]
        legacy = {17: "manylinux2014", 12: "manylinux2010", 5: "manylinux1"}
        return tags + [f"{name}_{arch}" for m, name in legacy.items() if m <= top]

    def check(self) -> None:
        """A one-line error for an interpreter we cannot run on."""
        if self.implementation != "cpython":
            raise SchedulerError(f"the interpreter is {self.implementation}; only CPython is supported")
        if self.python[:2] < MIN_PYTHON:
            raise SchedulerError(
                f"the interpreter is Python {'.'.join(map(str, self.python))}; at least "
                f"{'.'.join(map(str, MIN_PYTHON))} is needed (pass --python)"
            )


@dataclasses.dataclass
class Part:
    """One content-addressed zip: ``code-<hash>`` or ``deps-<hash>``."""

    name: str
    path: Path  # the zip, in the client's cache
    size: int
    contents: list[str]  # what it holds, for plans and messages

    @property
    def unpacked(self) -> int:
        """Bytes its files take once unzipped (what a host needs besides the zip itself)."""
        with zipfile.ZipFile(self.path) as z:
            return sum(i.file_size for i in z.infolist())

    def to_json(self) -> dict[str, Any]:
        return {"name": self.name, "size": self.size, "contents": self.contents}


@dataclasses.dataclass
class Bundle:
    code: Part
    deps: Part

    @property
    def parts(self) -> list[Part]:
        return [self.deps, self.code]

    def missing(self, held: list[str]) -> list[Part]:
        return [p for p in self.parts if p.name not in held]


def cache_dir() -> Path:
    return Path(_cache_dir())


def installed_versions() -> dict[str, str | None]:
    """The client's own version of each dependency: the host gets the same where a wheel exists."""
    from importlib import metadata

    out: dict[str, str | None] = {}
    for name in RUNTIME_DEPENDENCIES:
        try:
            out[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            out[name] = None
    return out


def _norm(name: str) -> str:
    return re.sub(r"[-_.]+", "_", name).lower()


def _wheel_tags(filename: str) -> tuple[str, str, set[str], set[str], set[str]] | None:
    """``(name, version, pythons, abis, platforms)`` of a wheel's file name."""
    parts = filename[: -len(".whl")].split("-")
    if not filename.endswith(".whl") or len(parts) not in (5, 6):
        return None
    return _norm(parts[0]), parts[1], set(parts[-3].split(".")), set(parts[-2].split(".")), set(parts[-1].split("."))


def _compatible(filename: str, host: HostPlatform) -> bool:
    tags = _wheel_tags(filename)
    if tags is None:
        return False
    _, _, pythons, abis, platforms = tags
    major, minor = host.python[0], host.python[1]
    if not (platforms & {"any", *host.platforms()}):
        return False
    if "abi3" in abis:
        return any(p.startswith(f"cp{major}") and int(p[3:] or 0) <= minor for p in pythons if p[3:].isdigit())
    if abis & {host.abi}:
        return host.abi in pythons
    return "none" in abis and bool(pythons & {f"py{major}", f"py{major}{minor}", host.abi})


def select_wheels(directory: Path, host: HostPlatform, versions: dict[str, str | None]) -> dict[str, Path]:
    """The wheel of each dependency in ``directory`` for ``host``, the client's version preferred."""
    found: dict[str, Path] = {}
    if not directory.is_dir():
        return found
    wanted = {_norm(n): n for n in versions}
    for path in sorted(directory.glob("*.whl")):
        tags = _wheel_tags(path.name)
        if tags is None or tags[0] not in wanted or not _compatible(path.name, host):
            continue
        name = wanted[tags[0]]
        have = found.get(name)
        if have is None or tags[1] == versions[name]:
            found[name] = path
    return found


_download_lock = threading.Lock()


def wheels_for(host: HostPlatform, wheelhouse: str | None = None) -> dict[str, Path]:
    """A wheel of every runtime dependency for ``host``: from ``wheelhouse``, else the cache, which
    the client's package index fills once. A one-line error names a package without one."""
    versions = installed_versions()
    if wheelhouse:
        found = select_wheels(Path(wheelhouse).expanduser(), host, versions)
        missing = [n for n in versions if n not in found]
        if missing:
            raise SchedulerError(
                f"--wheelhouse {wheelhouse} has no wheel of {', '.join(missing)} for {host.describe()} "
                f"(platform {host.platforms()[0]}, {host.abi})"
            )
        return found
    cache = cache_dir() / "wheels" / host.key()
    with _download_lock:
        found = select_wheels(cache, host, versions)
        missing = [n for n in versions if n not in found]
        if missing:
            _download(missing, versions, host, cache)
            found = select_wheels(cache, host, versions)
    missing = [n for n in versions if n not in found]
    if missing:
        raise SchedulerError(f"no wheel of {', '.join(missing)} for {host.describe()} (platform {host.platforms()[0]})")
    return found


def _download(names: list[str], versions: dict[str, str | None], host: HostPlatform, cache: Path) -> None:
    cache.mkdir(parents=True, exist_ok=True)
    specs = [f"{n}=={versions[n]}" if versions[n] else n for n in names]
    cmd = [sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "--only-binary=:all:"]
    for tag in host.platforms():
        cmd += ["--platform", tag]
    cmd += ["--python-version", f"{host.python[0]}.{host.python[1]}", "--implementation", "cp"]
    cmd += ["--dest", str(cache), *specs]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        bad = re.search(r"No matching distribution found for (\S+)", proc.stderr)
        what = bad.group(1) if bad else ", ".join(specs)
        last = (proc.stderr.strip().splitlines() or ["pip failed"])[-1]
        raise SchedulerError(
            f"no wheel of {what} for {host.describe()} (platform {host.platforms()[0]}) from this client's "
            f"package index ({last.removeprefix('ERROR: ')}); give one with --wheelhouse DIR"
        )


def _code_files() -> list[tuple[str, Path]]:
    """``monarch_cli``'s files as they are on disk: ``(name in the zip, path)``."""
    package = Path(__file__).resolve().parents[2]  # monarch_cli/ (this is monarch_cli/runtime/launch/bundle.py)
    files = []
    for path in sorted(package.rglob("*")):
        if path.is_dir() or "__pycache__" in path.parts or path.suffix in (".pyc", ".pyo"):
            continue
        files.append((f"monarch_cli/{path.relative_to(package).as_posix()}", path))
    return files


def _digest(items: list[tuple[str, bytes]]) -> str:
    """The content hash of files ``(path, data)``: what a part holding them is named by."""
    return tree_digest({name: hashlib.sha256(data).digest() for name, data in items})


def _write_zip(target: Path, fill: Any) -> Path:
    """``fill`` a zip beside ``target``; the temporary file, for the caller to rename."""
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.with_name(f"{target.name}.{os.getpid()}.{threading.get_ident()}.tmp")
    with zipfile.ZipFile(tmp, "w", zipfile.ZIP_DEFLATED, compresslevel=6) as z:
        fill(z)
    return tmp


def _deps_part(wheels: dict[str, Path]) -> Part:
    """The wheels unzipped as a host will have them. The part is named by what it unpacks to (the
    host checks that), found again by the wheels' own hash without unzipping them (``wheels-*``)."""
    items = [(p.name, p.read_bytes()) for p in sorted(wheels.values())]
    index = cache_dir() / "bundles" / f"wheels-{_digest(items)}"
    try:
        target = index.parent / f"{index.read_text().strip()}.zip"
    except OSError:
        target = index.parent / "none"
    if not target.name.startswith("deps-") or not target.exists():
        target = _build_deps(items, index.parent)
        atomic_write(index, target.name.removesuffix(".zip") + "\n")
    return Part(target.stem, target, target.stat().st_size, [p.name for p in sorted(wheels.values())])


def _build_deps(items: list[tuple[str, bytes]], where: Path) -> Path:
    import io

    files: dict[str, bytes] = {}  # path -> sha256 of what ends up there (a later wheel's copy wins, as in unzip)

    def fill(z: zipfile.ZipFile) -> None:
        for _, data in items:
            with zipfile.ZipFile(io.BytesIO(data)) as wheel:
                for info in wheel.infolist():
                    where = _wheel_member(info.filename)
                    if where is None or info.is_dir():
                        continue
                    copy = zipfile.ZipInfo(where, info.date_time)
                    copy.external_attr = info.external_attr
                    if where.startswith(bundle_site.BIN_DIR + "/"):
                        copy.external_attr = (0o100755 << 16) | (info.external_attr & 0xFFFF)
                    copy.compress_type = zipfile.ZIP_DEFLATED
                    content = wheel.read(info)
                    files[where] = hashlib.sha256(content).digest()
                    z.writestr(copy, content)

    tmp = _write_zip(where / "deps.zip", fill)
    target = where / f"deps-{tree_digest(files)}.zip"
    os.replace(tmp, target)
    return target


def _wheel_member(name: str) -> str | None:
    """Where a wheel's member goes in a deps part: the importable tree, or ``bin/`` for scripts
    (never a ``__pycache__``: a host's check leaves Python's caches out)."""
    head, _, rest = name.partition("/")
    if "__pycache__" in name.split("/"):
        return None
    if head.endswith(".data"):
        kind, _, inner = rest.partition("/")
        if kind == "scripts" and inner:
            return f"{bundle_site.BIN_DIR}/{inner}"
        if kind in ("purelib", "platlib") and inner:
            return f"{bundle_site.SITE_DIR}/{inner}"
        return None  # headers, data: nothing the runtime uses
    return f"{bundle_site.SITE_DIR}/{name}"


def _code_part(deps: Part) -> Part:
    files = _code_files()
    items = [(name, path.read_bytes()) for name, path in files]
    items.append((bundle_site.DEPS_FILE, deps.name.encode() + b"\n"))
    name = f"code-{_digest(items)}"
    target = cache_dir() / "bundles" / f"{name}.zip"

    def fill(z: zipfile.ZipFile) -> None:
        for item, data in items:
            info = zipfile.ZipInfo(item, (2020, 1, 1, 0, 0, 0))
            info.external_attr = 0o100644 << 16
            info.compress_type = zipfile.ZIP_DEFLATED
            z.writestr(info, data)

    if not target.exists():
        os.replace(_write_zip(target, fill), target)
    size = sum(len(d) for _, d in items)
    return Part(name, target, target.stat().st_size, [f"monarch_cli ({len(files)} files, {size / 1e6:.1f} MB)"])


def build(host: HostPlatform, wheelhouse: str | None = None) -> Bundle:
    """The bundle for ``host`` (its parts cached on the client by content)."""
    host.check()
    deps = _deps_part(wheels_for(host, wheelhouse))
    return Bundle(_code_part(deps), deps)


def code_summary() -> dict[str, Any]:
    """What a plan shows before any host is probed: the code's hash and the dependencies' versions."""
    files = _code_files()
    items = [(name, path.read_bytes()) for name, path in files]
    size = sum(len(d) for _, d in items)
    return {
        "code_hash": _digest(items),
        "files": len(files),
        "bytes": size,
        "dependencies": {n: v for n, v in installed_versions().items()},
    }


def plan_lines(python: str, bundles: str, wheelhouse: str | None) -> list[str]:
    """The plan's words for shipping (the same on every backend)."""
    s = code_summary()
    deps = ", ".join(f"{n}=={v}" if v else n for n, v in s["dependencies"].items())
    source = f"--wheelhouse {wheelhouse}" if wheelhouse else f"this client's package index, cached in {cache_dir()}"
    return [
        f"probe {python}: Python >= {'.'.join(map(str, MIN_PYTHON))}, platform, and the bundle parts under {bundles}",
        f"ship what the host lacks: code-<hash> (monarch_cli as on this disk: {s['files']} files, "
        f"{s['bytes'] / 1e6:.1f} MB, content {s['code_hash']}) and deps-<hash> (wheels for the host's "
        f"platform and Python from {source}: {deps}); unzipped there with the standard library, "
        f"outside the interpreter's site-packages; nothing is installed by name",
    ]


def unpack_command(python: str, bundles_shell: str, args: list[str]) -> str:
    """Unpack the uploaded zips in ``args`` and check the held parts named bare there."""
    from .bundle_host import unpack_command as command

    return command(python, bundles_shell, KEEP_PARTS, args)


__all__ = [
    "FORMAT",
    "MIN_PYTHON",
    "RUNTIME_DEPENDENCIES",
    "PROBE_SCRIPT",
    "UNPACK_SCRIPT",
    "HostPlatform",
    "Bundle",
    "Part",
    "build",
    "code_summary",
    "plan_lines",
    "probe_command",
    "unpack_command",
    "parse_probe",
    "select_wheels",
    "wheels_for",
]
