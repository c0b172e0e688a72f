"""Files another user planted where we read back our own (scan cache, mirror manifest, telemetry store).

A real second Unix user (made here with ``useradd``) writes them into a directory both can
write (sticky, like ``/tmp``). Nothing we read back from disk may run code, and a file or
directory we did not make, or that others can write, is refused with one line.
"""

from __future__ import annotations

import os
import pickle
import subprocess
import time
from pathlib import Path

import pytest

from monarch_cli.runtime.workspace import Mirror, Scanner, WorkspaceError, load_scanner, save_scanner
from monarch_cli.telemetry import StoreError, TelemetryWriter, connect_readonly

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="acting as another user needs root")

OTHER = "monarch-planter"
SYSTEM_PYTHON = "/usr/bin/python3"  # the other user cannot reach our interpreter under /root

# Run as the other user: write a pickle that, loaded with pickle.load, creates the marker file.
PLANT = """
import os, pickle, sys
class Boom:
    def __reduce__(self):
        return (os.system, (f"touch {sys.argv[2]}",))
os.makedirs(os.path.dirname(sys.argv[1]), exist_ok=True)
with open(sys.argv[1], "wb") as f:
    pickle.dump(Boom(), f)
os.chmod(sys.argv[1], 0o644)
"""


@pytest.fixture(scope="module")
def other_user() -> str:
    if subprocess.run(["id", "-u", OTHER], capture_output=True).returncode != 0:
        subprocess.run(["useradd", "--system", "--no-create-home", "--shell", "/usr/sbin/nologin", OTHER], check=True)
    return OTHER


@pytest.fixture
def shared(tmp_path: Path) -> Path:
    """A directory every user may write, like /tmp (sticky), reachable by the other user."""
    tmp_path.chmod(0o755)
    for parent in tmp_path.parents:  # pytest's base temp dirs are 0700
        if parent == Path("/tmp") or parent == Path("/"):
            break
        parent.chmod(parent.stat().st_mode | 0o755)
    d = tmp_path / "shared"
    d.mkdir()
    d.chmod(0o1777)
    return d


def _plant(user: str, path: Path, marker: Path) -> None:
    subprocess.run(["runuser", "-u", user, "--", SYSTEM_PYTHON, "-I", "-c", PLANT, str(path), str(marker)], check=True)
    assert path.stat().st_uid != os.geteuid()


def test_a_planted_scan_cache_runs_nothing_and_is_refused(other_user: str, shared: Path, tmp_path: Path) -> None:
    ws = tmp_path / "ws"
    ws.mkdir()
    (ws / "a.py").write_text("x = 1\n")
    marker = shared / "ran"
    cache = shared / ".monarch" / "sync" / "ws-1234.pkl"  # a predictable name in a state dir under a shared folder
    _plant(other_user, cache, marker)
    with pytest.raises(WorkspaceError) as e:
        load_scanner(cache, str(ws))
    assert not marker.exists(), "the planted cache ran code"
    assert "refusing" in str(e.value) and OTHER in str(e.value) and "\n" not in str(e.value)


def test_our_scan_cache_is_plain_data_and_a_writable_one_is_refused(tmp_path: Path) -> None:
    ws = tmp_path / "ws"
    (ws / "pkg").mkdir(parents=True)
    (ws / "pkg" / "a.py").write_text("x = 1\n")
    cache = tmp_path / ".monarch" / "sync" / "ws.pkl"
    scanner = Scanner(str(ws))
    scan, d = scanner.manifest_and_digest()
    scanner.sha256("pkg/a.py", scan.manifest["pkg/a.py"])
    save_scanner(scanner, cache)
    assert cache.stat().st_mode & 0o777 == 0o600
    again = load_scanner(cache, str(ws))
    assert again.manifest_and_digest() == (scan, d) and again.hashes == scanner.hashes
    # A pickle naming any class is not read, even one of ours: only builtins come back.
    cache.write_bytes(pickle.dumps(scanner))
    assert load_scanner(cache, str(ws)).entries == {}
    cache.chmod(0o666)
    with pytest.raises(WorkspaceError, match="other users can write it"):
        load_scanner(cache, str(ws))


def test_a_planted_mirror_manifest_runs_nothing_and_is_refused(other_user: str, shared: Path) -> None:
    remote = shared / "remote"  # MONARCH_REMOTE_DIR in a shared folder
    remote.mkdir()
    remote.chmod(0o1777)
    mirror = remote / "local-abc" / "workspace" / "proj-1234"
    marker = shared / "ran"
    _plant(other_user, Path(str(mirror) + ".manifest"), marker)
    with pytest.raises(WorkspaceError) as e:
        Mirror(str(mirror), str(remote))
    assert not marker.exists(), "the planted manifest ran code"
    assert "refusing" in str(e.value) and OTHER in str(e.value)


def test_a_mirror_is_made_private_and_its_manifest_is_plain_data(tmp_path: Path) -> None:
    remote = tmp_path / "remote"
    mirror = Mirror(str(remote / "local-abc" / "workspace" / "proj-1"), str(remote))
    from monarch_cli.runtime.workspace import FileUpdate

    mirror.apply([FileUpdate("a.py", (2, time.time_ns(), 0o644, ""), "sha", b"x\n")], [])
    for d in (remote / "local-abc", remote / "local-abc" / "workspace", remote / "local-abc" / "workspace" / "proj-1"):
        assert d.stat().st_mode & 0o077 == 0, d
    again = Mirror(mirror.dir, str(remote))
    assert again.files == mirror.files and again.digest == mirror.digest


def test_a_telemetry_store_made_by_another_user_is_not_written(other_user: str, shared: Path) -> None:
    state_dir = shared / ".monarch"
    state_dir.mkdir()
    state_dir.chmod(0o777)
    db = state_dir / "telemetry.db"
    subprocess.run(
        ["runuser", "-u", other_user, "--", SYSTEM_PYTHON, "-I", "-c",
         "import os, sqlite3, sys; sqlite3.connect(sys.argv[1]).close(); os.chmod(sys.argv[1], 0o666)", str(db)],
        check=True,
    )  # fmt: skip
    before = db.read_bytes()
    writer = TelemetryWriter(db, "run-1", start=True)
    writer.output(0, 1, b"secret rank output\n")
    writer.close()
    assert writer.error is not None and "refusing" in writer.error and OTHER in writer.error
    assert db.read_bytes() == before and b"secret" not in db.read_bytes()
    with pytest.raises(StoreError, match="refusing"):
        connect_readonly(db)


def _state_file(path: Path) -> Path:
    from monarch_cli.jobs.state import HostRecord, JobState, save_state
    from monarch_cli.runtime.transport.keys import Keys

    hosts = [HostRecord(name="h0", agent="tcp://127.0.0.1:9", pid=None, node_rank=0)]
    return save_state(JobState("local", "local-planted", hosts, Keys.generate().encode(), [], time.time()), path)


@pytest.mark.parametrize("how", ["owned by the other user", "writable by others"])
def test_a_job_state_file_another_user_made_or_can_write_is_refused(other_user: str, shared: Path, how: str) -> None:
    """A state file names the agents whose replies the client unpickles and holds the keys: one
    another user owns (found through a Slurm job's work directory, a shared --state path) or can
    write is refused with one line, before any agent is asked anything."""
    import sys

    path = _state_file(shared / "planted" / ".monarch" / "job_state.pkl")
    if how == "owned by the other user":
        import pwd

        entry = pwd.getpwnam(other_user)
        os.chown(path, entry.pw_uid, entry.pw_gid)
    else:
        path.chmod(0o666)
    done = subprocess.run(
        [sys.executable, "-m", "monarch_cli", "status", "--state", str(path)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode != 0 and "Traceback" not in done.stderr, done.stderr
    assert f"refusing job state file {path}" in done.stderr, done.stderr
    assert len(done.stderr.strip().splitlines()) == 1, done.stderr


def test_an_internal_errors_traceback_is_not_written_where_another_user_can_read_it(
    other_user: str, shared: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The traceback of a bug may quote paths and arguments: it goes to /tmp/monarch-<uid>/errors,
    which another user may have made first (a name anyone can take): then it is not saved there."""
    import pwd

    from monarch_cli.cli import console

    monkeypatch.setenv("TMPDIR", str(shared))
    import tempfile

    monkeypatch.setattr(tempfile, "tempdir", None)  # (read $TMPDIR again)
    planted = shared / f"monarch-{os.getuid()}" / "errors"
    planted.mkdir(parents=True, mode=0o777)
    entry = pwd.getpwnam(other_user)
    for d in (planted.parent, planted):
        os.chown(d, entry.pw_uid, entry.pw_gid)
        d.chmod(0o777)
    message = console.internal_message(RuntimeError("secret-token-in-an-argument"))
    assert "the traceback could not be saved" in message, message
    assert list(planted.iterdir()) == []  # nothing of ours in the other user's directory
