"""A stand-in for SkyPilot's provisioning: the task's real setup and run on network-namespace nodes.

The skypilot backend finds it through ``$MONARCH_SKYPILOT_PROVISIONER`` (its documented test
seam). Each node is a network namespace from ``$MSKY_NODES`` (``ns=address,...``); a node's
processes run in their own mount namespace with a private, empty ``/tmp`` that is also their
``$HOME``, so the client's workspace (pytest's directories live in /tmp) is not shared and
must be synced. They get SkyPilot's environment (``SKYPILOT_NODE_RANK``, ``SKYPILOT_NODE_IPS``,
``SKYPILOT_NUM_NODES``, the task's secrets), run ``setup``, then ``exec`` the ``run`` script as
SkyPilot's job. ``down`` ends every process of the node as terminating a VM would. State
lives in ``$MSKY_STATE`` (one JSON file per cluster), so serve, status and stop may run in
different processes.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from pathlib import Path
from typing import Any, Callable, Dict, List, Tuple

from monarch_cli.errors import SchedulerError
from monarch_cli.sysutil import signal_if_alive

# $0 is the setup script, $1 the run script; both run in the node's private /tmp ($HOME).
_NODE = """\
mount -t tmpfs -o mode=700 tmpfs /tmp || exit 97
export HOME=/tmp
cd "$HOME"
bash -c "$0" || { echo "MSKY_SETUP_FAILED $?"; exit 98; }
echo MSKY_SETUP_DONE
exec bash -c "$1"
"""


def _nodes() -> List[Tuple[str, str]]:
    return [tuple(item.split("=", 1)) for item in os.environ["MSKY_NODES"].split(",")]  # type: ignore[misc]


def netns_pids(ns: str) -> List[int]:
    out = subprocess.run(["ip", "netns", "pids", ns], capture_output=True, text=True).stdout
    return [int(p) for p in out.split()]


class NamespaceProvisioner:
    def __init__(self) -> None:
        self.state_dir = Path(os.environ["MSKY_STATE"])
        self.state_dir.mkdir(parents=True, exist_ok=True)

    def _record(self, cluster: str) -> Dict[str, Any]:
        try:
            return json.loads((self.state_dir / f"{cluster}.json").read_text())
        except FileNotFoundError:
            return {}

    def _save(self, cluster: str, record: Dict[str, Any]) -> None:
        (self.state_dir / f"{cluster}.json").write_text(json.dumps(record))

    def launch(self, cluster: str, task: Dict[str, Any], secrets: Dict[str, str],
               progress: Callable[[str], None]) -> List[str]:
        nodes = _nodes()[:int(task["num_nodes"])]
        if len(nodes) < int(task["num_nodes"]):
            raise SchedulerError(f"the stand-in has {len(_nodes())} node(s), not {task['num_nodes']}")
        if self._record(cluster).get("state") == "UP":
            raise SchedulerError(f"the stand-in does not reuse clusters ({cluster} is UP)")
        ips = [address for _, address in nodes]
        record: Dict[str, Any] = {"state": "UP", "nodes": [ns for ns, _ in nodes], "pids": [], "logs": []}
        self._save(cluster, record)
        for rank, (ns, _) in enumerate(nodes):
            env = {**os.environ, **secrets, "SKYPILOT_NODE_RANK": str(rank), "SKYPILOT_NODE_IPS": "\n".join(ips),
                   "SKYPILOT_NUM_NODES": str(len(nodes)), "SKYPILOT_CLUSTER_INFO": json.dumps({"cluster": cluster})}
            log = self.state_dir / f"{cluster}.node{rank}.log"
            with open(log, "wb") as out:
                proc = subprocess.Popen(["ip", "netns", "exec", ns, "unshare", "--mount", "--propagation", "private",
                                         "bash", "-c", _NODE, task["setup"], task["run"]], env=env, stdout=out,
                                        stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True)
            record["pids"].append(proc.pid)
            record["logs"].append(str(log))
            self._save(cluster, record)
            progress(f"stand-in: node{rank} in {ns}: setup")
        for rank, log in enumerate(record["logs"]):
            deadline = time.monotonic() + 60
            while "MSKY_SETUP_DONE" not in Path(log).read_text(errors="replace"):
                text = Path(log).read_text(errors="replace")
                if "MSKY_SETUP_FAILED" in text or time.monotonic() > deadline:
                    raise SchedulerError(f"setup failed on node{rank}: {text.strip()[-300:]}")
                time.sleep(0.1)
        return ips

    def state(self, cluster: str) -> Tuple[str, str]:
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
    def _kill(record: Dict[str, Any]) -> None:
        """SIGKILL everything in the nodes, until nothing is left (a fork may race the first round)."""
        deadline = time.monotonic() + 15
        while time.monotonic() < deadline:
            pids = [pid for ns in record.get("nodes", []) for pid in netns_pids(ns)]
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
