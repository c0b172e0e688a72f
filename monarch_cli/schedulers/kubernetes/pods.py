"""The kubernetes backend's view of a reservation's pods while serve waits: which agents answer
(at the pod IP, or through a port-forward), shipping our bundle to each pod's bootstrap on the
way (:mod:`..bootstrap`), and why waiting is pointless (one-line reasons)."""

from __future__ import annotations

import errno
import socket
import threading
import time
from collections.abc import Callable
from typing import Any

from ...errors import SchedulerError
from .. import bootstrap
from ..base import Progress
from . import manifests
from .api import api_error
from .manifests import RESERVATION_LABEL

#: How long every pod may stay Unschedulable before serve gives up (an autoscaler may add nodes).
UNSCHEDULABLE_GRACE = 120.0
#: How often serve asks for a port-forward to a pod whose agent does not answer yet.
FORWARD_PROBE_INTERVAL = 0.5
#: Container waiting reasons that will not resolve by waiting.
_TERMINAL_WAITING = {
    "ErrImagePull",
    "ImagePullBackOff",
    "InvalidImageName",
    "ErrImageNeverPull",
    "CreateContainerConfigError",
    "CreateContainerError",
    "CrashLoopBackOff",
}


class PodWatch:
    """The reservation's pods, kept current by watching them from the last resourceVersion seen."""

    def __init__(
        self,
        core: Any,
        batch: Any,
        namespace: str,
        job: str,
        hosts: int,
        port: int,
        progress: Progress,
        port_forward: str = "auto",
        *,
        key: bytes = b"",
        wheelhouse: str | None = None,
    ) -> None:
        """``key``: the bundle's HMAC key (:func:`..bootstrap.hmac_key`); ``wheelhouse``: where the pods'
        dependency wheels come from (default: this client's cache and package index)."""
        self.core, self.batch, self.ns, self.job, self.hosts, self.port = core, batch, namespace, job, hosts, port
        self.progress, self.said = progress, ""
        self.mode = port_forward
        #: "direct" or "port-forward" once decided (the first agent to answer decides for all).
        self.reach: str | None = {"always": "port-forward", "never": "direct"}.get(port_forward)
        self.next_forward: dict[str, float] = {}
        self.forward_errors: set[str] = set()
        self.events_read = 0.0
        self.selector = f"{RESERVATION_LABEL}={job}"
        self.pods: dict[str, Any] = {}
        self.version: str | None = None
        self.unschedulable_since: float | None = None
        self.answered: dict[str, str] = {}
        self.refreshed = 0.0
        self.key, self.wheelhouse = key, wheelhouse
        self.shipping: dict[str, threading.Thread] = {}  # pod name -> the thread shipping its bundle
        #: host index -> {"code", "deps", "shipped"}: the parts the pod runs and the bytes sent to it.
        self.shipped: dict[int, dict[str, Any]] = {}
        self.ship_errors: list[str] = []

    def _refresh(self) -> None:
        from kubernetes import watch

        try:
            if self.version is None:
                listed = self.core.list_namespaced_pod(self.ns, label_selector=self.selector)
                self.pods = {p.metadata.name: p for p in listed.items}
                self.version = listed.metadata.resource_version
                return
            w = watch.Watch()
            for event in w.stream(
                self.core.list_namespaced_pod,
                self.ns,
                label_selector=self.selector,
                resource_version=self.version,
                timeout_seconds=1,
                _request_timeout=10,
            ):
                pod = event["object"]
                self.version = pod.metadata.resource_version
                if event["type"] == "DELETED":
                    self.pods.pop(pod.metadata.name, None)
                else:
                    self.pods[pod.metadata.name] = pod
        except Exception as e:  # noqa: BLE001
            if getattr(e, "status", None) == 410:  # resourceVersion too old: list again
                self.version = None
                return
            raise api_error(e, f"cannot watch the pods of Job {self.ns}/{self.job}") from None

    def _by_index(self) -> dict[int, Any]:
        out = {}
        for pod in self.pods.values():
            index = (pod.metadata.labels or {}).get(manifests.INDEX_LABEL)
            if index is not None and not pod.metadata.deletion_timestamp:
                out[int(index)] = pod
        return out

    def pod_names(self) -> dict[int, str]:
        return {i: p.metadata.name for i, p in self._by_index().items()}

    def discover(self) -> dict[str, str]:
        """``{host name: agent address}`` for each running pod whose agent port accepts a connection."""
        running = [p for p in self._by_index().values() if p.status and p.status.phase == "Running"]
        if len(running) < self.hosts or time.monotonic() - self.refreshed > 1.0:
            self._refresh()  # blocks up to a second for news; once all run, only the ports are polled
            self.refreshed = time.monotonic()
        found = {}
        for index, pod in self._by_index().items():
            name = f"{self.job}-{index}"
            ip = pod.status.pod_ip if pod.status else None
            if pod.status and pod.status.phase == "Running" and ip:
                address = f"tcp://{ip}:{self.port}"
                if name not in self.answered and self._answers(pod.metadata.name, index, ip):
                    self.answered[name] = address
                if name in self.answered:
                    found[name] = self.answered[name]
        return found

    def _answers(self, pod: str, index: int, ip: str) -> bool:
        """Whether the pod's agent answers: at its IP, else (auto, IP unreachable; always) through a
        port-forward. A bootstrap that answers instead gets the bundle, in a thread of its own."""
        thread = self.shipping.get(pod)
        if thread is not None and thread.is_alive():
            return False
        opened = self._open(pod, index, ip)
        if opened is None:
            return False
        sock, end, forwarded = opened
        kind, hello = bootstrap.greeting(sock)
        if kind == "silent":
            end(sock)
            why = (forwarded.error(self.port) or "").strip() if forwarded is not None else ""
            if why and why not in self.forward_errors:  # once each: pods alternate
                self.forward_errors.add(why)
                self.progress(f"port-forward to pod {pod}: {why}")
            return False
        if self.reach is None:  # only a port-forward is tried before a decision
            self.reach = "port-forward"
            self.progress(
                "pod IPs are not reachable from here: each agent is reached through a port-forward over "
                "the Kubernetes API"
            )
        if kind == "agent":
            end(sock)
            return True
        assert hello is not None
        thread = threading.Thread(
            target=self._ship, args=(sock, end, pod, index, hello), name=f"monarch-k8s-ship-{pod}", daemon=True
        )
        self.shipping[pod] = thread
        thread.start()
        return False

    def _open(self, pod: str, index: int, ip: str) -> tuple[socket.socket, Callable[[Any], None], Any] | None:
        """A connection to the pod's port (and how to end it, and the port-forward or None); None if not now."""
        if self.reach != "port-forward":
            how, why, sock = _dial(ip, self.port)
            if sock is not None:
                self.reach = "direct"
                return sock, _close, None
            if self.reach == "direct" and how == "unreachable":
                raise SchedulerError(
                    f"pod {pod} (host {index}): its IP {ip} is not reachable from here ({why}); "
                    "use --port-forward auto or always from outside the cluster"
                )
            if self.reach == "direct" or how == "refused":  # reachable, nothing listens yet
                return None
        if time.monotonic() < self.next_forward.get(pod, 0.0):
            return None
        self.next_forward[pod] = time.monotonic() + FORWARD_PROBE_INTERVAL
        from .port_forward import end_stream, open_stream

        try:
            stream, forwarded = open_stream(self.core, self.ns, pod, self.port)
        except Exception as e:  # noqa: BLE001 - ApiException (status 0: the websocket handshake), connection errors
            why = " ".join(str(getattr(e, "reason", None) or e).split())[:300]
            if why not in self.forward_errors:
                self.forward_errors.add(why)
                self.progress(f"port-forward to pod {pod}: {why}")
            return None
        return stream, end_stream, forwarded

    def _ship(self, sock: socket.socket, end: Callable[[Any], None], pod: str, index: int, hello: Any) -> None:
        """Ship the bundle to a pod's bootstrap; a broken connection is tried again, other failures end serve."""
        where = f"pod {pod} (host {index})"
        try:
            self.shipped[index] = bootstrap.ship(
                sock, hello, self.key, self.wheelhouse, lambda m: self.progress(f"{where}: {m}")
            )
        except ConnectionError as e:
            self.progress(f"{where}: {e}; trying again")
        except SchedulerError as e:
            self.ship_errors.append(f"{where}: {e}")
        except Exception as e:  # noqa: BLE001 - a bug or a bad greeting: one line, not a dead thread
            self.ship_errors.append(f"{where}: cannot ship the bundle: {type(e).__name__}: {e}")
        finally:
            end(sock)

    def check(self) -> None:
        """Raise when waiting is pointless: the Job failed, a pod ended or cannot pull its image."""
        try:
            job = self.batch.read_namespaced_job(self.job, self.ns)
        except Exception as e:  # noqa: BLE001
            if getattr(e, "status", None) == 404:
                raise SchedulerError(f"the Job {self.ns}/{self.job} was deleted while starting") from None
            raise api_error(e, f"cannot read Job {self.ns}/{self.job}") from None
        why = job_ended(job)
        if not why and self.ship_errors:
            self._check_pods()  # a pod that died says more than its broken connection
            raise SchedulerError(self.ship_errors[0])
        if why:  # a failed pod says more than the Job's condition: see the pods as they are now
            self.version = None
            self._refresh()
            self._check_pods()
            raise SchedulerError(why)
        self._check_pods()
        if job.spec.suspend:
            self._say(f"the Job {self.ns}/{self.job} is suspended: waiting for Kueue to admit it")
        elif len(self._by_index()) < self.hosts:
            refused = self._failed_create()
            if refused:
                self._say(f"Pending: the Job {self.ns}/{self.job} cannot create its pods: {refused}")
        unschedulable = [
            f"pod {p.metadata.name}: {pending_reason(p)}"
            for _, p in sorted(self._by_index().items())
            if pending_reason(p).startswith("Unschedulable")
        ]
        if unschedulable:
            self._say(
                f"Pending: {unschedulable[0]}"
                + (f" (and {len(unschedulable) - 1} more)" if len(unschedulable) > 1 else "")
            )
            self.unschedulable_since = self.unschedulable_since or time.monotonic()
            if time.monotonic() - self.unschedulable_since > UNSCHEDULABLE_GRACE:
                raise SchedulerError(f"{unschedulable[0]} (for {UNSCHEDULABLE_GRACE:.0f} s)")
        else:
            self.unschedulable_since = None

    def _failed_create(self) -> str:
        """The Job controller's latest FailedCreate warning (a quota, a policy), at most once a second."""
        if time.monotonic() < self.events_read + 1.0:
            return ""
        self.events_read = time.monotonic()
        try:
            events = self.core.list_namespaced_event(
                self.ns, field_selector=f"involvedObject.kind=Job,involvedObject.name={self.job}"
            ).items
        except Exception:  # noqa: BLE001 - events are a hint; RBAC may not allow them
            return ""
        warnings = [e for e in events if e.type == "Warning" and e.reason == "FailedCreate"]
        return " ".join((warnings[-1].message or "").split())[:300] if warnings else ""

    def _check_pods(self) -> None:
        """Raise for a pod that ended or cannot pull its image."""
        for index, pod in sorted(self._by_index().items()):
            phase = pod.status.phase if pod.status else None
            if phase in ("Failed", "Succeeded"):
                raise SchedulerError(
                    f"pod {pod.metadata.name} (host {index}) {phase.lower()} during start-up: {exit_reason(pod)}"
                )
            for cs in (pod.status.container_statuses or []) if pod.status else []:
                waiting = cs.state.waiting if cs.state else None
                if waiting and waiting.reason in _TERMINAL_WAITING:
                    raise SchedulerError(
                        f"pod {pod.metadata.name} (host {index}): {waiting.reason}: "
                        f"{(waiting.message or '').strip()[:300]}"
                    )

    def _say(self, message: str) -> None:
        if message != self.said:
            self.progress(message)
            self.said = message


def _dial(ip: str, port: int, timeout: float = 0.5) -> tuple[str, str, socket.socket | None]:
    """Try the pod IP's port: ("open"|"refused"|"unreachable"|"timeout", why, the connection if open)."""
    try:
        return "open", "", socket.create_connection((ip, port), timeout=timeout)
    except TimeoutError:
        return "timeout", f"no answer in {timeout} s", None
    except OSError as e:
        if e.errno == errno.ECONNREFUSED:
            return "refused", e.strerror or str(e), None
        if e.errno in (errno.EHOSTUNREACH, errno.ENETUNREACH, errno.EACCES, errno.EPERM):
            return "unreachable", e.strerror or str(e), None
        return "timeout", e.strerror or str(e), None


def _close(sock: socket.socket) -> None:
    sock.close()


def pending_reason(pod: Any) -> str:
    for cond in (pod.status.conditions or []) if pod.status else []:
        if cond.type == "PodScheduled" and cond.status == "False" and cond.reason:
            return f"{cond.reason}: {(cond.message or '').strip()}"
    return ""


def exit_reason(pod: Any) -> str:
    statuses = (
        [*(pod.status.init_container_statuses or []), *(pod.status.container_statuses or [])] if pod.status else []
    )
    for cs in statuses:
        term = cs.state.terminated if cs.state else None
        if term and (term.exit_code or cs is statuses[-1]):
            return (
                (f"{cs.name}: " if cs.name != manifests.CONTAINER else "")
                + f"exit code {term.exit_code}"
                + (f" ({term.reason})" if term.reason else "")
                + (f": {_one_line(term.message)}" if term.message else "")
            )
    return (pod.status.reason or pod.status.message or "no reason given") if pod.status else "no status"


def _one_line(text: str, lines: int = 3) -> str:
    """The last few lines of a container's message (its log tail), joined into one."""
    return " | ".join([ln.strip() for ln in text.strip().splitlines() if ln.strip()][-lines:])[-400:]


def job_ended(job: Any) -> str:
    """Why the Job is over ("" while it runs): failed (deadline, a pod failed) or complete."""
    name = f"{job.metadata.namespace}/{job.metadata.name}"
    for cond in (job.status.conditions or []) if job.status else []:
        if cond.status != "True":
            continue
        if cond.type == "Failed":
            if cond.reason == "DeadlineExceeded":
                return f"the Job {name} reached its deadline (activeDeadlineSeconds={job.spec.active_deadline_seconds})"
            return f"the Job {name} failed: {cond.reason}: {(cond.message or '').strip()}"
        if cond.type == "Complete":
            return f"the Job {name} completed (every agent exited)"
    return ""


__all__ = ["PodWatch", "job_ended", "exit_reason", "pending_reason", "UNSCHEDULABLE_GRACE"]
