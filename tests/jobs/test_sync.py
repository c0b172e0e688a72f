"""Workspace sync through the agents' own connection, to agents that cannot see the workspace.

Host ``near`` is a plain local agent: it shares the client's filesystem, which the probe
detects, so nothing is mirrored to it. Host ``far`` runs in its own mount namespace with a
tmpfs over the workspace's parent (root only), so it cannot see the client's files: it gets a
mirror under its own remote dir, and its ranks run there.
"""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from monarch_cli.jobs import Job, JobError, job_load
from monarch_cli.jobs.state import HostRecord, JobState, save_state
from monarch_cli.runtime.agent.host import READY_PREFIX
from monarch_cli.runtime.transport.keys import Keys

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(os.geteuid() != 0, reason="needs root for a private mount namespace"),
]


def _start_agent(keys: Keys, name: str, remote_dir: Path, hide: Path, log: Path) -> tuple[int, str]:
    addr_file = log.with_suffix(".addr")
    script = (
        (
            'mount -t tmpfs tmpfs "$0" && exec "$1" -m monarch_cli.runtime.agent --keys-stdin '
            '--name "$2" --address-file "$3"'
        )
        if hide
        else 'exec "$1" -m monarch_cli.runtime.agent --keys-stdin --name "$2" --address-file "$3"'
    )
    prefix = ["unshare", "--mount", "--propagation", "private"] if hide else []
    env = {**os.environ, "MONARCH_HOST": "127.0.0.1", "MONARCH_REMOTE_DIR": str(remote_dir)}
    with open(log, "ab") as out:
        proc = subprocess.Popen(
            [*prefix, "sh", "-c", script, str(hide or ""), sys.executable, name, str(addr_file)],
            stdin=subprocess.PIPE,
            stdout=out,
            stderr=out,
            env=env,
            start_new_session=True,
        )
    assert proc.stdin is not None
    proc.stdin.write(keys.encode().encode() + b"\n")
    proc.stdin.close()
    deadline = time.monotonic() + 30
    while not addr_file.exists():
        assert proc.poll() is None and time.monotonic() < deadline, log.read_text()
        time.sleep(0.05)
    return proc.pid, addr_file.read_text().strip().removeprefix(READY_PREFIX)


@pytest.fixture(scope="module")
def far_job(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Job, Path, Path]]:
    base = tmp_path_factory.mktemp("sync")
    client = base / "client"  # hidden from `far`
    ws = client / "proj"
    ws.mkdir(parents=True)
    remote = base / "far-home"
    keys = Keys.generate()
    hosts = []
    for i, (name, hide) in enumerate((("near", None), ("far", client))):
        pid, addr = _start_agent(keys, name, remote, hide, base / f"{name}.log")
        hosts.append(HostRecord(name=name, agent=addr, pid=pid, node_rank=i))
    state = JobState("local", "local-synctest", hosts, keys.encode(), [], time.time())
    path = ws / ".monarch" / "job_state.pkl"
    save_state(state, path)
    job = job_load(path)
    yield job, ws, remote / "local-synctest" / "workspace"
    job.stop()


def test_sync_mirrors_only_to_the_host_that_cannot_see_the_workspace(
    far_job: tuple[Job, Path, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    job, ws, mirrors = far_job
    (ws / "train.py").write_text("import os\nprint('cwd', os.getcwd())\nprint(open('data/in.txt').read())\n")
    (ws / "data").mkdir()
    (ws / "data/in.txt").write_text("v1")
    (ws / "junk.log").write_text("ignored")
    (ws / ".gitignore").write_text("*.log\n")
    report = job.sync(ws)
    assert (report.synced_hosts, report.shared_hosts, report.files) == (1, 1, 3)
    assert str(report).startswith("synced 3 files, ") and "to 1 host in " in str(report)
    [mirror] = [d for d in mirrors.iterdir() if d.is_dir()]
    assert (mirror / "data/in.txt").read_text() == "v1" and not (mirror / "junk.log").exists()
    again = job.sync(ws)
    assert not again.changed and str(again).startswith("workspace up to date on 1 host")

    out, err = io.BytesIO(), io.BytesIO()
    (ws / "data/in.txt").write_text("v2")  # an edit reaches the far host before the run
    notices: list = []
    monkeypatch.chdir(ws)
    result = job.run_spmd(
        ["torchrun", "--nproc-per-node=1", "train.py"], stdout=out, stderr=err, on_event=notices.append
    )
    text = out.getvalue().decode()
    assert result.exit_code == 0, text + err.getvalue().decode()
    assert any(n.startswith("synced 1 file") for n in notices), notices
    assert f"[rank1] cwd {mirror}" in text and "[rank1] v2" in text


def test_deletions_propagate_and_env_is_forwarded(
    far_job: tuple[Job, Path, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    job, ws, mirrors = far_job
    monkeypatch.chdir(ws)
    (ws / "gone.py").write_text("")
    job.sync()
    [mirror] = [d for d in mirrors.iterdir() if d.is_dir()]
    assert (mirror / "gone.py").exists()
    (ws / "gone.py").unlink()
    (ws / "env.py").write_text(
        "import os, sys\nprint(os.environ.get('MY_FLAG'), os.environ.get('HOME_SET_HERE'), os.path.exists('gone.py'))\n"
    )
    monkeypatch.setenv("HOME_SET_HERE", "client-only")  # not forwarded to a synced host by default
    out = io.BytesIO()
    result = job.run_spmd(["torchrun", "--nproc-per-node=1", "env.py"], stdout=out, stderr=out, env={"MY_FLAG": "on"})
    lines = dict(line.split(b" ", 1) for line in out.getvalue().splitlines())
    assert result.exit_code == 0, out.getvalue()
    assert lines[b"[rank0]"] == b"on client-only False"  # near: the client's own environment
    assert lines[b"[rank1]"] == b"on None False"


def test_no_sync_and_cli_json(far_job: tuple[Job, Path, Path], monkeypatch: pytest.MonkeyPatch) -> None:
    job, ws, _ = far_job
    monkeypatch.chdir(ws)
    (ws / "new_only_here.py").write_text("print('hi')\n")
    out = io.BytesIO()
    result = job.run_spmd(["torchrun", "--nproc-per-node=1", "new_only_here.py"], stdout=out, stderr=out, sync=False)
    assert result.exit_code != 0 and result.first_failure is not None and result.first_failure.host == "far"
    proc = subprocess.run(
        [sys.executable, "-m", "monarch_cli", "sync", "--json"], cwd=ws, capture_output=True, text=True
    )
    assert proc.returncode == 0, proc.stderr
    data = json.loads(proc.stdout)
    assert data["files"] == 1 and data["synced_hosts"] == 1 and data["message"].startswith("synced 1 file")
    with pytest.raises(JobError, match="outside the workspace"):
        job.run_spmd(["torchrun", "--nproc-per-node=1", "x.py"], workspace=ws / "data")
    bad = subprocess.run(
        [sys.executable, "-m", "monarch_cli", "run-spmd", "-e", "1BAD", "--", "python", "x.py"],
        cwd=ws,
        capture_output=True,
        text=True,
    )
    assert bad.returncode != 0 and "-e takes NAME or NAME=VALUE" in bad.stderr and "Traceback" not in bad.stderr


BIG_SYNC = """
import json, sys
from monarch_cli.jobs import job_load
job = job_load(sys.argv[1])
report = job.sync(sys.argv[2])
# VmHWM, not getrusage's ru_maxrss: Linux carries the parent's peak across fork and exec into
# ru_maxrss, so a client started from a big pytest process would report pytest's size.
with open("/proc/self/status") as f:
    hwm = next(int(line.split()[1]) for line in f if line.startswith("VmHWM:"))
print(json.dumps({"nbytes": report.nbytes, "maxrss_kb": hwm}))
"""


def test_a_big_file_streams_in_parts_with_bounded_memory(far_job: tuple[Job, Path, Path]) -> None:
    job, ws, mirrors = far_job
    size = 400 << 20
    with open(ws / "weights.bin", "wb") as f:  # mostly zeros, a marker at each end
        f.write(b"head")
        f.truncate(size - 4)
        f.seek(size - 4)
        f.write(b"tail")
    far = next(h for h in job.state.hosts if h.name == "far")
    done = subprocess.run(
        [sys.executable, "-c", BIG_SYNC, str(job.path), str(ws)], capture_output=True, text=True, timeout=600
    )
    assert done.returncode == 0, done.stderr
    got = json.loads(done.stdout)
    assert got["nbytes"] >= size
    assert got["maxrss_kb"] < 300 << 10, f"the client peaked at {got['maxrss_kb'] >> 10} MB for a 400 MB file"
    with open(f"/proc/{far.pid}/status") as f:  # the far host's agent, peak resident memory
        hwm = next(int(line.split()[1]) for line in f if line.startswith("VmHWM:"))
    assert hwm < 300 << 10, f"the far agent peaked at {hwm >> 10} MB for a 400 MB file"
    [mirror] = [d for d in mirrors.iterdir() if d.is_dir()]
    copy = mirror / "weights.bin"
    assert copy.stat().st_size == size
    with open(copy, "rb") as f:
        assert f.read(4) == b"head" and f.seek(size - 4) and f.read(4) == b"tail"
    (ws / "weights.bin").unlink()
    job.sync(ws)
    assert not copy.exists()


def test_unreadable_files_and_directories_are_named_and_the_rest_is_synced(far_job: tuple[Job, Path, Path]) -> None:
    """As root reads everything, the client runs without the capabilities that let it (setpriv)."""
    job, ws, _ = far_job
    (ws / "locked_dir").mkdir()
    (ws / "locked_dir" / "inside.py").write_text("x = 1\n")
    (ws / "locked.py").write_text("secret = 1\n")
    (ws / "readable_next_to_them.py").write_text("y = 2\n")
    unprivileged = ["setpriv", "--bounding-set", "-dac_override,-dac_read_search"]
    unprivileged += ["--inh-caps", "-dac_override,-dac_read_search"]
    os.chmod(ws / "locked_dir", 0)
    os.chmod(ws / "locked.py", 0)
    try:
        sync = [*unprivileged, sys.executable, "-m", "monarch_cli", "sync"]
        said = subprocess.run(sync, cwd=ws, capture_output=True, text=True, timeout=120)
        data = json.loads(subprocess.run([*sync, "--json"], cwd=ws, capture_output=True, text=True, timeout=120).stdout)
    finally:
        os.chmod(ws / "locked_dir", 0o755)
        os.chmod(ws / "locked.py", 0o644)
    assert said.returncode == 0, said.stderr
    lines = said.stderr.splitlines()
    assert f"! not synced: {ws}/locked.py is an unreadable file (permission denied)" in lines, said.stderr
    assert f"! not synced: {ws}/locked_dir/ is an unreadable directory (permission denied)" in lines, said.stderr
    assert "Traceback" not in said.stderr
    assert data["unreadable"] == ["locked.py", "locked_dir/"]
    mirror = Path(data["directories"]["1"])
    assert (mirror / "readable_next_to_them.py").read_text() == "y = 2\n"
    assert not (mirror / "locked.py").exists() and not (mirror / "locked_dir").exists()
