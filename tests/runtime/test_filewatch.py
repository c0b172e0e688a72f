"""A warm process's loaded files are watched with inotify instead of a ``stat`` each per run:
every way a user changes a module must still be seen (else a run forks old code), including
the ways inotify sends no event for."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from monarch_cli.runtime.agent import filewatch
from monarch_cli.runtime.agent.filewatch import FileWatch


def _record(*paths: Path) -> dict[str, tuple[int, int]]:
    return {str(p): (p.stat().st_mtime_ns, p.stat().st_size) for p in paths}


@pytest.fixture()
def pkg(tmp_path: Path) -> tuple[Path, Path, Path]:
    top = tmp_path / "site" / "pkg"
    top.mkdir(parents=True)
    a, b = top / "a.py", top / "b.py"
    a.write_text("A = 1\n")
    b.write_text("B = 1\n")
    return tmp_path, a, b


def test_edits_in_place_by_rename_and_deletion_are_seen(pkg) -> None:
    _, a, b = pkg
    for change in (
        lambda: a.write_text("A = 2  # edited\n"),
        lambda: (a.with_suffix(".tmp").write_text("A = 22\n"), os.replace(a.with_suffix(".tmp"), a)),  # editors
        lambda: a.unlink(),
    ):
        a.write_text("A = 1\n")
        watch = FileWatch(_record(a, b))
        try:
            assert watch._dirs and not watch._always  # (ext4 here: events, not stats, vouch for both)
            assert watch.changed() is None
            (a.parent / "unrelated.log").write_text("x" * 100)  # other files of the directory do not count
            assert watch.changed() is None
            change()
            assert watch.changed() == str(a)
            assert watch.changed() == str(a)  # it stays changed
        finally:
            watch.close()


def test_a_change_before_the_watch_started_is_seen(pkg) -> None:
    _, a, b = pkg
    files = _record(a, b)
    b.write_text("B = 2  # between the load and the watch\n")
    watch = FileWatch(files)
    try:
        assert watch.changed() == str(b)
    finally:
        watch.close()


def test_a_directory_replaced_above_the_watched_one_is_seen(pkg) -> None:
    """Renaming a parent sends no event to the watched directory: it is found by its identity."""
    root, a, b = pkg
    watch = FileWatch(_record(a, b))
    try:
        assert watch.changed() is None
        os.rename(root / "site", root / "site.old")
        a.parent.mkdir(parents=True)
        a.write_text("A = 'a new release'\n")
        b.write_text("B = 1\n")
        assert watch.changed() in (str(a), str(b))
    finally:
        watch.close()


def test_a_module_behind_a_symlink_is_looked_at_each_time(tmp_path: Path) -> None:
    """A release switched by pointing a link elsewhere changes no watched directory."""
    for name, text in (("v1", "X = 1\n"), ("v2", "X = 'two'\n")):
        (tmp_path / name).mkdir()
        (tmp_path / name / "m.py").write_text(text)
    link = tmp_path / "current"
    link.symlink_to(tmp_path / "v1")
    m = link / "m.py"
    watch = FileWatch(_record(m))
    try:
        assert watch.changed() is None
        link.unlink()
        link.symlink_to(tmp_path / "v2")
        assert watch.changed() == str(m)
    finally:
        watch.close()


def test_files_on_a_network_file_system_are_not_left_to_inotify(pkg, monkeypatch: pytest.MonkeyPatch) -> None:
    """Another host's write to NFS sends no event here: such files get a stat at every run."""
    _, a, b = pkg
    monkeypatch.setattr(filewatch, "_mount_types", lambda: [("/", "nfs4")])
    watch = FileWatch(_record(a, b))
    try:
        assert watch._dirs == {} and watch._always == {str(a), str(b)}
        a.write_text("A = 'from another host'\n")
        assert watch.changed() == str(a)
    finally:
        watch.close()
