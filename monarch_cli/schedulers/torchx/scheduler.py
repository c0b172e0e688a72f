"""``--scheduler torchx:<name>``: hosts reserved through any scheduler torchx knows.

The reservation is a torchx ``AppDef`` with one role whose ``--hosts`` replicas each run our
host agent on a fixed port (``port_base + replica id``), submitted through torchx's own
``Runner`` with the scheduler's run config (``-o`` values, then ``.torchxconfig``). The plan
holds the role as data and torchx's own dry-run print of exactly that AppDef; ``reserve``
rebuilds the same AppDef and submits it. Hosts are found through torchx's ``describe``
(replica hostnames) and the fixed ports; an agent counts as up once its port accepts a
connection. Where the replicas share the client's filesystem, keys reach them as a 0600 file
on it (``$MONARCH_KEY_FILE`` names the path; the secret is never in the AppDef) and the agent
runs from this client's code as it is. Where they do not (or with ``-o
agent_ship_bundle=true``), each replica runs the stdlib-only bootstrap and the client ships
it the zero-install bundle (:mod:`.shipping`, which also says how the keys travel). Stop
cancels the torchx app.
"""

from __future__ import annotations

import contextlib
import logging
import re
import shutil
import socket
import sys
import time
import uuid
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

from ...config import KEY_FILE_ENV, EnvSettings
from ...errors import SchedulerError
from ...runtime.launch import bundle
from .. import bootstrap
from ..agents import wait_for_agents
from ..base import (
    HostRecord,
    Liveness,
    Plan,
    Probe,
    Progress,
    Reservation,
    ReservationRecord,
    ReserveRequest,
    Scheduler,
)
from . import local_replicas, shipping
from .appdef import LOCAL_SCHEDULERS, SHARED_FILESYSTEM, AgentRole, dryrun, options_of, run_config, runopts_of

if TYPE_CHECKING:
    from ...runtime.transport.keys import Keys

_log = logging.getLogger(__name__)
PREFIX = "torchx:"
#: The agents' first port when the caller does not fix one (Monarch's workers use 26600 too).
DEFAULT_PORT_BASE = 26600
#: How long replicas may take to be scheduled and to listen (a queue may hold them longer: then say so).
AGENT_START_TIMEOUT = 300.0
_TERMINAL = ("SUCCEEDED", "FAILED", "CANCELLED")


class TorchxScheduler(Scheduler):
    """The family's base; :func:`scheduler_class_for` makes one subclass per torchx scheduler name."""

    name: ClassVar[str] = "torchx"
    #: The torchx scheduler this class submits to (``local_cwd``, ``slurm``, ``kubernetes``...).
    torchx_scheduler: ClassVar[str] = ""

    # ---------------------------------------------------------------- planning
    def plan(self, request: ReserveRequest, workdir: Path) -> Plan:
        options = self.check_options(request.options)
        sched = self.torchx_scheduler
        workdir = workdir.resolve()
        rid = f"torchx-{uuid.uuid4().hex[:8]}"
        job_dir = workdir / "torchx" / rid
        local = sched in LOCAL_SCHEDULERS
        if sched == "local_cwd" and "log_dir" not in options:
            options["log_dir"] = str(job_dir / "logs")  # torchx's default is a temp dir it deletes at exit
        if sched == "slurm" and "job_dir" not in options:
            options["job_dir"] = str(job_dir / "slurm")  # torchx's default is the cwd: keep its files with ours
        cfg = run_config(sched, options, [Path.cwd(), Path.home()])
        port_base = request.agent_port or (_free_port_run(request.hosts) if local else DEFAULT_PORT_BASE)
        shared = sched in SHARED_FILESYSTEM or bool(options.get("agent_shared_fs"))
        ship = not shared or bool(options.get("agent_ship_bundle"))
        # How the keys reach the replicas: a file on the shared filesystem, or the scheduler's own channel.
        channel = "file" if shared else shipping.KEY_CHANNELS.get(sched)
        python = options.get("agent_python") or ("python3" if ship else sys.executable)
        # The port is each replica's own (port_base + replica id, in the role's shell line), not the request's.
        agent = request.agent_command(rid, python=python, port=None).argv()
        key_file = str(job_dir / "keys") if channel == "file" else shipping.KEY_FILE_IN_CONTAINER
        env = {KEY_FILE_ENV: key_file, "PYTHONUNBUFFERED": "1"}
        if sched == "local_cwd":
            env[EnvSettings.host.var] = "127.0.0.1"
        elif sched == "kubernetes":
            env[EnvSettings.host.var] = shipping.POD_IP  # the address the agent gives its peers and ranks
        bundles_dir = None
        if ship:
            bundles_dir = {
                "file": str(job_dir / "bundles" / "host${replica_id}"),  # replicas may share a machine
                "secret": bootstrap.BUNDLES_DIR,  # the emptyDir the pods get with the Secret
            }.get(channel or "", shipping.DOCKER_BUNDLES_DIR)
        mounts = [{"src": str(job_dir / "keys"), "dst": key_file}] if channel == "bind mount" else []
        role = AgentRole(
            app_name=rid,
            replicas=request.hosts,
            python=agent[0],
            agent_args=agent[1:],
            port_base=port_base,
            env=env,
            image=options.get("agent_image"),
            cpu=options.get("agent_cpu"),
            gpu=options.get("agent_gpu"),
            mem_mb=options.get("agent_mem_mb"),
            named=local,
            bundles_dir=bundles_dir,
            mounts=mounts,
        )
        secret = shipping.secret_name(rid) if channel == "secret" else None
        offline = {**cfg, "validate_spec": False} if "validate_spec" in cfg else cfg  # planning asks no cluster
        with _runner() as runner:
            info = dryrun(runner, role, sched, offline)
            if secret:
                shipping.mount_secret(info.request, secret)
        steps = [] if channel else [shipping.no_channel(sched)]
        steps += _key_steps(channel, job_dir, secret, cfg.get("namespace") or "default")
        steps.append(
            f"submit app {rid} to torchx {sched} through torchx's Runner: role {role.replicas} x {role.shell_line()!r}"
        )
        if ship:
            wheelhouse = options.get("agent_wheelhouse")
            _, ship_line = bundle.plan_lines(python, bundles_dir or "", wheelhouse)
            steps += [
                f"each replica runs a stdlib-only bootstrap ({python} -c ...; nothing of ours on the host) on port "
                f"{port_base} + i that tells the client its platform and the bundle parts it holds",
                f"find the replicas' hosts with torchx describe; over a connection to each: {ship_line}",
                "the bundle goes authenticated (an HMAC keyed by the reservation's keys, over a nonce of the "
                f"replica's), each zip checked against its SHA-256, unzipped into {bundles_dir} (0700); then the "
                "bootstrap execs the agent from there on the same port",
            ]
        else:
            steps.append(f"find the replicas' hosts with torchx describe; agent i listens on port {port_base} + i")
        summary = f"reserve {request.hosts} host(s) as replicas of a torchx app on torchx's {sched} scheduler"
        return Plan(
            self.name,
            rid,
            request.hosts,
            list(request.command),
            str(workdir),
            summary,
            steps,
            {f"torchx {sched} dry run": str(info)},
            {k: v for k, v in options.items()},
            {
                "role": _role_json(role),
                "cfg": cfg,
                "job_dir": str(job_dir),
                "torchx_scheduler": sched,
                "shared": shared,
                "ship": ship,
                "key_channel": channel,
                "secret": secret,
                "namespace": cfg.get("namespace") or "default",
                "bundle": bundle.code_summary() if ship else None,
            },
        )

    # ----------------------------------------------------------- reserving
    def reserve(self, plan: Plan, keys: Keys, progress: Progress) -> Reservation:
        self.check_plan(plan)
        sched = self.torchx_scheduler
        channel = plan.data.get("key_channel", "file" if plan.data.get("shared") else None)
        if not channel:
            raise SchedulerError(shipping.no_channel(sched))
        role = AgentRole(**plan.data["role"])
        job_dir = Path(plan.data["job_dir"])
        job_dir.mkdir(parents=True, mode=0o700)
        data: dict[str, Any] = {"torchx_scheduler": sched, "job_dir": str(job_dir), "options": plan.options}
        secret = shipping.secret_name(role.app_name) if channel == "secret" else None
        try:
            if secret:
                progress(f"creating Secret {plan.data['namespace']}/{secret} (the reservation keys)")
                shipping.create_secret(plan.data["namespace"], secret, role.app_name, keys.encode())
                data.update(secret=secret, namespace=plan.data["namespace"])
            else:
                keys.write(job_dir / "keys")
            with _runner() as runner:
                info = dryrun(runner, role, sched, plan.data["cfg"])
                if secret:
                    shipping.mount_secret(info.request, secret)
                progress(f"submitting app {role.app_name} to torchx {sched}")
                with local_replicas.keep_signal_handlers():
                    handle = runner.schedule(info)
                data["app_handle"] = handle
                if sched == "local_cwd":
                    data["local"] = local_replicas.detach(runner, sched, handle.rpartition("/")[2])
            shipper = None
            if role.bundles_dir is not None:
                key = bootstrap.hmac_key(keys.encode())
                wheelhouse = plan.options.get("agent_wheelhouse")
                shipper = shipping.BundleShipper(key, wheelhouse, role.bundles_dir, progress)
            hosts = self._wait(data, role, progress, shipper)
            if shipper is not None:
                data["bundle"] = [shipper.shipped.get(i) for i in range(role.replicas)]
        except BaseException:
            self.release(Reservation(plan.reservation_id, [], data))
            raise
        return Reservation(plan.reservation_id, hosts, data)

    def _wait(
        self, data: dict[str, Any], role: AgentRole, progress: Progress, shipper: shipping.BundleShipper | None
    ) -> list[HostRecord]:
        names = [f"host{i}" for i in range(role.replicas)]
        last_state = [""]
        up: dict[str, str] = {}

        def discover() -> dict[str, str]:
            for i, host in enumerate(self._replica_hosts(data, role.replicas)):
                port = role.port_base + i
                if not host or names[i] in up:
                    continue
                if shipper.answers(i, host, port) if shipper is not None else _listening(host, port):
                    up[names[i]] = f"tcp://{host}:{port}"
            return dict(up)

        def check() -> None:
            if shipper is not None:
                shipper.check()
            probe = self.probe(Reservation("", [], data))
            if probe.gone:
                raise SchedulerError(f"{probe.reason} before its agents came up{_log_hint(data)}")
            state = probe.reason
            if state and state != last_state[0]:
                progress(state)
                last_state[0] = state

        found = wait_for_agents(discover, names, progress, timeout=AGENT_START_TIMEOUT, check=check, interval=0.2)
        pids = data.get("local", {}).get("pids", [])
        return [
            HostRecord(h.name if role.named else _host_of(h.agent), h.agent, pids[i] if i < len(pids) else None, i)
            for i, h in enumerate(found)
        ]

    def _replica_hosts(self, data: dict[str, Any], replicas: int) -> list[str | None]:
        """Where each replica runs, by replica id, from torchx's describe (None: not placed yet)."""
        if "local" in data:
            return ["127.0.0.1"] * replicas
        hosts: list[str | None] = [None] * replicas
        with _runner() as runner:
            try:
                status = runner.status(data["app_handle"])  # torchx's describe, with each replica's hostname
            except Exception:  # noqa: BLE001 - torchx's describe failed (e.g. a pending Slurm job it cannot parse): not placed yet
                return hosts
            for role_status in getattr(status, "roles", None) or []:
                for replica in role_status.replicas:
                    if 0 <= replica.id < replicas and replica.hostname:
                        hosts[replica.id] = _address_of(runner, data["torchx_scheduler"], replica.hostname)
        return hosts

    # ------------------------------------------------------------ checking
    def can_serve(self, reservation: ReservationRecord, request: ReserveRequest) -> str | None:
        why = super().can_serve(reservation, request)
        if why is None and request.options and request.options != reservation.scheduler_data.get("options"):
            why = f"it was reserved with other {self.name} options"
        return why

    def probe(self, reservation: ReservationRecord) -> Probe:
        data = reservation.scheduler_data
        handle = data.get("app_handle")
        if "local" in data:
            pids = data["local"]["pids"]
            dead = [i for i, up in enumerate(local_replicas.alive(pids)) if not up]
            if dead:
                return Probe(Liveness.GONE, f"torchx app {handle}: replica(s) {', '.join(map(str, dead))} exited")
            return Probe(Liveness.ALIVE)
        if not handle:
            return Probe(Liveness.GONE, "the torchx app was never submitted")
        state = self._state(handle)
        if state is None:
            return Probe(Liveness.UNKNOWN, f"torchx could not describe app {handle}")
        if state in _TERMINAL or state == "UNKNOWN_GONE":
            return Probe(Liveness.GONE, f"torchx app {handle} is {state}")
        return Probe(Liveness.ALIVE if state == "RUNNING" else Liveness.UNKNOWN, f"torchx app {handle} is {state}")

    def _state(self, handle: str) -> str | None:
        try:
            with _runner() as runner:
                status = runner.status(handle)
        except Exception as e:  # noqa: BLE001 - the scheduler's own client failed: the agents' ping decides
            _log.info("torchx status of %s failed: %r", handle, e)
            return None
        return "UNKNOWN_GONE" if status is None else str(status.state.name)

    def dead_hosts(self, reservation: ReservationRecord) -> list[str]:
        data = reservation.scheduler_data
        if "local" not in data:
            return []
        ups = local_replicas.alive(data["local"]["pids"])
        return [h.name for h, up in zip(reservation.hosts, ups) if not up]

    def describe(self, reservation: ReservationRecord) -> dict[str, Any]:
        data = reservation.scheduler_data
        shipped = data.get("bundle")
        if "local" in data:
            ups = local_replicas.alive(data["local"]["pids"])
            state = "RUNNING" if all(ups) else "FAILED" if any(ups) else "GONE"
        else:
            state = self._state(data.get("app_handle", "")) or "unknown (torchx did not answer)"
        return {
            "torchx": {
                "scheduler": data.get("torchx_scheduler"),
                "app_handle": data.get("app_handle"),
                "state": state,
                "log_dir": data.get("local", {}).get("log_dir"),
                "bundle": shipped,
                "keys": f"Secret {data['namespace']}/{data['secret']}" if data.get("secret") else None,
            }
        }

    def status_lines(self, reservation: ReservationRecord) -> list[str]:
        info = self.describe(reservation)["torchx"]
        line = f"torchx: app {info['app_handle']} {info['state']}"
        lines = [line + (f", logs in {info['log_dir']}" if info["log_dir"] else "")]
        parts = [p for p in info["bundle"] or [] if p]
        if parts:
            sent = sum(p.get("shipped", 0) for p in parts)
            lines.append(
                f"bundle: {parts[0]['code']} and {parts[0]['deps']} shipped to {len(parts)} replica(s) "
                f"({sent / 1e6:.1f} MB sent); each agent runs from it under the replica's own interpreter"
            )
        if info["keys"]:
            lines.append(f"keys: {info['keys']}")
        return lines

    # ----------------------------------------------------------- releasing
    def release(self, reservation: ReservationRecord) -> None:
        data = reservation.scheduler_data
        if "local" in data:
            local_replicas.kill(data["local"]["pids"])
        elif data.get("app_handle"):
            handle = data["app_handle"]
            with _runner() as runner:
                try:
                    runner.cancel(handle)
                except Exception as e:  # noqa: BLE001 - torchx's cancel describes first, which can fail (below)
                    _log.info("torchx cancel of %s failed (%r); cancelling through the scheduler itself", handle, e)
                    _cancel_directly(runner, handle)
                deadline = time.monotonic() + 60
                while time.monotonic() < deadline:
                    state = self._state(handle)
                    if state is None or state in _TERMINAL or state == "UNKNOWN_GONE":
                        break
                    time.sleep(0.5)
        if data.get("secret"):
            shipping.delete_secret(data["namespace"], data["secret"])
        if data.get("job_dir"):
            job_dir = Path(data["job_dir"])
            with contextlib.suppress(OSError):
                (job_dir / "keys").unlink()
            shutil.rmtree(job_dir / "bundles", ignore_errors=True)  # what was shipped to replicas on our filesystem
            with contextlib.suppress(OSError):
                job_dir.rmdir()  # unless torchx's logs are in it


def scheduler_class_for(name: str) -> type[TorchxScheduler]:
    """``torchx:<name>`` as a backend class whose options are that torchx scheduler's runopts."""
    sched = name[len(PREFIX) :] if name.startswith(PREFIX) else name
    runopts_of(sched)  # an unknown name (or a missing extra) is one line here
    return type(
        f"Torchx_{sched}_Scheduler",
        (TorchxScheduler,),
        {"name": PREFIX + sched, "torchx_scheduler": sched, "options": options_of(sched), "__module__": __name__},
    )


@contextlib.contextmanager
def _runner() -> Any:
    from torchx.runner import get_runner

    with local_replicas.keep_signal_handlers():
        runner = get_runner()
    try:
        with local_replicas.keep_signal_handlers():
            yield runner
    finally:
        with local_replicas.keep_signal_handlers():
            runner.close()


def _cancel_directly(runner: Any, handle: str) -> None:
    """torchx's ``Runner.cancel`` asks ``describe`` first, and torchx's Slurm ``describe`` raises on a
    job still pending under Slurm 22.05 (its ``squeue --json`` has no ``job_resources`` yet): the app
    would never be cancelled. The scheduler's own cancel of the app id does not ask first."""
    from torchx.specs import parse_app_handle

    parsed = parse_app_handle(handle)
    with contextlib.suppress(Exception):
        runner._scheduler(parsed.scheduler_backend)._cancel_existing(parsed.app_id)


def _key_steps(channel: str | None, job_dir: Path, secret: str | None, namespace: str) -> list[str]:
    if channel == "secret":
        return [
            f"create Secret {namespace}/{secret}: the reservation keys (never printed), mounted read-only at "
            f"{shipping.KEYS_DIR} in every pod of the Volcano job (torchx's request edited before it is submitted); "
            "deleted on stop"
        ]
    if channel == "bind mount":
        return [
            f"write a fresh key pair to {job_dir / 'keys'} (0600), bind-mounted read-only at "
            f"{shipping.KEY_FILE_IN_CONTAINER} in each container"
        ]
    return [f"write a fresh key pair to {job_dir / 'keys'} (0600; the replicas read it from the shared filesystem)"]


def _role_json(role: AgentRole) -> dict[str, Any]:
    import dataclasses

    return dataclasses.asdict(role)


def _address_of(runner: Any, sched: str, hostname: str) -> str:
    """An address this client can dial for a replica's hostname: torchx's kubernetes names a pod
    ``<ip-with-dashes>.<namespace>.pod.cluster.local`` (cluster DNS only): its IP; local_docker names the
    container (docker's DNS only): its address on torchx's network, from the daemon."""
    pod = re.match(r"^(\d+)-(\d+)-(\d+)-(\d+)\.[^.]+\.pod\.", hostname)
    if pod:
        return ".".join(pod.groups())
    if sched == "local_docker":
        with contextlib.suppress(Exception):  # the daemon's word; else the name as torchx gave it
            container = runner._scheduler(sched)._docker_client.containers.get(hostname)
            return str(container.attrs["NetworkSettings"]["Networks"]["torchx"]["IPAddress"]) or hostname
    return hostname


def _listening(host: str, port: int) -> bool:
    """Whether an agent accepts connections there (it listens only once its keys are loaded)."""
    try:
        with socket.create_connection((host, port), timeout=1.0):
            return True
    except OSError:
        return False


def _host_of(address: str) -> str:
    return address.rpartition("//")[2].rpartition(":")[0]


def _free_port_run(count: int) -> int:
    """A first port with ``count`` free ports after it on this machine (local replicas share it)."""
    for _ in range(50):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            base = s.getsockname()[1]
        if base + count < 65536 and all(_free(base + i) for i in range(count)):
            return base
    raise SchedulerError(f"found no run of {count} free ports on this machine")


def _free(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("0.0.0.0", port))
            return True
        except OSError:
            return False


def _log_hint(data: dict[str, Any]) -> str:
    log_dir = data.get("local", {}).get("log_dir")
    return f" (replica logs: {log_dir})" if log_dir else ""


__all__ = ["TorchxScheduler", "scheduler_class_for", "PREFIX"]
