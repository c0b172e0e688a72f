"""A stand-in for SkyPilot's provisioning: the task's real setup and run on network-namespace nodes.

The skypilot backend finds it through ``$MONARCH_SKYPILOT_PROVISIONER`` (its documented test
seam). Each node is a network namespace from ``$MSKY_NODES`` (``ns=address,...``); a node's
processes run in their own mount namespace where ``/tmp`` is the node's own disk (a directory
of the stand-in's, kept while the cluster exists) and also their ``$HOME``, so the client's
workspace (pytest's directories live in /tmp) is not shared and must be synced.

A cloud whose firewall keeps the agents' port closed: with ``$MSKY_INTERNAL`` (``ns=address,...``,
a network the client has no route to) the nodes know each other by those addresses
(``SKYPILOT_NODE_IPS``; the agents listen there), and with ``$MSKY_SSH`` (``user:key_file``)
the launch gives SSH access to the head as SkyPilot's handle and credentials do (its external
address, port 22, the user, the private key). They get SkyPilot's environment (``SKYPILOT_NODE_RANK``, ``SKYPILOT_NODE_IPS``,
``SKYPILOT_NUM_NODES``, the task's secrets), get the task's ``file_mounts`` copied to their
home, run ``setup``, then ``exec`` the ``run`` script as
SkyPilot's job. ``down`` ends every process of the node as terminating a VM would. State
lives in ``$MSKY_STATE`` (one JSON file per cluster), so serve, status and stop may run in
different processes.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from monarch_cli.errors import SchedulerError
from monarch_cli.schedulers.skypilot import Cluster, ClusterStatus
from monarch_cli.schedulers.skypilot.ssh_access import SshAccess
from monarch_cli.sysutil import signal_if_alive

# $0 is the setup script, $1 the run script, $2 the node's disk; both run in the node's /tmp ($HOME).
_NODE = """\
mount --bind "$2" /tmp || exit 97
export HOME=/tmp
cd "$HOME"
bash -c "$0" || { echo "MSKY_SETUP_FAILED $?"; exit 98; }
echo MSKY_SETUP_DONE
exec bash -c "$1"
"""


def _file_mounts(mounts: dict[str, str], disk: Path) -> None:
    """What SkyPilot does with ``file_mounts`` before ``setup``: the local source, synced to the node
    (``~`` is the node's home, its disk here)."""
    for dest, source in mounts.items():
        if not dest.startswith("~/"):
            raise SchedulerError(f"the stand-in mounts only under ~, not {dest}")
        target = disk / dest[2:]
        if Path(source).is_dir():
            shutil.copytree(source, target, dirs_exist_ok=True)
        else:
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source, target)


def _nodes(variable: str = "MSKY_NODES") -> list[tuple[str, str]]:
    return [tuple(item.split("=", 1)) for item in os.environ[variable].split(",")]  # type: ignore[misc]


def _alive(pid: int) -> bool:
    try:
        os.waitpid(pid, os.WNOHANG)  # reap it, when this process started it
    except ChildProcessError:
        pass
    return Path(f"/proc/{pid}").exists() and "zombie" not in _proc_state(pid)


def _proc_state(pid: int) -> str:
    try:
        return next(line for line in Path(f"/proc/{pid}/status").read_text().splitlines() if line.startswith("State:"))
    except (OSError, StopIteration):
        return "zombie"


def _is_sshd(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/comm").read_text().strip().startswith("sshd")
    except OSError:
        return False


def netns_pids(ns: str) -> list[int]:
    out = subprocess.run(["ip", "netns", "pids", ns], capture_output=True, text=True).stdout
    return [int(p) for p in out.split()]


class NamespaceProvisioner:
    def __init__(self) -> None:
        self.state_dir = Path(os.environ["MSKY_STATE"])
        self.state_dir.mkdir(parents=True, exist_ok=True)

    def _record(self, cluster: str) -> dict[str, Any]:
        try:
            return json.loads((self.state_dir / f"{cluster}.json").read_text())
        except FileNotFoundError:
            return {}

    def _save(self, cluster: str, record: dict[str, Any]) -> None:
        (self.state_dir / f"{cluster}.json").write_text(json.dumps(record))

    def launch(
        self, cluster: str, task: dict[str, Any], secrets: dict[str, str], progress: Callable[[str], None]
    ) -> Cluster:
        nodes = _nodes()[: int(task["num_nodes"])]
        if len(nodes) < int(task["num_nodes"]):
            raise SchedulerError(f"the stand-in has {len(_nodes())} node(s), not {task['num_nodes']}")
        record = self._record(cluster)
        if record and any(_alive(pid) for pid in record["pids"]):
            raise SchedulerError(f"the stand-in runs one job per cluster ({cluster} runs one)")
        ips = [address for _, address in nodes]
        internal = (
            [address for _, address in _nodes("MSKY_INTERNAL")][: len(nodes)]
            if os.environ.get("MSKY_INTERNAL")
            else ips
        )
        launches = record.get("launches", 0) + 1
        record = {
            "state": "UP",
            "nodes": [ns for ns, _ in nodes],
            "pids": [],
            "logs": [],
            "launches": launches,
            "accelerators": task["resources"].get("accelerators"),
            "autostop": None,
        }
        self._save(cluster, record)
        for rank, (ns, _) in enumerate(nodes):
            env = {
                **os.environ,
                **secrets,
                "SKYPILOT_NODE_RANK": str(rank),
                "SKYPILOT_NODE_IPS": "\n".join(internal),
                "SKYPILOT_NUM_NODES": str(len(nodes)),
                "SKYPILOT_CLUSTER_INFO": json.dumps({"cluster": cluster}),
            }
            log = self.state_dir / f"{cluster}.node{rank}.log"
            disk = self.state_dir / f"{cluster}.node{rank}.disk"
            disk.mkdir(mode=0o700, exist_ok=True)
            _file_mounts(task.get("file_mounts") or {}, disk)
            with open(log, "ab") as out:
                proc = subprocess.Popen(
                    [
                        "ip",
                        "netns",
                        "exec",
                        ns,
                        "unshare",
                        "--mount",
                        "--propagation",
                        "private",
                        "bash",
                        "-c",
                        _NODE,
                        task["setup"],
                        task["run"],
                        str(disk),
                    ],
                    env=env,
                    stdout=out,
                    stderr=subprocess.STDOUT,
                    stdin=subprocess.DEVNULL,
                    start_new_session=True,
                )
            record["pids"].append(proc.pid)
            record["logs"].append(str(log))
            self._save(cluster, record)
            progress(f"stand-in: node{rank} in {ns}: setup")
        for rank, log in enumerate(record["logs"]):
            deadline = time.monotonic() + 60
            while Path(log).read_text(errors="replace").count("MSKY_SETUP_DONE") < launches:
                text = Path(log).read_text(errors="replace")
                if text.count("MSKY_SETUP_FAILED") >= launches or time.monotonic() > deadline:
                    raise SchedulerError(f"setup failed on node{rank}: {text.strip()[-300:]}")
                time.sleep(0.1)
        ssh = None
        if os.environ.get("MSKY_SSH"):
            user, _, key_file = os.environ["MSKY_SSH"].partition(":")
            ssh = SshAccess(ips[0], 22, user, key_file)
        return Cluster(ips, internal, ssh)

    def existing(self, cluster: str) -> ClusterStatus | None:
        record = self._record(cluster)
        return ClusterStatus(record["state"], len(record["nodes"]), record.get("accelerators")) if record else None

    def keep(self, cluster: str, idle_minutes: int, down: bool) -> None:
        """What ``sky cancel`` then ``sky autostop`` do: the job's processes end, the nodes stay up."""
        record = self._record(cluster)
        for pid in record.get("pids", []):
            signal_if_alive(pid, signal.SIGTERM)
        deadline = time.monotonic() + 15
        for pid in record.get("pids", []):
            while _alive(pid) and time.monotonic() < deadline:
                time.sleep(0.05)
        self._kill(record, spare=_is_sshd)  # what the agent left (nothing, if it cleaned up), sparing sshd
        record["autostop"] = {"idle_minutes": idle_minutes, "down": down}
        self._save(cluster, record)

    def state(self, cluster: str) -> tuple[str, str]:
        record = self._record(cluster)
        if not record:
            return "GONE", f"SkyPilot has no cluster {cluster} (torn down, autodowned or preempted)"
        return record["state"], f"SkyPilot reports cluster {cluster} as {record['state']}"

    def stop_behind_our_back(self, cluster: str) -> None:
        """What ``sky stop`` from another terminal, or autostop, does: the nodes' processes end."""
        record = self._record(cluster)
        self._kill(record)
        record["state"] = "STOPPED"
        self._save(cluster, record)

    def down(self, cluster: str) -> None:
        record = self._record(cluster)
        if record:
            self._kill(record)
            (self.state_dir / f"{cluster}.json").unlink()

    @staticmethod
    def _kill(record: dict[str, Any], spare: Callable[[int], bool] = lambda pid: False) -> None:
        """SIGKILL everything in the nodes, until nothing is left (a fork may race the first round)."""
        deadline = time.monotonic() + 15
        while time.monotonic() < deadline:
            pids = [pid for ns in record.get("nodes", []) for pid in netns_pids(ns) if not spare(pid)]
            if not pids:
                break
            for pid in pids:
                signal_if_alive(pid, signal.SIGKILL)
            time.sleep(0.05)
        for pid in record.get("pids", []):
            try:
                os.waitpid(pid, os.WNOHANG)  # reap, when this process started them
            except ChildProcessError:
                pass
