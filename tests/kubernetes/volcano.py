"""A stand-in for Volcano's job controller beside the emulator: a ``batch.volcano.sh`` Job becomes pods.

What torchx's kubernetes scheduler relies on, as Volcano does it: one pod per task, named
``<job>-<task>-0``, from the task's template (the :mod:`.kubelet` stand-in then runs them);
the Job's ``status.state.phase`` (Pending, Running, Failed) and ``status.taskStatusCount``
(each task's pod phase), which torchx's ``describe`` reads; a Job whose phase was set to
``Aborted`` (torchx's cancel) or that is deleted has its pods deleted. Not modelled: queues, gang
scheduling (``minAvailable``), retries, plugins (the ``svc`` plugin's headless Service).
"""

from __future__ import annotations

import copy
from typing import Any

from .apiserver import ApiError, ControlLoop, Store

JOB_LABEL = "volcano.sh/job-name"
TASK_LABEL = "volcano.sh/task-spec"


class VolcanoController(ControlLoop):
    """Runs in a thread; :meth:`close` stops it (the kubelet kills the pods' processes)."""

    def __init__(self, store: Store) -> None:
        self.store = store
        self.start_loop("volcano")

    def _sync(self) -> None:
        jobs, _ = self.store.list("vcjobs", None)
        names = {(j["metadata"]["namespace"], j["metadata"]["name"]) for j in jobs}
        pods, _ = self.store.list("pods", None)
        for pod in pods:  # the garbage collector: pods of a deleted Job go
            owner = (pod["metadata"].get("labels") or {}).get(JOB_LABEL)
            if owner and (pod["metadata"]["namespace"], owner) not in names:
                self._delete(pod)
        for job in jobs:
            self._sync_job(job)

    def _sync_job(self, job: dict[str, Any]) -> None:
        ns, name = job["metadata"]["namespace"], job["metadata"]["name"]
        phase = ((job.get("status") or {}).get("state") or {}).get("phase")
        pods = {p["metadata"]["labels"][TASK_LABEL]: p for p in self.store.list("pods", ns, f"{JOB_LABEL}={name}")[0]}
        if phase is None:
            for task in job["spec"]["tasks"]:
                template = copy.deepcopy(task["template"])
                meta = template.get("metadata") or {}
                meta["labels"] = {**(meta.get("labels") or {}), JOB_LABEL: name, TASK_LABEL: task["name"]}
                meta["name"] = f"{name}-{task['name']}-0"
                pod = {"apiVersion": "v1", "kind": "Pod", "metadata": meta, "spec": template["spec"]}
                pod["status"] = {"phase": "Pending"}
                self.store.create("pods", ns, pod)
            self._set(ns, name, "Pending", {t["name"]: "Pending" for t in job["spec"]["tasks"]})
            return
        if phase in ("Aborted", "Failed", "Completed"):
            for pod in pods.values():
                self._delete(pod)
            return
        tasks = {t["name"]: (pods[t["name"]]["status"].get("phase") or "Pending") if t["name"] in pods else "Pending"
                 for t in job["spec"]["tasks"]}  # fmt: skip
        states = set(tasks.values())
        now = "Failed" if "Failed" in states else "Completed" if states == {"Succeeded"} else (
            "Running" if states == {"Running"} else "Pending")  # fmt: skip
        if now != phase or tasks != _task_phases(job):
            self._set(ns, name, now, tasks)

    def _set(self, ns: str, name: str, phase: str, tasks: dict[str, str]) -> None:
        status = {"state": {"phase": phase}, "taskStatusCount": {t: {"phase": {p: 1}} for t, p in tasks.items()}}
        self.store.update("vcjobs", ns, name, lambda o: o.update(status=status))

    def _delete(self, pod: dict[str, Any]) -> None:
        if not pod["metadata"].get("deletionTimestamp"):
            try:
                self.store.delete("pods", pod["metadata"]["namespace"], pod["metadata"]["name"], "")
            except ApiError:
                pass

    def close(self) -> None:
        self.stop_loop()


def _task_phases(job: dict[str, Any]) -> dict[str, str]:
    counts = (job.get("status") or {}).get("taskStatusCount") or {}
    return {t: next(iter(c["phase"])) for t, c in counts.items()}


__all__ = ["VolcanoController"]
