"""The workspace manifest and mirror, on real files: what is kept, skipped, sent and deleted."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest

from monarch_cli.runtime.workspace import Mirror, Scanner, WorkspaceError, check_size, diff, load_scanner, save_scanner


def _write(root: Path, files: dict[str, str]) -> None:
    for rel, text in files.items():
        p = root / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(text)


def _sync(scanner: Scanner, mirror: Mirror) -> int:
    result = scanner.scan()
    changes = diff(result.manifest, mirror.files)
    updates = [scanner.update_for(p, e, sha, he) for p, e, he, sha in changes.changed]
    mirror.apply(updates, changes.deleted)
    return sum(1 for u in updates if u.data is not None)


def _tree(root: Path) -> dict[str, str]:
    out = {}
    for dirpath, dirnames, filenames in os.walk(root):
        for name in filenames + [d for d in dirnames if os.path.islink(os.path.join(dirpath, d))]:
            p = Path(dirpath) / name
            rel = str(p.relative_to(root))
            out[rel] = "-> " + os.readlink(p) if p.is_symlink() else p.read_text()
    return out


def test_ignores_skips_links_and_modes(tmp_path: Path) -> None:
    ws, mirror_dir = tmp_path / "ws", tmp_path / "mirror"
    _write(
        ws,
        {
            "train.py": "print(1)\n",
            "pkg/mod.py": "x = 1\n",
            "pkg/__pycache__/mod.pyc": "bytecode",
            ".git/HEAD": "ref",
            ".monarch/job_state.pkl": "state",
            "venv/pyvenv.cfg": "home = /usr",
            "venv/lib/site.py": "",
            ".gitignore": "*.log\n!keep.log\nbuild/\n",
            "out.log": "log",
            "keep.log": "kept",
            "build/a.o": "obj",
            "data/.gitignore": "*.bin\n",
            "data/big.bin": "0" * 100,
            "data/small.txt": "s",
            ".monarchignore": "secret.txt\n",
            "secret.txt": "pw",
        },
    )
    os.chmod(ws / "train.py", 0o755)
    os.symlink("pkg/mod.py", ws / "link.py")
    os.symlink("pkg", ws / "pkglink")
    os.symlink("/etc/passwd", ws / "outside")
    scanner = Scanner(str(ws))
    result = scanner.scan()
    assert sorted(result.manifest) == [
        ".gitignore",
        ".monarchignore",
        "data/.gitignore",
        "data/small.txt",
        "keep.log",
        "link.py",
        "pkg/mod.py",
        "pkglink",
        "train.py",
    ]
    assert result.outside_links == ["outside -> /etc/passwd"]
    mirror = Mirror(str(mirror_dir))
    _sync(scanner, mirror)
    tree = _tree(mirror_dir)
    assert tree["link.py"] == "-> pkg/mod.py" and tree["pkglink"] == "-> pkg"
    assert tree["train.py"] == "print(1)\n" and "secret.txt" not in tree and "out.log" not in tree
    assert stat.S_IMODE(os.stat(mirror_dir / "train.py").st_mode) == 0o755
    assert os.stat(mirror_dir / "train.py").st_mtime_ns == os.stat(ws / "train.py").st_mtime_ns


def test_only_changes_travel_and_deletions_propagate(tmp_path: Path) -> None:
    ws, mirror_dir = tmp_path / "ws", tmp_path / "mirror"
    _write(ws, {f"d{i}/f{j}.py": f"{i}{j}" for i in range(3) for j in range(3)})
    scanner, mirror = Scanner(str(ws)), Mirror(str(mirror_dir))
    assert _sync(scanner, mirror) == 9
    assert _sync(scanner, mirror) == 0  # nothing changed
    (ws / "d0/f0.py").write_text("edited")
    (ws / "d1/f1.py").unlink()
    for f in (ws / "d2").iterdir():
        f.unlink()
    (ws / "d2").rmdir()
    os.utime(ws / "d0/f1.py", ns=(1, 1))  # touched, same content: no bytes travel
    assert _sync(scanner, mirror) == 1
    assert _tree(mirror_dir) == _tree(ws)
    assert not (mirror_dir / "d2").exists()  # emptied directory pruned
    assert os.stat(mirror_dir / "d0/f1.py").st_mtime_ns == 1
    (mirror_dir / "d0/ckpt.pt").write_text("written by a rank")  # not ours: left alone
    (ws / "d0/f2.py").unlink()
    _sync(scanner, mirror)
    assert (mirror_dir / "d0/ckpt.pt").exists() and not (mirror_dir / "d0/f2.py").exists()
    # the host's manifest survives a restart of the agent
    assert Mirror(str(mirror_dir)).digest == mirror.digest


def test_scanner_cache_sees_new_ignore_rules_and_files(tmp_path: Path) -> None:
    ws = tmp_path / "ws"
    _write(ws, {"a.py": "", "sub/b.py": "", "sub/c.tmp": ""})
    cache = tmp_path / "cache.pkl"
    scanner = Scanner(str(ws))
    assert "sub/c.tmp" in scanner.scan().manifest
    save_scanner(scanner, cache)
    scanner = load_scanner(cache, str(ws))
    (ws / ".monarchignore").write_text("*.tmp\n")
    assert "sub/c.tmp" not in scanner.scan().manifest
    (ws / "sub/new.py").write_text("")
    assert "sub/new.py" in scanner.scan().manifest


def test_size_limit_names_biggest_paths(tmp_path: Path) -> None:
    ws = tmp_path / "ws"
    _write(ws, {"small.py": "x", "model.ckpt": "0" * 5000, "data.npy": "0" * 3000})
    with pytest.raises(WorkspaceError) as e:
        check_size(Scanner(str(ws)).scan().manifest, 4000, str(ws))
    msg = str(e.value)
    assert "\n" not in msg and "over the 4 KB sync limit" in msg
    assert msg.index("model.ckpt") < msg.index("data.npy")


def test_mirror_refuses_paths_outside_itself(tmp_path: Path) -> None:
    from monarch_cli.runtime.workspace import FileUpdate

    mirror = Mirror(str(tmp_path / "m"))
    with pytest.raises(WorkspaceError):
        mirror.apply([FileUpdate("../escape.py", (1, 1, 0o644, ""), "", b"x")], [])
    assert not (tmp_path / "escape.py").exists()


def test_a_reader_never_sees_a_half_written_file(tmp_path: Path) -> None:
    """Syncs replace a file again and again while a rank reads it: it sees only whole versions."""
    import threading

    ws, mirror_dir = tmp_path / "ws", tmp_path / "mirror"
    ws.mkdir()
    (ws / ".monarchignore").write_text("*.tmp\n")
    target = ws / "model.py"
    target.write_bytes(b"a" * 200_000)
    scanner, mirror = Scanner(str(ws)), Mirror(str(mirror_dir))
    _sync(scanner, mirror)
    stop = threading.Event()
    seen, bad = set(), []

    def rewrite() -> None:
        i = 0
        while not stop.is_set():
            i += 1
            tmp = ws / ".model.tmp"  # an editor's save: whole versions on the client
            tmp.write_bytes(bytes([97 + i % 26]) * 200_000)
            os.replace(tmp, target)

    def read() -> None:
        while not stop.is_set():
            data = (mirror_dir / "model.py").read_bytes()
            seen.add(data[:1])
            if len(data) != 200_000 or data.count(data[:1]) != len(data):
                bad.append(len(data))

    threads = [threading.Thread(target=rewrite, daemon=True), threading.Thread(target=read)]
    for t in threads:
        t.start()
    try:
        for _ in range(30):
            try:
                _sync(scanner, mirror)
            except WorkspaceError:
                pass  # "keeps changing while it is read": refused rather than sent torn
    finally:
        stop.set()
        for t in threads:
            t.join()
    assert not bad and len(seen) > 1


def test_absolute_links_into_the_workspace_lead_into_the_mirror(tmp_path: Path) -> None:
    ws = tmp_path / "ws"
    _write(ws, {"pkg/mod.py": "x = 1\n", "data/train.txt": "rows\n"})
    os.symlink(ws / "pkg" / "mod.py", ws / "mod.py")  # absolute, into the workspace
    os.symlink(ws / "data", ws / "pkg" / "data")  # absolute, to a directory, from a subdirectory
    os.symlink("/etc/passwd", ws / "outside")
    mirror = Mirror(str(tmp_path / "remote" / "ws"))
    _sync(Scanner(str(ws)), mirror)
    tree = _tree(tmp_path / "remote" / "ws")
    assert tree["mod.py"] == "-> pkg/mod.py" and tree["pkg/data"] == "-> ../data"
    assert "outside" not in tree
    assert (tmp_path / "remote" / "ws" / "mod.py").read_text() == "x = 1\n"
    assert (tmp_path / "remote" / "ws" / "pkg" / "data" / "train.txt").read_text() == "rows\n"
    assert _sync(Scanner(str(ws)), mirror) == 0  # nothing new the next time


def test_a_big_file_travels_in_parts_and_a_part_out_of_order_is_refused(tmp_path: Path) -> None:
    ws = tmp_path / "ws"
    ws.mkdir()
    data = os.urandom(10_500)
    (ws / "big.bin").write_bytes(data)
    scanner = Scanner(str(ws))
    entry = scanner.scan().manifest["big.bin"]
    parts = list(scanner.updates_for("big.bin", entry, None, None, 1000))
    assert [p.offset for p in parts] == list(range(0, 11_000, 1000)) and [p.more for p in parts] == [True] * 10 + [
        False
    ]
    mirror = Mirror(str(tmp_path / "remote" / "ws"))
    for part in parts[:-1]:  # one part per request, as the client sends them
        mirror.apply([part], [])
        assert not (tmp_path / "remote" / "ws" / "big.bin").exists()  # nothing half-written in place
    mirror.apply([parts[-1]], [])
    assert (tmp_path / "remote" / "ws" / "big.bin").read_bytes() == data
    assert mirror.files["big.bin"][1] == scanner.sha256("big.bin", entry)
    with pytest.raises(WorkspaceError, match="came without what precedes it"):
        mirror.apply([parts[3]], [])
    leftovers = [p.name for p in (tmp_path / "remote" / "ws").iterdir() if p.name != "big.bin"]
    assert leftovers == []
