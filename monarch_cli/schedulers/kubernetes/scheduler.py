"""The kubernetes backend: an Indexed Job of host agents, no operator, no CRD.

``plan()`` builds every manifest (:mod:`.manifests`) without contacting a cluster;
``reserve(plan)`` creates the Secret (the reservation keys, mounted read-only), the headless
Service and the Job, then watches the pods (:mod:`.pods`): each pod's stdlib-only bootstrap
gets our bundle from the client (:mod:`..bootstrap`: any image with python3 will do) and execs
the agent; host rank = completion index, ready once every pod's agent answers. Pending pods say why (Unschedulable, image pulls);
terminal reasons are one-line errors. ``release`` deletes the Job (foreground propagation),
the Secret and the Service and waits until no pod is left. The client reaches agents by pod
IP when it can (a client inside the cluster), else through one port-forward per pod over the
API (:mod:`.port_forward`): decided while serve waits for the agents, recorded, and forcible
with ``--port-forward``. The ``kubernetes`` package is an optional extra (:mod:`.api`), imported
only inside the functions that talk to a cluster.
"""

from __future__ import annotations

import time
import uuid
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ...errors import OptionError, PlanError, SchedulerError
from ...runtime.launch import bundle
from .. import bootstrap
from ..agents import wait_for_agents
from ..base import (
    HostRecord,
    Liveness,
    Option,
    Plan,
    Probe,
    Progress,
    Reservation,
    ReservationRecord,
    ReserveRequest,
    Scheduler,
)
from . import manifests
from .api import INSTALL_HINT, api_error, apis
from .manifests import RESERVATION_LABEL
from .pods import PodWatch, exit_reason, job_ended, pending_reason

if TYPE_CHECKING:
    from ...runtime.transport.keys import Keys

#: How long pods may take to run and their agents to listen (image pulls, torch import).
AGENT_START_TIMEOUT = 600.0
RELEASE_TIMEOUT = 120.0
#: How the client reaches the agents: pod IPs if it can, else port-forwards; or always one way.
PORT_FORWARD_MODES = ("auto", "always", "never")
DEFAULT_PYTHON = "python3"


class KubernetesScheduler(Scheduler):
    name = "kubernetes"
    options = (
        Option(
            "image",
            str,
            help="The container image (required): any with python3 >= "
            f"{'.'.join(map(str, bundle.MIN_PYTHON))} and your script's packages (torch); the client ships its own "
            "code to the pods.",
        ),
        Option("python", str, default=DEFAULT_PYTHON, help=f"The image's interpreter (default {DEFAULT_PYTHON})."),
        Option(
            "wheelhouse",
            str,
            help="A directory of wheels of our runtime dependencies for the pods' platform and Python "
            "(default: this client's package index, downloaded once into a cache).",
        ),
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
        Option(
            "port_forward",
            str,
            default="auto",
            help="Reach the agents through a port-forward per pod over the Kubernetes API: auto (when pod IPs "
            "are not reachable from here), always, never.",
        ),
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
        python = opts.get("python") or DEFAULT_PYTHON
        agent = request.agent_command(
            rid,
            python=python,
            name=f"{rid}-$(JOB_COMPLETION_INDEX)",
            port=request.agent_port or manifests.DEFAULT_AGENT_PORT,  # a Service needs a known port
        )
        built = manifests.build(rid, request.hosts, opts, agent)
        data = {
            **{k: v for k, v in built.items()},
            "context": opts.get("context"),
            "kubeconfig": opts.get("kubeconfig"),
            "hosts": request.hosts,
            "port_forward": mode,
            "wheelhouse": opts.get("wheelhouse"),
            "bundle": bundle.code_summary(),
        }
        ns = built["namespace"]
        _, ship = bundle.plan_lines(python, bootstrap.BUNDLES_DIR, opts.get("wheelhouse"))
        steps = [
            f"create Secret {ns}/{built['secret']}: the reservation keys (data: {manifests.REDACTED}), mounted "
            f"read-only at {manifests.KEYS_DIR}",
            f"create headless Service {ns}/{built['service']}",
            f"create Indexed Job {ns}/{rid}: {request.hosts} pod(s), one host agent each on port "
            f"{built['agent_port']}" + (", suspended for Kueue" if opts.get("queue") else ""),
            f"each pod runs a stdlib-only bootstrap ({python} -c ...; the image needs nothing of ours) that checks "
            f"for Python >= {'.'.join(map(str, bundle.MIN_PYTHON))}, listens on port {built['agent_port']} and "
            "tells the client its platform and the bundle parts it holds",
            {
                "auto": "watch the pods; reach each one at its pod IP, or through a port-forward over the API if pod "
                "IPs are not reachable from here",
                "always": "watch the pods; reach each one through a port-forward over the API",
                "never": "watch the pods; reach each one at its pod IP",
            }[mode],
            "over that connection, as each pod runs: " + ship,
            "the bundle goes to each pod authenticated (an HMAC keyed by the reservation's Secret, over a nonce of "
            f"the pod's), each zip checked against its SHA-256, unzipped into {bootstrap.BUNDLES_DIR} (an emptyDir, "
            "0700); then the bootstrap execs the agent from there, on the same port; no registry, no image build",
            "wait until every agent answers there (host rank = completion index)",
        ]
        if opts.get("validate"):
            self._validate(data)
            steps.append("validated by the API server (server-side dry run)")
        where = f"context {opts['context']}" if opts.get("context") else "the current kubeconfig context"
        summary = f"an Indexed Job of {request.hosts} host agent pod(s) in namespace {ns} ({where})"
        return Plan(
            self.name,
            rid,
            request.hosts,
            list(request.command),
            str(workdir.resolve()),
            summary,
            steps,
            artifacts={"manifests": manifests.render(built["manifests"])},
            options=opts,
            data=data,
        )

    def _validate(self, data: dict[str, Any]) -> None:
        core, batch = apis(data)
        for m in data["manifests"]:
            body = manifests.with_keys(m, "validation placeholder") if m["kind"] == "Secret" else m
            try:
                self._create(core, batch, body, dry_run="All")
            except SchedulerError:
                raise
            except Exception as e:  # noqa: BLE001 - ApiException or a connection error: one line
                raise api_error(e, f"the API server rejects the {m['kind']}") from None

    @staticmethod
    def _create(core: Any, batch: Any, body: dict[str, Any], dry_run: str | None = None) -> None:
        ns = body["metadata"]["namespace"]
        kw = {"dry_run": dry_run} if dry_run else {}
        create = {
            "Secret": core.create_namespaced_secret,
            "Service": core.create_namespaced_service,
            "Job": batch.create_namespaced_job,
        }[body["kind"]]
        create(ns, body, **kw)

    # ---------------------------------------------------------------- reserving
    def reserve(self, plan: Plan, keys: Keys, progress: Progress) -> Reservation:
        self.check_plan(plan)
        data = plan.data
        try:
            objects = list(data["manifests"])
            ns, job, hosts, port = data["namespace"], data["job"], int(data["hosts"]), int(data["agent_port"])
        except (KeyError, TypeError, ValueError) as e:
            raise PlanError(
                f"malformed kubernetes plan ({type(e).__name__}: {e}); make a new one with --dry-run"
            ) from None
        core, batch = apis(data)
        record = {k: data.get(k) for k in ("namespace", "job", "secret", "service", "context", "kubeconfig")}
        record["options"] = {k: v for k, v in plan.options.items() if k != "validate"}
        try:
            for m in objects:
                body = manifests.with_keys(m, keys.encode()) if m["kind"] == "Secret" else m
                progress(f"creating {m['kind']} {ns}/{m['metadata']['name']}")
                try:
                    self._create(core, batch, body)
                except Exception as e:  # noqa: BLE001 - ApiException or a connection error: one line
                    raise api_error(e, f"cannot create {m['kind']} {ns}/{m['metadata']['name']}") from None
            watch = PodWatch(
                core,
                batch,
                ns,
                job,
                hosts,
                port,
                progress,
                data.get("port_forward") or "auto",
                key=bootstrap.hmac_key(keys.encode()),
                wheelhouse=data.get("wheelhouse"),
            )
            names = [f"{job}-{i}" for i in range(hosts)]
            found = wait_for_agents(
                watch.discover,
                names,
                progress,
                timeout=AGENT_START_TIMEOUT,
                check=watch.check,
                label="pods running with agents up",
                interval=0.05,
            )
        except BaseException:
            try:  # leave nothing behind; the first error is the one to report
                _delete_all(core, batch, record, wait=True)
            except SchedulerError:
                pass
            raise
        pods = watch.pod_names()
        record["pods"] = [pods.get(i, "") for i in range(hosts)]
        record["reach"] = watch.reach or "direct"
        record["bundle"] = [watch.shipped.get(i) for i in range(hosts)]
        return Reservation(
            plan.reservation_id, [HostRecord(h.name, h.agent, None, h.node_rank) for h in found], {"kubernetes": record}
        )

    # ---------------------------------------------------------------- the reservation
    def can_serve(self, reservation: ReservationRecord, request: ReserveRequest) -> str | None:
        """Same number of pods and the same options (image, resources, labels...) as asked for now."""
        why = super().can_serve(reservation, request)
        had = (reservation.scheduler_data.get("kubernetes") or {}).get("options") or {}
        asked = {k: v for k, v in self.check_options(request.options).items() if k != "validate"}
        if why is None and asked != had:
            diff = sorted(k for k in set(had) | set(asked) if had.get(k) != asked.get(k))
            why = "it was made with other options: " + ", ".join(
                f"--{k.replace('_', '-')} {had.get(k, '(unset)')}, not {asked.get(k, '(unset)')}" for k in diff
            )
        return why

    def agent_addresses(self, reservation: ReservationRecord) -> list[str]:
        """Out of the cluster: a loopback port of this process per pod, port-forwarded to its agent."""
        record = reservation.scheduler_data.get("kubernetes") or {}
        if record.get("reach") != "port-forward":
            return super().agent_addresses(reservation)
        from .port_forward import forward

        core, _ = apis(record)
        return [
            forward(core, record["namespace"], pod, int(h.agent.rpartition(":")[2])) if pod else h.agent
            for h, pod in zip(reservation.hosts, record.get("pods") or [""] * len(reservation.hosts))
        ]

    def dead_hosts(self, reservation: ReservationRecord) -> list[str]:
        """Hosts whose pod is gone or not running, from one list of the pods: `status` need not wait
        for their agents' silence (through a port-forward, a deleted pod's forward is refused)."""
        record = reservation.scheduler_data.get("kubernetes") or {}
        pods = record.get("pods") or []
        if not record.get("job") or len(pods) != len(reservation.hosts):
            return []
        try:
            core, _ = apis(record)
            listed = core.list_namespaced_pod(
                record["namespace"], label_selector=f"{RESERVATION_LABEL}={record['job']}"
            ).items
        except Exception:  # noqa: BLE001 - cannot tell: the agents' ping decides
            return []
        running = {
            p.metadata.name
            for p in listed
            if p.status and p.status.phase == "Running" and not p.metadata.deletion_timestamp
        }
        return [h.name for h, pod in zip(reservation.hosts, pods) if pod not in running]

    def release(self, reservation: ReservationRecord) -> None:
        record = reservation.scheduler_data.get("kubernetes") or {}
        if record.get("job"):
            core, batch = apis(record)
            _delete_all(core, batch, record, wait=True)

    def probe(self, reservation: ReservationRecord) -> Probe:
        """From the API server: GONE when the Job is deleted, failed or past its deadline; UNKNOWN when unreachable."""
        record = reservation.scheduler_data.get("kubernetes") or {}
        try:
            core, batch = apis(record)
            job = batch.read_namespaced_job(record["job"], record["namespace"])
        except SchedulerError as e:
            return Probe(Liveness.UNKNOWN, str(e))
        except Exception as e:  # noqa: BLE001
            if getattr(e, "status", None) == 404:
                return Probe(Liveness.GONE, f"the Job {record.get('namespace')}/{record.get('job')} was deleted")
            return Probe(Liveness.UNKNOWN, str(api_error(e, "cannot read the Job")))
        why = job_ended(job)
        if why:
            return Probe(Liveness.GONE, why)
        try:
            pods = core.list_namespaced_pod(record["namespace"], label_selector=f"{RESERVATION_LABEL}={record['job']}")
        except Exception as e:  # noqa: BLE001
            return Probe(Liveness.UNKNOWN, str(api_error(e, "cannot list the pods")))
        for pod in pods.items:
            if pod.status and pod.status.phase in ("Failed", "Succeeded"):
                return Probe(Liveness.GONE, f"pod {pod.metadata.name} {pod.status.phase.lower()}: {exit_reason(pod)}")
        return Probe(Liveness.ALIVE)

    def describe(self, reservation: ReservationRecord) -> dict[str, Any]:
        record = reservation.scheduler_data.get("kubernetes") or {}
        return {
            "kubernetes": {
                k: record.get(k)
                for k in ("namespace", "job", "secret", "service", "context", "pods", "reach", "bundle")
            }
        }

    def status_lines(self, reservation: ReservationRecord) -> list[str]:
        record = reservation.scheduler_data.get("kubernetes") or {}
        ns, name = record.get("namespace"), record.get("job")
        try:
            core, batch = apis(record)
            job = batch.read_namespaced_job(name, ns)
            pods = core.list_namespaced_pod(ns, label_selector=f"{RESERVATION_LABEL}={name}").items
        except Exception as e:  # noqa: BLE001 - status shows what it can
            return [f"Job {ns}/{name}: {getattr(e, 'reason', None) or e}"]
        st = job.status
        lines = [
            f"Job {ns}/{name}: active {st.active or 0}, succeeded {st.succeeded or 0}, failed {st.failed or 0}"
            + (f"; {job_ended(job)}" if job_ended(job) else "")
        ]
        if record.get("reach") == "port-forward":
            lines.append("agents reached through a port-forward per pod over the Kubernetes API")
        for pod in sorted(pods, key=lambda p: int((p.metadata.labels or {}).get(manifests.INDEX_LABEL, 0))):
            why = exit_reason(pod) if pod.status.phase in ("Failed", "Succeeded") else pending_reason(pod)
            lines.append(
                f"pod {pod.metadata.name}: {pod.status.phase}, IP {pod.status.pod_ip or '-'}, node "
                f"{pod.spec.node_name or '-'}" + (f" ({why})" if why else "")
            )
        return lines


def _delete_all(core: Any, batch: Any, record: dict[str, Any], *, wait: bool) -> None:
    """Delete the Job (foreground: its pods first), the Secret and the Service; wait until no pod is left."""
    from kubernetes import client

    ns = record["namespace"]
    calls = [
        (batch.delete_namespaced_job, record.get("job")),
        (core.delete_namespaced_secret, record.get("secret")),
        (core.delete_namespaced_service, record.get("service")),
    ]
    errors = []
    for delete, name in calls:
        if not name:
            continue
        try:
            delete(name, ns, body=client.V1DeleteOptions(propagation_policy="Foreground"))
        except Exception as e:  # noqa: BLE001
            if getattr(e, "status", None) != 404:
                errors.append(str(api_error(e, f"cannot delete {name}")))
    if errors:
        raise SchedulerError(errors[0])
    deadline = time.monotonic() + RELEASE_TIMEOUT
    while wait and record.get("job"):
        try:
            left = core.list_namespaced_pod(ns, label_selector=f"{RESERVATION_LABEL}={record['job']}").items
        except Exception as e:  # noqa: BLE001
            raise api_error(e, "cannot list the pods left") from None
        if not left:
            return
        if time.monotonic() > deadline:
            raise SchedulerError(
                f"{len(left)} pod(s) of Job {ns}/{record['job']} still exist after "
                f"{RELEASE_TIMEOUT:.0f} s: {', '.join(p.metadata.name for p in left)}"
            )
        time.sleep(0.1)


__all__ = ["KubernetesScheduler", "INSTALL_HINT"]
