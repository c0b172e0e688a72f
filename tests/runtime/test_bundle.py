"""The bundle a host gets instead of an install: real wheels, real zips, Debian's own interpreter.

The end-to-end checks (serve on hosts with nothing of ours) are in tests/ssh/test_bare_hosts.py
and tests/skypilot/test_standin_e2e.py; here, what those rest on, without hosts.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import time
from pathlib import Path

import pytest

from monarch_cli.errors import SchedulerError
from monarch_cli.runtime import bundle_site
from monarch_cli.runtime.launch import bundle, bundle_host

DEBIAN_PYTHON = "/usr/bin/python3"  # an interpreter without our packages (no zmq, no psutil)
HERE = bundle.HostPlatform.this_machine()
OTHER = "monarch-planter"  # a second real user (as tests/jobs/test_planted_files.py makes it)


@pytest.fixture
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A client cache of its own, its wheels copied from the machine's real cache (downloaded once)."""
    real = bundle.cache_dir() / "wheels" / HERE.key()
    bundle.wheels_for(HERE)  # fills the real cache from the package index the first time
    monkeypatch.setenv("MONARCH_CACHE_DIR", str(tmp_path / "cache"))
    shutil.copytree(real, tmp_path / "cache" / "wheels" / HERE.key())
    return tmp_path / "cache"


def _unpack(parts: list[bundle.Part], where: Path) -> None:
    where.mkdir(parents=True, exist_ok=True)
    for part in parts:
        shutil.copy(part.path, where / f"{part.name}.x.zip")
    names = [f"{p.name}.x.zip" for p in parts]
    subprocess.run([DEBIAN_PYTHON, "-c", bundle.UNPACK_SCRIPT, str(where), "3", *names], check=True)


def _needs_debian_python() -> None:
    if not os.path.exists(DEBIAN_PYTHON):
        pytest.skip("no /usr/bin/python3")  # every Debian has one; the ssh tests' hosts use it too


def test_a_bundle_runs_the_agent_module_under_an_interpreter_without_our_packages(cache: Path, tmp_path: Path) -> None:
    _needs_debian_python()
    missing = subprocess.run([DEBIAN_PYTHON, "-c", "import zmq"], capture_output=True, text=True)
    assert "No module named 'zmq'" in missing.stderr
    built = bundle.build(HERE)
    where = tmp_path / "host" / "bundles"
    _unpack(built.parts, where)
    assert sorted(os.listdir(where)) == sorted([built.code.name, built.deps.name])  # the uploaded zips are gone
    spy = where / built.deps.name / "bin" / "py-spy"
    assert os.access(spy, os.X_OK)  # the zip's file mode came through the stdlib unpacker
    probe = (
        "import sys, monarch_cli.runtime.agent, monarch_cli.runtime.rank.start, zmq, psutil, cloudpickle; "
        "print(zmq.__file__); print(sys.path.index(next(p for p in sys.path if 'dist-packages' in p)) "
        "< sys.path.index(next(p for p in sys.path if p.endswith('/site'))))"
    )
    env = {"PATH": os.environ["PATH"], "PYTHONPATH": str(where / built.code.name)}
    proc = subprocess.run([DEBIAN_PYTHON, "-c", probe], capture_output=True, text=True, env=env, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    zmq_file, ours_last = proc.stdout.split()
    assert zmq_file.startswith(str(where / built.deps.name / "site")) and ours_last == "True"


def test_the_users_own_copy_of_a_package_wins_over_ours(cache: Path, tmp_path: Path) -> None:
    """Ours are appended after site-packages: a package the interpreter has is the one imported."""
    _needs_debian_python()
    built = bundle.build(HERE)
    where = tmp_path / "bundles"
    _unpack(built.parts, where)
    venv = tmp_path / "venv"
    subprocess.run([DEBIAN_PYTHON, "-m", "venv", "--without-pip", str(venv)], check=True)
    site = next((venv / "lib").glob("python3.*/site-packages"))
    (site / "cloudpickle").mkdir()
    (site / "cloudpickle" / "__init__.py").write_text("WHOSE = 'the user'\n")
    env = {"PATH": os.environ["PATH"], "PYTHONPATH": str(where / built.code.name)}
    code = "import monarch_cli, cloudpickle, psutil; print(cloudpickle.WHOSE, psutil.__file__)"
    python = str(venv / "bin" / "python")
    proc = subprocess.run([python, "-c", code], capture_output=True, text=True, env=env, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    whose, psutil_file = proc.stdout.rsplit(" ", 1)
    assert whose == "the user" and psutil_file.startswith(str(where / built.deps.name))  # ours fill the gap


def test_parts_are_addressed_by_content_and_an_edit_ships_only_new_code(
    cache: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    first = bundle.build(HERE)
    again = bundle.build(HERE)
    assert (again.code.name, again.deps.name) == (first.code.name, first.deps.name)
    assert first.missing([first.code.name, first.deps.name]) == []
    files = bundle._code_files()
    edited = [(name, path) for name, path in files]
    extra = tmp_path / "edit.py"
    extra.write_text("# a local edit\n")
    monkeypatch.setattr(bundle, "_code_files", lambda: [*edited, ("monarch_cli/edit.py", extra)])
    changed = bundle.build(HERE)
    assert changed.deps.name == first.deps.name and changed.code.name != first.code.name
    assert [p.name for p in changed.missing([first.code.name, first.deps.name])] == [changed.code.name]


def test_a_wheelhouse_without_a_package_for_the_host_is_one_line_naming_it(cache: Path, tmp_path: Path) -> None:
    house = tmp_path / "house"
    shutil.copytree(cache / "wheels" / HERE.key(), house)
    for wheel in house.glob("pyzmq-*.whl"):
        wheel.unlink()
    with pytest.raises(SchedulerError, match=r"^--wheelhouse .* has no wheel of pyzmq for Linux x86_64") as e:
        bundle.wheels_for(HERE, str(house))
    assert "\n" not in str(e.value)
    assert set(bundle.wheels_for(HERE, str(cache / "wheels" / HERE.key()))) == set(bundle.RUNTIME_DEPENDENCIES)


@pytest.mark.parametrize(
    ("wheel", "python", "glibc", "ok"),
    [
        ("pyzmq-27.3.0-cp311-cp311-manylinux_2_26_x86_64.manylinux_2_28_x86_64.whl", (3, 11), "2.36", True),
        ("pyzmq-27.3.0-cp311-cp311-manylinux_2_26_x86_64.manylinux_2_28_x86_64.whl", (3, 12), "2.36", False),
        ("pyzmq-27.3.0-cp311-cp311-manylinux_2_26_x86_64.manylinux_2_28_x86_64.whl", (3, 11), "2.17", False),
        ("psutil-7.2.2-cp36-abi3-manylinux2010_x86_64.manylinux_2_12_x86_64.whl", (3, 13), "2.17", True),
        ("py_spy-0.4.3-py2.py3-none-manylinux1_x86_64.manylinux_2_5_x86_64.whl", (3, 10), "2.17", True),
        ("cloudpickle-3.1.3-py3-none-any.whl", (3, 12), "2.28", True),
        ("debugpy-1.8.22-cp311-cp311-macosx_11_0_universal2.whl", (3, 11), "2.36", False),
    ],
)
def test_wheel_tags_match_the_hosts_python_and_glibc(wheel: str, python: tuple[int, int], glibc: str, ok: bool) -> None:
    host = bundle.HostPlatform((*python, 0), "cpython", "x86_64", "Linux", "glibc", glibc)  # type: ignore[arg-type]
    assert bundle._compatible(wheel, host) is ok


def test_interpreters_we_cannot_run_on_are_one_line() -> None:
    old = bundle.HostPlatform((3, 8, 10), "cpython", "x86_64", "Linux", "glibc", "2.31")
    with pytest.raises(SchedulerError, match=r"^the interpreter is Python 3\.8\.10; at least 3\.10 is needed"):
        old.check()
    musl = bundle.HostPlatform((3, 11, 0), "cpython", "x86_64", "Linux", "musl", "1.2")
    with pytest.raises(SchedulerError, match="only glibc Linux hosts are supported, not musl"):
        musl.platforms()


def test_the_probe_answers_on_any_python3(tmp_path: Path) -> None:
    _needs_debian_python()
    (tmp_path / "code-0123").mkdir()
    (tmp_path / "deps-4567.tmp99").mkdir()  # half unpacked: not held
    out = subprocess.run([DEBIAN_PYTHON, "-c", bundle.PROBE_SCRIPT, str(tmp_path)], capture_output=True, text=True)
    data = bundle.parse_probe(out.stdout)
    assert data is not None and data["held"] == ["code-0123"]
    assert bundle.HostPlatform.from_probe(data).libc == "glibc"


def test_a_rank_whose_pythonpath_the_user_set_still_finds_shipped_code(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(bundle_site, "code_dir", lambda: "/r/bundles/code-1")
    env = {"PYTHONPATH": "/user/src"}
    bundle_site.keep_importable(env)
    assert env["PYTHONPATH"] == "/user/src:/r/bundles/code-1"
    bundle_site.keep_importable(env)
    assert env["PYTHONPATH"] == "/user/src:/r/bundles/code-1"


def _unpack_args(where: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [DEBIAN_PYTHON, "-c", bundle.UNPACK_SCRIPT, str(where), "3", *args], capture_output=True, text=True
    )


def test_a_part_that_does_not_hold_what_its_name_says_is_removed_and_shipped_again(cache: Path, tmp_path: Path) -> None:
    _needs_debian_python()
    built = bundle.build(HERE)
    where = tmp_path / "bundles"
    _unpack(built.parts, where)
    init = where / built.code.name / "monarch_cli" / "__init__.py"
    init.write_text(init.read_text() + "\nPLANTED = True\n")  # an edit after it was unpacked
    # checked where it is before use: removed, and named for the client to send again
    done = _unpack_args(where, built.code.name, built.deps.name)
    assert done.returncode == bundle_host.MISSING_STATUS, done.stderr
    assert bundle_host.failed_parts(done.stdout) == [built.code.name]
    assert not (where / built.code.name).exists() and (where / built.deps.name).is_dir()
    # a zip whose content is not what its name says is refused, and nothing is left of it
    shutil.copy(built.deps.path, where / f"{built.code.name}.bad.zip")
    done = _unpack_args(where, f"{built.code.name}.bad.zip", built.deps.name)
    assert done.returncode not in (0, bundle_host.MISSING_STATUS)
    assert "does not hold what its name says" in done.stderr and not (where / built.code.name).exists()
    shutil.copy(built.code.path, where / f"{built.code.name}.good.zip")
    assert _unpack_args(where, f"{built.code.name}.good.zip", built.deps.name).returncode == 0
    assert "PLANTED" not in init.read_text()


def test_an_interrupted_uploads_leftovers_are_removed_by_the_next_upload(cache: Path, tmp_path: Path) -> None:
    _needs_debian_python()
    built = bundle.build(HERE)
    where = tmp_path / "bundles"
    where.mkdir()
    half_sent = where / f"{built.code.name}.1a2b3c4d.zip"  # a serve killed while uploading
    half_sent.write_bytes(built.code.path.read_bytes()[:4096])
    half_unpacked = where / f"{built.deps.name}.tmp4242"  # a serve killed while its host unzipped
    (half_unpacked / "site").mkdir(parents=True)
    (half_unpacked / "site" / "half.py").write_text("")
    hour_ago = time.time() - 3600
    for p in (half_sent, half_unpacked):
        os.utime(p, (hour_ago, hour_ago))
    in_flight = where / f"{built.code.name}.5e6f7a8b.zip"  # another serve's upload, going on now: kept
    in_flight.write_bytes(b"PK")
    _unpack(built.parts, where)
    assert sorted(os.listdir(where)) == sorted([built.code.name, built.deps.name, in_flight.name])


@pytest.fixture
def other_user() -> str:
    if os.geteuid() != 0:
        pytest.skip("acting as another user needs root")
    if subprocess.run(["id", "-u", OTHER], capture_output=True).returncode != 0:
        subprocess.run(["useradd", "--system", "--no-create-home", "--shell", "/usr/sbin/nologin", OTHER], check=True)
    return OTHER


def _probe(bundles: Path) -> dict:
    out = subprocess.run([DEBIAN_PYTHON, "-c", bundle.PROBE_SCRIPT, str(bundles)], capture_output=True, text=True)
    data = bundle.parse_probe(out.stdout)
    assert data is not None, out.stderr
    return data


def test_the_probe_makes_the_remote_dir_private_and_refuses_one_others_made_or_can_change(
    other_user: str, tmp_path: Path
) -> None:
    _needs_debian_python()
    tmp_path.chmod(0o755)
    for parent in tmp_path.parents:  # pytest's base temp dirs are 0700: the other user must reach in
        if parent in (Path("/tmp"), Path("/")):
            break
        parent.chmod(parent.stat().st_mode | 0o755)
    shared = tmp_path / "shared"  # like /tmp: everyone writes, sticky
    shared.mkdir()
    shared.chmod(0o1777)
    as_other = ["runuser", "-u", other_user, "--", "mkdir", "-m", "777"]
    subprocess.run([*as_other, str(shared / "theirs"), str(shared / "theirs" / "bundles")], check=True)
    data = _probe(shared / "theirs" / "bundles")  # --remote-dir the other user made first
    assert data["unsafe"].startswith(f"refusing {shared / 'theirs'}: {OTHER}"), data["unsafe"]
    assert data["held"] == [] and "\n" not in data["unsafe"]
    data = _probe(shared / "theirs" / "mine" / "bundles")  # below a directory they can swap
    assert data["unsafe"].startswith(f"refusing {shared / 'theirs'}: {OTHER}"), data["unsafe"]
    (shared / "open").mkdir()
    (shared / "open").chmod(0o775)
    data = _probe(shared / "open" / "bundles")
    assert data["unsafe"].startswith(f"refusing {shared / 'open'}: others can write it (mode 775)"), data["unsafe"]
    subprocess.run([*as_other, str(shared / "bundles")], check=True)  # shared as /tmp is: our part of it is not
    data = _probe(shared / "bundles")
    assert data["unsafe"].startswith(f"refusing {shared / 'bundles'}: it was made by {OTHER}"), data["unsafe"]
    data = _probe(shared / "new" / "deep" / "bundles")
    assert data["unsafe"] == ""
    for d in (shared / "new", shared / "new" / "deep", shared / "new" / "deep" / "bundles"):
        assert d.stat().st_mode & 0o777 == 0o700 and d.stat().st_uid == os.geteuid(), d
    (tmp_path / "sticky").mkdir(mode=0o1777)  # a sticky remote dir (a tmpfs mounted there) is shared as /tmp is
    (tmp_path / "sticky").chmod(0o1777)
    assert _probe(tmp_path / "sticky" / "bundles")["unsafe"] == ""
