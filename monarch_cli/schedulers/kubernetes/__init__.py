"""The kubernetes backend: an Indexed Job of host agents, no operator, no CRD.

``plan()`` builds every manifest (:mod:`.manifests`) without contacting a cluster;
``reserve(plan)`` creates the Secret (the reservation keys, mounted read-only), the headless
Service and the Job, then watches the pods: host rank = completion index, ready once every
pod runs and its agent's port answers. Pending pods say why (Unschedulable, image pulls);
terminal reasons are one-line errors. ``release`` deletes the Job (foreground propagation),
the Secret and the Service and waits until no pod is left. The client reaches agents by pod
IP when it can (a client inside the cluster), else through one port-forward per pod over the
API (:mod:`.port_forward`): decided while serve waits for the agents, recorded, and forcible
with ``--port-forward``. The ``kubernetes`` package is an optional extra, imported only here,
inside the functions that talk to a cluster.
"""

from __future__ import annotations

import errno
import os
import socket
import threading
import time
import uuid
from pathlib import Path
from typing import TYPE_CHECKING, Any, Dict, List, Optional, Set, Tuple

from ...errors import OptionError, PlanError, SchedulerError
from ..agents import wait_for_agents
from ..base import HostRecord, Liveness, Option, Plan, Probe, Progress, Reservation, ReservationRecord, ReserveRequest, \
    Scheduler
from . import manifests
from .manifests import RESERVATION_LABEL

if TYPE_CHECKING:
    from ...runtime.keys import Keys

INSTALL_HINT = "the kubernetes scheduler needs the kubernetes client: pip install 'monarch-cli[kubernetes]'"
#: How long pods may take to run and their agents to listen (image pulls, torch import).
AGENT_START_TIMEOUT = 600.0
#: How long every pod may stay Unschedulable before serve gives up (an autoscaler may add nodes).
UNSCHEDULABLE_GRACE = 120.0
RELEASE_TIMEOUT = 120.0
#: Container waiting reasons that will not resolve by waiting.
#: How the client reaches the agents: pod IPs if it can, else port-forwards; or always one way.
PORT_FORWARD_MODES = ("auto", "always", "never")
#: How often serve asks for a port-forward to a pod whose agent does not answer yet.
FORWARD_PROBE_INTERVAL = 0.5
_TERMINAL_WAITING = {"ErrImagePull", "ImagePullBackOff", "InvalidImageName", "ErrImageNeverPull",
                     "CreateContainerConfigError", "CreateContainerError", "CrashLoopBackOff"}


def _client_modules() -> Any:
    try:
        import kubernetes  # noqa: F401 - the optional extra
    except ImportError:
        raise SchedulerError(INSTALL_HINT) from None
    return kubernetes


_API_CACHE: Dict[Tuple[Any, ...], Tuple[Any, Any]] = {}
_API_LOCK = threading.Lock()


def _apis(data: Dict[str, Any]) -> Tuple[Any, Any]:
    """CoreV1Api and BatchV1Api for the plan's kubeconfig and context (in-cluster config when inside a pod);
    made once per process (a command probes, lists and forwards with the same ones)."""
    _client_modules()
    incluster = not data.get("kubeconfig") and not data.get("context") and \
        bool(os.environ.get("KUBERNETES_SERVICE_HOST"))
    key = (data.get("kubeconfig"), data.get("context"), incluster, os.environ.get("KUBECONFIG"))
    with _API_LOCK:
        if key not in _API_CACHE:
            _API_CACHE[key] = _load_apis(data, incluster)
        return _API_CACHE[key]


def _load_apis(data: Dict[str, Any], incluster: bool) -> Tuple[Any, Any]:
    from kubernetes import client, config

    if data.get("kubeconfig") and not Path(data["kubeconfig"]).expanduser().is_file():
        raise SchedulerError(f"--kubeconfig {data['kubeconfig']} does not exist")
    try:
        if incluster:
            config.load_incluster_config()
            api = client.ApiClient()
        else:
            api = config.new_client_from_config(config_file=data.get("kubeconfig"), context=data.get("context"))
    except Exception as e:  # noqa: BLE001 - ConfigException, YAML errors, a bad file: the user's to fix
        where = data.get("kubeconfig") or os.environ.get("KUBECONFIG") or "~/.kube/config"
        first = " ".join(str(e).split())[:300] or type(e).__name__
        raise SchedulerError(f"cannot load the Kubernetes configuration ({where}): {first}") from None
    return client.CoreV1Api(api), client.BatchV1Api(api)


def _api_error(e: Exception, what: str) -> SchedulerError:
    """One line from an ApiException (its Status message) or a connection failure."""
    import json

    body = getattr(e, "body", None)
    message = ""
    if body:
        try:
            message = json.loads(body).get("message", "")
        except (ValueError, AttributeError):
            message = str(body)[:200]
    status = getattr(e, "status", None)
    if status is None:
        return SchedulerError(f"{what}: cannot reach the Kubernetes API ({type(e).__name__}: {str(e)[:200]})")
    return SchedulerError(f"{what}: {message or getattr(e, 'reason', '')} (HTTP {status})")


class KubernetesScheduler(Scheduler):
    name = "kubernetes"
    options = (
        Option("image", str, help="The container image; it must hold this monarch-cli version (required)."),
        Option("namespace", str, default="default", help="The namespace (default: default)."),
        Option("context", str, help="The kubeconfig context (default: the current one)."),
        Option("kubeconfig", str, help="The kubeconfig file (default: $KUBECONFIG or ~/.kube/config)."),
        Option("gpus_per_node", int, help="nvidia.com/gpu per pod (requests = limits)."),
        Option("cpu", str, help="CPU per pod, e.g. 8 or 500m (requests = limits)."),
        Option("memory", str, help="Memory per pod, e.g. 64Gi (requests = limits)."),
        Option("queue", str, help="Kueue LocalQueue: labels the Job and creates it suspended for Kueue to admit."),
        Option("label", list, help="key=value label on the Job and its pods (repeatable)."),
        Option("annotation", list, help="key=value annotation on the pods, e.g. Kueue topology (repeatable)."),
        Option("pod_template", str, help="A pod template file (YAML/JSON) merged under ours: volumes, tolerations..."),
        Option("service_account", str, help="The pods' service account."),
        Option("time", str, help="Wall-clock limit: activeDeadlineSeconds (MM, HH:MM:SS, D-HH:MM:SS, 2h)."),
        Option("validate", bool, default=False, help="Also have the API server validate the manifests (dry run)."),
        Option("port_forward", str, default="auto",
               help="Reach the agents through a port-forward per pod over the Kubernetes API: auto (when pod IPs "
                    "are not reachable from here), always, never."),
    )

    # ---------------------------------------------------------------- planning
    def plan(self, request: ReserveRequest, workdir: Path) -> Plan:
        opts = self.check_options(request.options)
        if request.hosts < 1:
            raise OptionError(f"--hosts must be at least 1, not {request.hosts}")
        mode = opts.get("port_forward") or "auto"
        if mode not in PORT_FORWARD_MODES:
            raise OptionError(f"--port-forward takes {', '.join(PORT_FORWARD_MODES)}, not {mode!r}")
        rid = f"monarch-{uuid.uuid4().hex[:8]}"
        built = manifests.build(rid, request.hosts, opts, agent_port=request.agent_port,
                                port_range=request.port_range, preload=request.preload)
        data = {**{k: v for k, v in built.items()}, "context": opts.get("context"),
                "kubeconfig": opts.get("kubeconfig"), "hosts": request.hosts, "port_forward": mode}
        ns = built["namespace"]
        steps = [f"create Secret {ns}/{built['secret']}: the reservation keys (data: {manifests.REDACTED}), mounted "
                 f"read-only at {manifests.KEYS_DIR}",
                 f"create headless Service {ns}/{built['service']}",
                 f"create Indexed Job {ns}/{rid}: {request.hosts} pod(s), one host agent each on port "
                 f"{built['agent_port']}" + (", suspended for Kueue" if opts.get("queue") else ""),
                 "watch the pods until every one runs and its agent answers (host rank = completion index)",
                 {"auto": "reach each agent at its pod IP, or through a port-forward over the API if pod IPs are "
                          "not reachable from here",
                  "always": "reach each agent through a port-forward over the API",
                  "never": "reach each agent at its pod IP"}[mode]]
        if opts.get("validate"):
            self._validate(data)
            steps.append("validated by the API server (server-side dry run)")
        where = f"context {opts['context']}" if opts.get("context") else "the current kubeconfig context"
        summary = f"an Indexed Job of {request.hosts} host agent pod(s) in namespace {ns} ({where})"
        return Plan(self.name, rid, request.hosts, list(request.command), str(workdir.resolve()), summary, steps,
                    artifacts={"manifests": manifests.render(built["manifests"])}, options=opts, data=data)

    def _validate(self, data: Dict[str, Any]) -> None:
        core, batch = _apis(data)
        for m in data["manifests"]:
            body = manifests.with_keys(m, "validation placeholder") if m["kind"] == "Secret" else m
            try:
                self._create(core, batch, body, dry_run="All")
            except SchedulerError:
                raise
            except Exception as e:  # noqa: BLE001 - ApiException or a connection error: one line
                raise _api_error(e, f"the API server rejects the {m['kind']}") from None

    @staticmethod
    def _create(core: Any, batch: Any, body: Dict[str, Any], dry_run: Optional[str] = None) -> None:
        ns = body["metadata"]["namespace"]
        kw = {"dry_run": dry_run} if dry_run else {}
        create = {"Secret": core.create_namespaced_secret, "Service": core.create_namespaced_service,
                  "Job": batch.create_namespaced_job}[body["kind"]]
        create(ns, body, **kw)

    # ---------------------------------------------------------------- reserving
    def reserve(self, plan: Plan, keys: "Keys", progress: Progress) -> Reservation:
        self.check_plan(plan)
        data = plan.data
        try:
            objects = list(data["manifests"])
            ns, job, hosts, port = data["namespace"], data["job"], int(data["hosts"]), int(data["agent_port"])
        except (KeyError, TypeError, ValueError) as e:
            raise PlanError(f"malformed kubernetes plan ({type(e).__name__}: {e}); make a new one with --dry-run") \
                from None
        core, batch = _apis(data)
        record = {k: data.get(k) for k in ("namespace", "job", "secret", "service", "context", "kubeconfig")}
        record["options"] = {k: v for k, v in plan.options.items() if k != "validate"}
        try:
            for m in objects:
                body = manifests.with_keys(m, keys.encode()) if m["kind"] == "Secret" else m
                progress(f"creating {m['kind']} {ns}/{m['metadata']['name']}")
                try:
                    self._create(core, batch, body)
                except Exception as e:  # noqa: BLE001 - ApiException or a connection error: one line
                    raise _api_error(e, f"cannot create {m['kind']} {ns}/{m['metadata']['name']}") from None
            watch = _PodWatch(core, batch, ns, job, hosts, port, progress, data.get("port_forward") or "auto")
            names = [f"{job}-{i}" for i in range(hosts)]
            found = wait_for_agents(watch.discover, names, progress, timeout=AGENT_START_TIMEOUT,
                                    check=watch.check, label="pods running with agents up", interval=0.05)
        except BaseException:
            try:  # leave nothing behind; the first error is the one to report
                _delete_all(core, batch, record, wait=True)
            except SchedulerError:
                pass
            raise
        pods = watch.pod_names()
        record["pods"] = [pods.get(i, "") for i in range(hosts)]
        record["reach"] = watch.reach or "direct"
        return Reservation(plan.reservation_id, [HostRecord(h.name, h.agent, None, h.node_rank) for h in found],
                           {"kubernetes": record})

    # ---------------------------------------------------------------- the reservation
    def can_serve(self, reservation: ReservationRecord, request: ReserveRequest) -> Optional[str]:
        """Same number of pods and the same options (image, resources, labels...) as asked for now."""
        why = super().can_serve(reservation, request)
        had = (reservation.scheduler_data.get("kubernetes") or {}).get("options") or {}
        asked = {k: v for k, v in self.check_options(request.options).items() if k != "validate"}
        if why is None and asked != had:
            diff = sorted(k for k in set(had) | set(asked) if had.get(k) != asked.get(k))
            why = "it was made with other options: " + ", ".join(
                f"--{k.replace('_', '-')} {had.get(k, '(unset)')}, not {asked.get(k, '(unset)')}" for k in diff)
        return why

    def agent_addresses(self, reservation: ReservationRecord) -> List[str]:
        """Out of the cluster: a loopback port of this process per pod, port-forwarded to its agent."""
        record = reservation.scheduler_data.get("kubernetes") or {}
        if record.get("reach") != "port-forward":
            return super().agent_addresses(reservation)
        from .port_forward import forward

        core, _ = _apis(record)
        return [forward(core, record["namespace"], pod, int(h.agent.rpartition(":")[2])) if pod else h.agent
                for h, pod in zip(reservation.hosts, record.get("pods") or [""] * len(reservation.hosts))]

    def dead_hosts(self, reservation: ReservationRecord) -> List[str]:
        """Hosts whose pod is gone or not running, from one list of the pods: `status` need not wait
        for their agents' silence (through a port-forward, a deleted pod's forward is refused)."""
        record = reservation.scheduler_data.get("kubernetes") or {}
        pods = record.get("pods") or []
        if not record.get("job") or len(pods) != len(reservation.hosts):
            return []
        try:
            core, _ = _apis(record)
            listed = core.list_namespaced_pod(record["namespace"],
                                              label_selector=f"{RESERVATION_LABEL}={record['job']}").items
        except Exception:  # noqa: BLE001 - cannot tell: the agents' ping decides
            return []
        running = {p.metadata.name for p in listed
                   if p.status and p.status.phase == "Running" and not p.metadata.deletion_timestamp}
        return [h.name for h, pod in zip(reservation.hosts, pods) if pod not in running]

    def release(self, reservation: ReservationRecord) -> None:
        record = reservation.scheduler_data.get("kubernetes") or {}
        if record.get("job"):
            core, batch = _apis(record)
            _delete_all(core, batch, record, wait=True)

    def probe(self, reservation: ReservationRecord) -> Probe:
        """From the API server: GONE when the Job is deleted, failed or past its deadline; UNKNOWN when unreachable."""
        record = reservation.scheduler_data.get("kubernetes") or {}
        try:
            core, batch = _apis(record)
            job = batch.read_namespaced_job(record["job"], record["namespace"])
        except SchedulerError as e:
            return Probe(Liveness.UNKNOWN, str(e))
        except Exception as e:  # noqa: BLE001
            if getattr(e, "status", None) == 404:
                return Probe(Liveness.GONE, f"the Job {record.get('namespace')}/{record.get('job')} was deleted")
            return Probe(Liveness.UNKNOWN, str(_api_error(e, "cannot read the Job")))
        why = _job_ended(job)
        if why:
            return Probe(Liveness.GONE, why)
        try:
            pods = core.list_namespaced_pod(record["namespace"], label_selector=f"{RESERVATION_LABEL}={record['job']}")
        except Exception as e:  # noqa: BLE001
            return Probe(Liveness.UNKNOWN, str(_api_error(e, "cannot list the pods")))
        for pod in pods.items:
            if pod.status and pod.status.phase in ("Failed", "Succeeded"):
                return Probe(Liveness.GONE, f"pod {pod.metadata.name} {pod.status.phase.lower()}: {_exit_reason(pod)}")
        return Probe(Liveness.ALIVE)

    def describe(self, reservation: ReservationRecord) -> Dict[str, Any]:
        record = reservation.scheduler_data.get("kubernetes") or {}
        return {"kubernetes": {k: record.get(k) for k in ("namespace", "job", "secret", "service", "context", "pods",
                                                          "reach")}}

    def status_lines(self, reservation: ReservationRecord) -> List[str]:
        record = reservation.scheduler_data.get("kubernetes") or {}
        ns, name = record.get("namespace"), record.get("job")
        try:
            core, batch = _apis(record)
            job = batch.read_namespaced_job(name, ns)
            pods = core.list_namespaced_pod(ns, label_selector=f"{RESERVATION_LABEL}={name}").items
        except Exception as e:  # noqa: BLE001 - status shows what it can
            return [f"Job {ns}/{name}: {getattr(e, 'reason', None) or e}"]
        st = job.status
        lines = [f"Job {ns}/{name}: active {st.active or 0}, succeeded {st.succeeded or 0}, failed {st.failed or 0}"
                 + (f"; {_job_ended(job)}" if _job_ended(job) else "")]
        if record.get("reach") == "port-forward":
            lines.append("agents reached through a port-forward per pod over the Kubernetes API")
        for pod in sorted(pods, key=lambda p: int((p.metadata.labels or {}).get(manifests.INDEX_LABEL, 0))):
            why = _exit_reason(pod) if pod.status.phase in ("Failed", "Succeeded") else _pending_reason(pod)
            lines.append(f"pod {pod.metadata.name}: {pod.status.phase}, IP {pod.status.pod_ip or '-'}, node "
                         f"{pod.spec.node_name or '-'}" + (f" ({why})" if why else ""))
        return lines


class _PodWatch:
    """The reservation's pods, kept current by watching them from the last resourceVersion seen."""

    def __init__(self, core: Any, batch: Any, namespace: str, job: str, hosts: int, port: int,
                 progress: Progress, port_forward: str = "auto") -> None:
        self.core, self.batch, self.ns, self.job, self.hosts, self.port = core, batch, namespace, job, hosts, port
        self.progress, self.said = progress, ""
        self.mode = port_forward
        #: "direct" or "port-forward" once decided (the first agent to answer decides for all).
        self.reach: Optional[str] = {"always": "port-forward", "never": "direct"}.get(port_forward)
        self.next_forward: Dict[str, float] = {}
        self.forward_errors: Set[str] = set()
        self.events_read = 0.0
        self.selector = f"{RESERVATION_LABEL}={job}"
        self.pods: Dict[str, Any] = {}
        self.version: Optional[str] = None
        self.unschedulable_since: Optional[float] = None
        self.answered: Dict[str, str] = {}
        self.refreshed = 0.0

    def _refresh(self) -> None:
        from kubernetes import watch

        try:
            if self.version is None:
                listed = self.core.list_namespaced_pod(self.ns, label_selector=self.selector)
                self.pods = {p.metadata.name: p for p in listed.items}
                self.version = listed.metadata.resource_version
                return
            w = watch.Watch()
            for event in w.stream(self.core.list_namespaced_pod, self.ns, label_selector=self.selector,
                                  resource_version=self.version, timeout_seconds=1, _request_timeout=10):
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
            raise _api_error(e, f"cannot watch the pods of Job {self.ns}/{self.job}") from None

    def _by_index(self) -> Dict[int, Any]:
        out = {}
        for pod in self.pods.values():
            index = (pod.metadata.labels or {}).get(manifests.INDEX_LABEL)
            if index is not None and not pod.metadata.deletion_timestamp:
                out[int(index)] = pod
        return out

    def pod_names(self) -> Dict[int, str]:
        return {i: p.metadata.name for i, p in self._by_index().items()}

    def discover(self) -> Dict[str, str]:
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
        """Whether the pod's agent answers: at its IP, else (auto, IP unreachable; always) through a port-forward."""
        if self.reach != "port-forward":
            how, why = _dial(ip, self.port)
            if how == "open":
                self.reach = "direct"
                return True
            if self.reach == "direct" and how == "unreachable":
                raise SchedulerError(f"pod {pod} (host {index}): its IP {ip} is not reachable from here ({why}); "
                                     "use --port-forward auto or always from outside the cluster")
            if self.reach == "direct" or how == "refused":  # reachable, the agent is not listening yet
                return False
        if time.monotonic() < self.next_forward.get(pod, 0.0):
            return False
        self.next_forward[pod] = time.monotonic() + FORWARD_PROBE_INTERVAL
        from .port_forward import agent_answers

        answered, why = agent_answers(self.core, self.ns, pod, self.port)
        if answered and self.reach is None:
            self.reach = "port-forward"
            self.progress("pod IPs are not reachable from here: each agent is reached through a port-forward over "
                          "the Kubernetes API")
        elif why and why not in self.forward_errors:  # once each: pods alternate
            self.forward_errors.add(why)
            self.progress(f"port-forward to pod {pod}: {why}")
        return answered

    def check(self) -> None:
        """Raise when waiting is pointless: the Job failed, a pod ended or cannot pull its image."""
        try:
            job = self.batch.read_namespaced_job(self.job, self.ns)
        except Exception as e:  # noqa: BLE001
            if getattr(e, "status", None) == 404:
                raise SchedulerError(f"the Job {self.ns}/{self.job} was deleted while starting") from None
            raise _api_error(e, f"cannot read Job {self.ns}/{self.job}") from None
        why = _job_ended(job)
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
        unschedulable = [f"pod {p.metadata.name}: {_pending_reason(p)}" for _, p in sorted(self._by_index().items())
                         if _pending_reason(p).startswith("Unschedulable")]
        if unschedulable:
            self._say(f"Pending: {unschedulable[0]}" + (f" (and {len(unschedulable) - 1} more)"
                                                         if len(unschedulable) > 1 else ""))
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
                self.ns, field_selector=f"involvedObject.kind=Job,involvedObject.name={self.job}").items
        except Exception:  # noqa: BLE001 - events are a hint; RBAC may not allow them
            return ""
        warnings = [e for e in events if e.type == "Warning" and e.reason == "FailedCreate"]
        return " ".join((warnings[-1].message or "").split())[:300] if warnings else ""

    def _check_pods(self) -> None:
        """Raise for a pod that ended or cannot pull its image."""
        for index, pod in sorted(self._by_index().items()):
            phase = pod.status.phase if pod.status else None
            if phase in ("Failed", "Succeeded"):
                raise SchedulerError(f"pod {pod.metadata.name} (host {index}) {phase.lower()} during start-up: "
                                     f"{_exit_reason(pod)}")
            for cs in (pod.status.container_statuses or []) if pod.status else []:
                waiting = cs.state.waiting if cs.state else None
                if waiting and waiting.reason in _TERMINAL_WAITING:
                    raise SchedulerError(f"pod {pod.metadata.name} (host {index}): {waiting.reason}: "
                                         f"{(waiting.message or '').strip()[:300]}")

    def _say(self, message: str) -> None:
        if message != self.said:
            self.progress(message)
            self.said = message


def _dial(ip: str, port: int, timeout: float = 0.5) -> Tuple[str, str]:
    """Try the pod IP's port: ("open"|"refused"|"unreachable"|"timeout", why)."""
    try:
        with socket.create_connection((ip, port), timeout=timeout):
            return "open", ""
    except socket.timeout:
        return "timeout", f"no answer in {timeout} s"
    except OSError as e:
        if e.errno == errno.ECONNREFUSED:
            return "refused", e.strerror or str(e)
        if e.errno in (errno.EHOSTUNREACH, errno.ENETUNREACH, errno.EACCES, errno.EPERM):
            return "unreachable", e.strerror or str(e)
        return "timeout", e.strerror or str(e)


def _pending_reason(pod: Any) -> str:
    for cond in (pod.status.conditions or []) if pod.status else []:
        if cond.type == "PodScheduled" and cond.status == "False" and cond.reason:
            return f"{cond.reason}: {(cond.message or '').strip()}"
    return ""


def _exit_reason(pod: Any) -> str:
    statuses = [*(pod.status.init_container_statuses or []), *(pod.status.container_statuses or [])] if pod.status \
        else []
    for cs in statuses:
        term = cs.state.terminated if cs.state else None
        if term and (term.exit_code or cs is statuses[-1]):
            return (f"{cs.name}: " if cs.name != manifests.CONTAINER else "") + f"exit code {term.exit_code}" + (f" ({term.reason})" if term.reason else "") + \
                (f": {_one_line(term.message)}" if term.message else "")
    return (pod.status.reason or pod.status.message or "no reason given") if pod.status else "no status"


def _one_line(text: str, lines: int = 3) -> str:
    """The last few lines of a container's message (its log tail), joined into one."""
    return " | ".join([ln.strip() for ln in text.strip().splitlines() if ln.strip()][-lines:])[-400:]


def _job_ended(job: Any) -> str:
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


def _delete_all(core: Any, batch: Any, record: Dict[str, Any], *, wait: bool) -> None:
    """Delete the Job (foreground: its pods first), the Secret and the Service; wait until no pod is left."""
    from kubernetes import client

    ns = record["namespace"]
    calls = [(batch.delete_namespaced_job, record.get("job")), (core.delete_namespaced_secret, record.get("secret")),
             (core.delete_namespaced_service, record.get("service"))]
    errors = []
    for delete, name in calls:
        if not name:
            continue
        try:
            delete(name, ns, body=client.V1DeleteOptions(propagation_policy="Foreground"))
        except Exception as e:  # noqa: BLE001
            if getattr(e, "status", None) != 404:
                errors.append(str(_api_error(e, f"cannot delete {name}")))
    if errors:
        raise SchedulerError(errors[0])
    deadline = time.monotonic() + RELEASE_TIMEOUT
    while wait and record.get("job"):
        try:
            left = core.list_namespaced_pod(ns, label_selector=f"{RESERVATION_LABEL}={record['job']}").items
        except Exception as e:  # noqa: BLE001
            raise _api_error(e, "cannot list the pods left") from None
        if not left:
            return
        if time.monotonic() > deadline:
            raise SchedulerError(f"{len(left)} pod(s) of Job {ns}/{record['job']} still exist after "
                                 f"{RELEASE_TIMEOUT:.0f} s: {', '.join(p.metadata.name for p in left)}")
        time.sleep(0.1)


__all__ = ["KubernetesScheduler", "INSTALL_HINT"]
