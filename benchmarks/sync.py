"""Workspace sync benchmark: the cost a run pays to check and update 2 hosts' mirrors.

    sudo python benchmarks/sync.py [--files 5000] [--repeats 20]

Two agents run in private mount namespaces (root: ``unshare --mount`` and a tmpfs over the
workspace's parent), so they do not see the workspace and really mirror it; the traffic is the
agents' own authenticated connection. Every sync starts from the on-disk scan cache, as a
fresh ``monarch run-spmd`` process does. References in the same run: one agent ping round trip
per host, one ``lstat`` of every file (no change check can do less), and a scan with no cache. Targets (issue 11): no change <= 20 ms, one changed file
<= 50 ms, for 5,000 files and 2 hosts.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

from _common import print_table, timed


def start_hidden_agent(keys: object, name: str, hide: Path, remote: Path, log: Path) -> tuple[int, str]:
    from monarch_cli.runtime.launch.command import READY_PREFIX, AgentCommand

    addr = log.with_suffix(".addr")
    agent = AgentCommand(keys_stdin=True, name=name, address_file=str(addr), reservation="bench-sync")
    script = 'mount -t tmpfs tmpfs "$0" && exec "$@"'
    env = {**os.environ, "MONARCH_HOST": "127.0.0.1", "MONARCH_REMOTE_DIR": str(remote)}
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            ["unshare", "--mount", "--propagation", "private", "sh", "-c", script, str(hide), *agent.argv()],
            stdin=subprocess.PIPE,
            stdout=out,
            stderr=out,
            env=env,
            start_new_session=True,
        )
    assert proc.stdin is not None
    proc.stdin.write(keys.encode().encode() + b"\n")  # type: ignore[attr-defined]
    proc.stdin.close()
    while not addr.exists():
        if proc.poll() is not None:
            raise SystemExit(f"agent {name} failed:\n{log.read_text()}")
        time.sleep(0.05)
    return proc.pid, addr.read_text().strip().removeprefix(READY_PREFIX)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--files", type=int, default=5000)
    parser.add_argument("--repeats", type=int, default=20)
    args = parser.parse_args()
    if os.geteuid() != 0:
        raise SystemExit("needs root (a private mount namespace per agent hides the workspace from it)")
    from monarch_cli.jobs.job import job_load
    from monarch_cli.jobs.state import HostRecord, JobState, save_state
    from monarch_cli.runtime import protocol
    from monarch_cli.runtime.transport.keys import Keys
    from monarch_cli.runtime.workspace import Scanner

    with tempfile.TemporaryDirectory(prefix="monarch-bench-sync-") as tmp:
        base = Path(tmp)
        ws = base / "client" / "proj"
        for i in range(args.files):  # 50 packages of 100 modules, ~1 KB each, plus ignore rules
            p = ws / f"pkg{i // 100:02d}" / f"mod{i % 100:03d}.py"
            p.parent.mkdir(parents=True, exist_ok=True)
            p.write_text(f"# module {i}\n" + "x = 1\n" * 170)
        (ws / ".gitignore").write_text("*.log\nbuild/\n")
        keys = Keys.generate()
        hosts = []
        for i in range(2):
            pid, addr = start_hidden_agent(keys, f"far{i}", base / "client", base / f"home{i}", base / f"far{i}.log")
            hosts.append(HostRecord(f"far{i}", addr, pid, i))
        path = ws / ".monarch" / "job_state.pkl"
        save_state(JobState("local", "local-bench", hosts, keys.encode(), [], time.time()), path)
        job = job_load(path)
        try:
            hs = job._hostset()
            first = job.sync(ws, _hostset=hs)
            assert first.files == args.files + 1, first
            ping = timed(
                lambda: [
                    hs.mb.request(h.agent, lambda cid: protocol.Ping(cid, hs.mb.address)).get(timeout=5) for h in hosts
                ],
                args.repeats,
                warmup=2,
            )
            cold_scan = timed(lambda: Scanner(str(ws)).scan(), 3)
            files = [str(p) for p in ws.rglob("*.py")]
            floor = timed(lambda: [os.lstat(f) for f in files], args.repeats)

            def unchanged() -> None:
                r = job.sync(ws, _hostset=hs)
                assert not r.changed and r.synced_hosts == 2, r

            counter = [0]

            def one_change() -> None:
                counter[0] += 1
                (ws / "pkg00" / "mod000.py").write_text(f"# edit {counter[0]}\n")
                r = job.sync(ws, _hostset=hs)
                assert r.files == 1 and r.synced_hosts == 2, r

            none = timed(unchanged, args.repeats, warmup=2)
            one = timed(one_change, args.repeats, warmup=1)
        finally:
            job.stop()

    ref = statistics.median(ping)
    rows: list[tuple[str, list[float], str]] = [
        ("ping both agents (reference)", ping, ""),
        (f"lstat {args.files} files once (floor of any change check)", floor, ""),
        (f"scan {args.files} files, no cache (reference)", cold_scan, ""),
        (f"first sync: {first.files} files, {first.nbytes / 1e6:.1f} MB", [first.seconds], ""),
        ("sync, nothing changed", none, "<= 20 ms"),
        ("sync, one file changed", one, "<= 50 ms"),
    ]
    cells = [
        (
            name,
            f"{statistics.median(t) * 1000:.1f} ms",
            f"{min(t) * 1000:.1f} ms",
            f"{statistics.median(t) / ref:.1f}x",
            target,
        )
        for name, t, target in rows
    ]
    print_table(f"workspace sync, {args.files} files, 2 hosts", ("what", "median", "min", "vs ping", "target"), cells)


if __name__ == "__main__":
    main()
