"""Tests for the job state pickle cache: round trip, atomicity, modes and every error."""

from __future__ import annotations

import os
import pickle
import random
import stat
import struct
from pathlib import Path
from typing import Any

import pytest

from monarch_cli.jobs import state as state_mod
from monarch_cli.jobs.errors import JobError
from monarch_cli.jobs.state import (
    DEFAULT_STATE_PATH,
    SCHEMA_VERSION,
    STATE_ENV,
    HostRecord,
    JobState,
    NoReservation,
    StateError,
    clear_state,
    find_state_dir,
    load_state,
    save_state,
    state_path,
)


def make_state(**overrides: Any) -> JobState:
    fields: dict[str, Any] = dict(
        scheduler="local",
        reservation_id="res-42",
        hosts=[
            HostRecord(name="host0", agent="tcp://10.0.0.1:5555", pid=1234, node_rank=0),
            HostRecord(name="host1", agent="tcp://10.0.0.2:5555", pid=None, node_rank=1),
        ],
        keys="pub:sec:opaque",
        default_command=["torchrun", "--nproc-per-node=2", "train.py"],
        created_at=1700000000.5,
        scheduler_data={"job_id": 77, "nested": {"t": (1, 2), "s": {3}, "b": b"\x00"}},
        last_run={"run_id": "r1", "started_at": 1.0, "exit_code": 0, "duration": 2.5},
        default_cwd="/srv/project",
    )
    fields.update(overrides)
    return JobState(**fields)


def mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def write_payload(path: Path, payload: Any) -> None:
    path.write_bytes(pickle.dumps(payload, protocol=4))


def valid_payload() -> dict[str, Any]:
    return pickle.loads(state_mod._encode(make_state()))


@pytest.fixture
def target(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.delenv(STATE_ENV, raising=False)
    return tmp_path / "state" / "job_state.pkl"


def test_round_trip(target: Path) -> None:
    original = make_state()
    assert save_state(original, target) == target
    assert load_state(target) == original
    minimal = make_state(scheduler_data={}, last_run=None, hosts=[], created_at=3)
    save_state(minimal, target)
    loaded = load_state(target)
    assert loaded == minimal and isinstance(loaded.created_at, float)


def test_on_disk_format_is_plain_builtins(target: Path) -> None:
    save_state(make_state(), target)
    payload = pickle.loads(target.read_bytes())
    assert payload["magic"] == "monarch-cli-job-state"
    assert payload["schema_version"] == SCHEMA_VERSION
    assert type(payload["state"]) is dict and type(payload["state"]["hosts"][0]) is dict
    assert b"monarch_cli" not in target.read_bytes()  # no class references at all


def test_modes(target: Path) -> None:
    old_umask = os.umask(0)
    try:
        save_state(make_state(), target)
    finally:
        os.umask(old_umask)
    assert mode(target) == 0o600
    assert mode(target.parent) == 0o700


def test_loose_file_still_loads_and_is_rewritten_0600(target: Path) -> None:
    save_state(make_state(), target)
    target.chmod(0o644)
    loaded = load_state(target)
    assert loaded == make_state()
    save_state(loaded, target)
    assert mode(target) == 0o600


def test_existing_parent_dir_is_left_alone(tmp_path: Path) -> None:
    tmp_path.chmod(0o755)
    save_state(make_state(), tmp_path / "s.pkl")
    assert mode(tmp_path) == 0o755


def test_path_resolution(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(STATE_ENV, raising=False)
    monkeypatch.chdir(tmp_path)
    assert state_path() == DEFAULT_STATE_PATH == Path(".monarch/job_state.pkl")
    monkeypatch.setenv(STATE_ENV, str(tmp_path / "env.pkl"))
    assert state_path() == tmp_path / "env.pkl"
    assert state_path(tmp_path / "explicit.pkl") == tmp_path / "explicit.pkl"
    assert state_path(str(tmp_path / "s.pkl")) == tmp_path / "s.pkl"
    monkeypatch.setenv(STATE_ENV, "")
    assert state_path() == DEFAULT_STATE_PATH


def test_the_nearest_monarch_dir_above_is_found_like_git(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(STATE_ENV, raising=False)
    project = tmp_path / "project"
    deep = project / "src" / "pkg"
    deep.mkdir(parents=True)
    monkeypatch.chdir(deep)
    assert find_state_dir() is None and state_path() == DEFAULT_STATE_PATH  # serve would make ./.monarch
    save_state(make_state(), project / ".monarch" / "job_state.pkl")
    assert state_path() == project / ".monarch" / "job_state.pkl"
    assert load_state().reservation_id == "res-42"
    (project / "src" / ".monarch").mkdir()  # the nearest wins, as with nested git repositories
    assert find_state_dir() == project / "src" / ".monarch"
    monkeypatch.setenv(STATE_ENV, str(tmp_path / "env.pkl"))  # $MONARCH_STATE and --state still decide
    assert state_path() == tmp_path / "env.pkl"
    assert state_path(tmp_path / "x.pkl") == tmp_path / "x.pkl"
    monkeypatch.delenv(STATE_ENV)
    monkeypatch.chdir(project)
    assert state_path() == DEFAULT_STATE_PATH  # found right here: the short relative path


def test_the_walk_stops_below_home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A reservation served from $HOME is not every project's reservation."""
    home = tmp_path / "home"
    (home / ".monarch").mkdir(parents=True)
    (home / "proj" / "sub").mkdir(parents=True)
    monkeypatch.setenv("HOME", str(home))
    assert find_state_dir(home / "proj" / "sub") is None
    assert find_state_dir(home) == home / ".monarch"
    (home / "proj" / ".monarch").mkdir()
    assert find_state_dir(home / "proj" / "sub") == home / "proj" / ".monarch"


@pytest.mark.skipif(os.geteuid() != 0, reason="making a directory another user owns needs root")
def test_another_users_monarch_dir_is_not_used(tmp_path: Path) -> None:
    """Their agents would receive our programs and environment."""
    (tmp_path / ".monarch").mkdir()
    (tmp_path / "sub").mkdir()
    os.chown(tmp_path / ".monarch", 65534, 65534)  # nobody
    assert find_state_dir(tmp_path / "sub") is None


def test_a_version_1_file_loads_without_a_served_directory(target: Path) -> None:
    payload = valid_payload()
    payload["schema_version"] = payload["state"]["schema_version"] = 1
    del payload["state"]["default_cwd"]
    target.parent.mkdir()
    write_payload(target, payload)
    assert load_state(target).default_cwd is None


def test_default_and_env_paths_are_used(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(STATE_ENV, raising=False)
    monkeypatch.chdir(tmp_path)
    save_state(make_state())
    assert (tmp_path / ".monarch" / "job_state.pkl").exists()
    assert mode(tmp_path / ".monarch") == 0o700
    monkeypatch.setenv(STATE_ENV, str(tmp_path / "other" / "s.pkl"))
    save_state(make_state(reservation_id="env"))
    assert load_state().reservation_id == "env"
    assert load_state(tmp_path / ".monarch" / "job_state.pkl").reservation_id == "res-42"
    clear_state()
    assert not (tmp_path / "other" / "s.pkl").exists()
    assert (tmp_path / ".monarch" / "job_state.pkl").exists()


@pytest.mark.parametrize("failing", ["replace", "fsync", "write"])
def test_failed_write_keeps_old_file_and_leaves_no_temp(
    target: Path, monkeypatch: pytest.MonkeyPatch, failing: str
) -> None:
    save_state(make_state(reservation_id="old"), target)
    before = target.read_bytes()

    def boom(*args: Any, **kwargs: Any) -> Any:
        raise OSError(28, "No space left on device")

    if failing == "write":
        monkeypatch.setattr(state_mod.os, "fdopen", lambda *a, **k: _FailingFile())
    else:
        monkeypatch.setattr(state_mod.os, failing, boom)
    with pytest.raises(StateError) as info:
        save_state(make_state(reservation_id="new"), target)
    monkeypatch.undo()
    assert str(target) in str(info.value) and "\n" not in str(info.value)
    assert target.read_bytes() == before
    assert load_state(target).reservation_id == "old"
    assert sorted(p.name for p in target.parent.iterdir()) == [target.name]


class _FailingFile:
    def __enter__(self) -> _FailingFile:
        return self

    def __exit__(self, *exc: Any) -> None:
        return None

    def write(self, data: bytes) -> int:
        raise OSError(5, "Input/output error")


def test_interrupted_write_leaves_no_temp(target: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def interrupt(fd: int) -> None:
        raise KeyboardInterrupt

    monkeypatch.setattr(state_mod.os, "fsync", interrupt)
    with pytest.raises(KeyboardInterrupt):
        save_state(make_state(), target)
    monkeypatch.undo()
    assert list(target.parent.iterdir()) == []


def test_unwritable_directory(tmp_path: Path) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("not a dir")
    with pytest.raises(StateError, match="cannot write job state"):
        save_state(make_state(), blocker / "s.pkl")


def test_unpicklable_field_is_a_bug_not_a_file(target: Path) -> None:
    with pytest.raises(TypeError, match="PosixPath"):
        save_state(make_state(scheduler_data={"dir": Path("/x")}), target)
    assert not target.exists()


def test_missing_file(target: Path) -> None:
    with pytest.raises(NoReservation) as info:
        load_state(target)
    assert str(info.value) == f"no reservation at {target}; start one with `monarch serve`"
    assert isinstance(info.value, StateError) and isinstance(info.value, JobError)


def assert_corrupt(target: Path) -> None:
    with pytest.raises(StateError) as info:
        load_state(target)
    message = str(info.value)
    assert not isinstance(info.value, NoReservation)
    assert str(target) in message and "corrupt" in message
    assert "monarch stop --force" in message and "delete" in message
    assert "\n" not in message


@pytest.mark.parametrize(
    "content",
    [
        b"",
        b"hello world",
        b"\x80\x04",
        b"\x80\x04K\x01.trailing",
        b"\x00" * 64,
        # A few bytes that would make the C unpickler allocate gigabytes if not vetted first.
        b"\x80\x04N" + b"r" + struct.pack("<I", 2**31) + b".",
        b"\x80\x04" + b"\x8e" + struct.pack("<Q", 2**40) + b"x.",
        b"\x80\x04" + b"\x95" + struct.pack("<Q", 2**40) + b"N.",
    ],
    ids=["empty", "text", "truncated-header", "trailing-bytes", "zeros", "memo-bomb", "bytes8-bomb", "frame-bomb"],
)
def test_corrupt_bytes(target: Path, content: bytes) -> None:
    target.parent.mkdir()
    target.write_bytes(content)
    assert_corrupt(target)


def test_truncated_valid_file(target: Path) -> None:
    save_state(make_state(), target)
    target.write_bytes(target.read_bytes()[:-5])
    assert_corrupt(target)


@pytest.mark.parametrize(
    "mutate",
    [
        lambda p: p["state"].pop("keys"),
        lambda p: p["state"].update(hosts="host0"),
        lambda p: p["state"].update(extra=1),
        lambda p: p["state"]["hosts"][0].update(node_rank=True),
        lambda p: p["state"]["hosts"][0].pop("agent"),
        lambda p: p["state"].update(default_command=["ok", 3]),
        lambda p: p["state"].update(created_at="yesterday"),
        lambda p: p.update(state=None),
        lambda p: p.update(schema_version="1"),
        lambda p: p.update(schema_version=0),
    ],
)
def test_malformed_content_is_corrupt(target: Path, mutate: Any) -> None:
    payload = valid_payload()
    mutate(payload)
    target.parent.mkdir()
    write_payload(target, payload)
    assert_corrupt(target)


@pytest.mark.parametrize("payload", [{"a": 1}, [1, 2, 3], "monarch-cli-job-state", {"magic": "other", "state": {}}])
def test_foreign_pickle(target: Path, payload: Any) -> None:
    target.parent.mkdir()
    write_payload(target, payload)
    with pytest.raises(StateError, match="not a monarch job state file"):
        load_state(target)


EXECUTED: list[str] = []


def _side_effect(marker: str) -> str:
    EXECUTED.append(marker)
    return marker


class _Evil:
    def __reduce__(self) -> tuple[Any, ...]:
        return (_side_effect, ("ran",))


@pytest.mark.parametrize(
    "payload",
    [_Evil(), {"magic": "monarch-cli-job-state", "schema_version": 1, "state": _Evil()}, Path("/x")],
    ids=["reduce", "nested-reduce", "class-instance"],
)
def test_globals_are_never_resolved(target: Path, payload: Any) -> None:
    target.parent.mkdir()
    target.write_bytes(pickle.dumps(payload))
    with pytest.raises(StateError, match="not a monarch job state file .it holds Python objects"):
        load_state(target)
    assert EXECUTED == []


def test_newer_schema(target: Path) -> None:
    payload = valid_payload()
    payload["schema_version"] = SCHEMA_VERSION + 1
    target.parent.mkdir()
    write_payload(target, payload)
    with pytest.raises(StateError) as info:
        load_state(target)
    message = str(info.value)
    assert f"written by a newer monarch-cli (schema {SCHEMA_VERSION + 1} > {SCHEMA_VERSION})" in message
    assert "upgrade" in message


def test_directory_in_place_of_file(target: Path) -> None:
    target.mkdir(parents=True)
    with pytest.raises(StateError, match="is a directory"):
        load_state(target)
    with pytest.raises(StateError, match="is a directory"):
        clear_state(target)


def test_unreadable_paths(target: Path, tmp_path: Path) -> None:
    # Paths that cannot be read even by root (CI runs as root, which ignores chmod 0).
    target.mkdir(parents=True)
    with pytest.raises(StateError, match="is a directory"):
        load_state(target)
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    with pytest.raises(StateError, match="cannot read job state file"):
        load_state(blocker / "job_state.pkl")  # ENOTDIR


def test_oversized_file(target: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(state_mod, "_MAX_BYTES", 64)
    save_state(make_state(), target)
    assert_corrupt(target)


def test_clear_state(target: Path) -> None:
    clear_state(target)  # nothing there: fine
    save_state(make_state(), target)
    clear_state(target)
    assert not target.exists()
    with pytest.raises(NoReservation):
        load_state(target)


def test_fuzz_load_never_raises_anything_else(target: Path) -> None:
    save_state(make_state(), target)
    valid = target.read_bytes()
    rng = random.Random(20240601)
    cases: list[bytes] = [valid[:n] for n in range(len(valid))]
    for _ in range(200):
        choice = rng.random()
        if choice < 0.4:
            cases.append(bytes(rng.randrange(256) for _ in range(rng.randrange(1, 400))))
        elif choice < 0.6:
            cases.append(b"\x80\x04" + bytes(rng.randrange(256) for _ in range(rng.randrange(0, 200))))
        else:
            flipped = bytearray(valid)
            for _ in range(rng.randrange(1, 6)):
                flipped[rng.randrange(len(flipped))] = rng.randrange(256)
            cases.append(bytes(flipped[: rng.randrange(1, len(flipped) + 1)]))
    loaded = 0
    for data in cases:
        target.write_bytes(data)
        try:
            result = load_state(target)
        except NoReservation:
            pytest.fail("an existing file must never read as 'no reservation'")
        except StateError as err:
            assert "\n" not in str(err)
        else:
            assert isinstance(result, JobState)
            loaded += 1
    assert loaded < len(cases)
    assert EXECUTED == []
