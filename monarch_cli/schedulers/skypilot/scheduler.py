"""The skypilot backend: a SkyPilot cluster whose task runs one host agent per node.

``plan()`` builds the SkyPilot task as data (``num_nodes`` = hosts, resources, a file mount of
this client's bundle (its code and runtime dependencies' wheels for CPython 3.10-3.13:
:mod:`...runtime.launch.bundle_staged`), a ``setup`` that unzips the node's Python's part of it with
the standard library, a ``run`` that starts the agent on a fixed port on every node) and prints it as YAML with the equivalent ``sky launch`` line; it
needs neither SkyPilot nor its API server. ``reserve(plan)`` hands the task to a
*provisioner* (:func:`provisioner`: SkyPilot's SDK, or a stand-in that tests inject), which
returns the nodes' addresses; the agents are found by their fixed port there.

The reservation's keys travel as a SkyPilot secret (:data:`KEYS_SECRET`), never in the task
YAML or on a command line. The run script moves the secret into a here-string on fd 3,
unsets it and ``exec``s the agent with ``--keys-stdin``: the agent (and every rank under
it) has no copy in its environment. What SkyPilot's own processes keep is documented in
docs/skypilot.md.

The client reaches the agents directly on that port, or, when it is closed to the client,
through SSH tunnels over the cluster's SSH access (:mod:`.ssh_access`); ``--reach`` picks
(``auto``: direct if every agent answers there within a second, else tunnels).

SkyPilot (the optional extra ``skypilot``) is imported only inside :class:`~.sdk.SkyProvisioner`.
"""

from __future__ import annotations

import dataclasses
import importlib
import re
import shlex
import socket
import uuid
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ...config import RESERVATION_KEYS_ENV, EnvSettings, env
from ...errors import OptionError, PlanError, SchedulerError
from ...runtime.launch import bundle_staged
from ...runtime.launch.command import AgentCommand, format_port_range
from ...version import __version__
from .. import yaml_text
from ..agents import wait_for_agents
from ..base import Liveness, Option, Plan, Probe, Progress, Reservation, ReservationRecord, ReserveRequest, Scheduler
from .provisioner import PROVISIONER_ENV, Provisioner
from .ssh_access import SshAccess

if TYPE_CHECKING:
    from ...runtime.transport.keys import Keys

#: The SkyPilot secret that carries the reservation's keys to every node.
KEYS_SECRET = RESERVATION_KEYS_ENV
_HOST = EnvSettings.host.var
#: The port every agent listens on unless ``--agent-port`` says otherwise (Monarch's default).
DEFAULT_AGENT_PORT = 26600
#: How long the agents may take to answer once SkyPilot says the task runs.
AGENT_START_TIMEOUT = 120.0
DEFAULT_PYTHON = "python3"
REDACTED = "<redacted>"
#: How long ``--keep-cluster`` leaves an idle cluster up when neither stop nor serve said (minutes).
DEFAULT_KEEP_MINUTES = 10
REACH_MODES = ("auto", "direct", "tunnel")


def provisioner() -> Provisioner:
    """SkyPilot's SDK, or the factory named by ``$MONARCH_SKYPILOT_PROVISIONER`` (``module:attr``)."""
    target = env.skypilot_provisioner
    if not target:
        from .sdk import SkyProvisioner

        return SkyProvisioner()
    module, _, attr = target.partition(":")
    try:
        return getattr(importlib.import_module(module), attr)()
    except (ImportError, AttributeError) as e:
        raise SchedulerError(f"${PROVISIONER_ENV}={target} cannot be loaded: {e}") from None


def parse_minutes(text: str) -> int:
    """``90``, ``45m``, ``2h``, ``1h30m``, ``1d`` or ``H:MM:SS`` as whole minutes (rounded up), > 0."""
    text = text.strip().lower()
    seconds = 0.0
    if re.fullmatch(r"\d+", text):
        seconds = int(text) * 60
    elif re.fullmatch(r"\d+:\d{1,2}(:\d{1,2})?", text):
        parts = [int(p) for p in text.split(":")]
        seconds = parts[0] * 3600 + parts[1] * 60 + (parts[2] if len(parts) > 2 else 0)
    elif re.fullmatch(r"(\d+d)?(\d+h)?(\d+m)?(\d+s)?", text) and text:
        units = {"d": 86400, "h": 3600, "m": 60, "s": 1}
        seconds = sum(int(n) * units[u] for n, u in re.findall(r"(\d+)([dhms])", text))
    else:
        raise OptionError(f"--time takes minutes, 45m, 2h, 1h30m or H:MM:SS, not {text!r}")
    if seconds <= 0:
        raise OptionError(f"--time must be more than zero, not {text!r}")
    return int(-(-seconds // 60))


#: Where the task's file mount puts the bundle on every node (SkyPilot syncs it before ``setup``).
BUNDLE_MOUNT = "~/.monarch-bundle"
_MOUNT_SHELL = '"$HOME/.monarch-bundle"'


def setup_script(python: str) -> str:
    """Unzip the node's Python's part of the mounted bundle (stdlib only; no pip, no package index)."""
    return bundle_staged.setup_script(python, _MOUNT_SHELL)


def run_script(agent: AgentCommand, python: str, time_minutes: int | None) -> str:
    """Start the agent in the foreground (the SkyPilot job lives as long as it), keys on stdin.

    ``exec 3<<<`` copies the secret into a pipe (bash >= 5.1; a 0600 temporary file before),
    ``unset`` drops it, and ``exec`` replaces this shell: the agent's environment, and its
    ranks', never hold the keys.
    """
    argv = [*shlex.split(python), *agent.argv()[1:]]
    limit = f"timeout --signal=TERM --kill-after=30s {time_minutes * 60}s " if time_minutes else ""
    return (
        "set -e\n"
        + bundle_staged.environment_lines(python, _MOUNT_SHELL)
        + f'{_HOST}="$(printf \'%s\\n\' "$SKYPILOT_NODE_IPS" | sed -n "$((SKYPILOT_NODE_RANK + 1))p")"\n'
        f'export {_HOST} {EnvSettings.remote_dir.var}="$HOME/.monarch-cli"\n'
        f'exec 3<<<"${KEYS_SECRET}"\n'
        f"unset {KEYS_SECRET}\n"
        f'exec {limit}{shlex.join(argv)} --name "node$SKYPILOT_NODE_RANK" <&3 3<&-\n'
    )


def to_yaml(data: Any) -> str:
    """The task as ``sky launch task.yaml`` reads it (PyYAML's safe dumper; scripts as block literals)."""
    return yaml_text.dump(data)


def launch_line(cluster: str) -> str:
    return f"sky launch -c {shlex.quote(cluster)} --secret {KEYS_SECRET} --detach-run -y task.yaml"


#: --arch: the machines whose wheels the staged bundle carries.
ARCHES: dict[str, tuple[str, ...]] = {"x86_64": ("x86_64",), "aarch64": ("aarch64",), "both": ("x86_64", "aarch64")}


class SkyPilotScheduler(Scheduler):
    name = "skypilot"
    options = (
        Option(
            "cluster",
            str,
            help="The SkyPilot cluster's name (default monarch-<reservation>); an UP cluster of that name is reused.",
        ),
        Option("gpus", str, help="Accelerators per node, as SkyPilot names them (A100:8, H100:8, L4)."),
        Option("cloud", str, help="The cloud or infra (aws, gcp, azure, kubernetes, ...; default: SkyPilot picks)."),
        Option("region", str, help="The region (needs --cloud)."),
        Option("image", str, help="The node image (SkyPilot's image_id, e.g. docker:pytorch/pytorch:latest)."),
        Option("disk_size", int, help="Disk per node, in GB."),
        Option(
            "use_spot",
            bool,
            default=False,
            help="Use spot instances (may be preempted: then the reservation is reported gone).",
        ),
        Option("autostop", int, help="Stop the cluster after this many idle minutes once the agents have ended."),
        Option("down", bool, default=False, help="Tear the cluster down (not just stop it) when autostop fires."),
        Option(
            "time",
            str,
            help="End the agents after this long (45m, 2h, H:MM:SS) and tear the cluster down "
            "a minute later (autodown).",
        ),
        Option(
            "python",
            str,
            default=DEFAULT_PYTHON,
            help=f"The nodes' interpreter (default {DEFAULT_PYTHON}); CPython 3.10-3.13, nothing of ours needed.",
        ),
        Option(
            "wheelhouse",
            str,
            help="A directory of wheels of our runtime dependencies for the nodes (default: this client's "
            "package index, downloaded once into a cache).",
        ),
        Option(
            "arch",
            str,
            default="x86_64",
            help="The nodes' CPU: x86_64, aarch64 (Arm: Graviton, Grace Hopper) or both; the bundle carries "
            "our dependencies' wheels for it (both: twice the upload).",
        ),
        Option(
            "reach",
            str,
            default="auto",
            help="How the client reaches the agents: direct (their port must be "
            "open), tunnel (SSH tunnels over the cluster's SSH access), or auto "
            "(direct if every agent answers there at once, else tunnel).",
        ),
    )
    stop_options = (
        Option(
            "keep_cluster",
            bool,
            default=False,
            help="End the agents but leave the cluster up; it stops itself after --autostop idle minutes "
            f"(default: serve's --autostop, else {DEFAULT_KEEP_MINUTES}), and is reused by serve --cluster.",
        ),
        Option("autostop", int, help="With --keep-cluster: idle minutes before the cluster stops."),
    )

    # ---------------------------------------------------------------- planning
    def plan(self, request: ReserveRequest, workdir: Path) -> Plan:
        opts = self.check_options(request.options)
        if request.hosts < 1:
            raise OptionError(f"--hosts must be at least 1, not {request.hosts}")
        if opts.get("region") and not opts.get("cloud"):
            raise OptionError("--region needs --cloud")
        arch = opts.get("arch") or "x86_64"
        if arch not in ARCHES:
            raise OptionError(f"--arch takes {', '.join(ARCHES)}, not {arch!r}")
        if opts.get("reach", "auto") not in REACH_MODES:
            raise OptionError(f"--reach takes {', '.join(REACH_MODES)}, not {opts['reach']!r}")
        for name in ("disk_size", "autostop"):
            if name in opts and opts[name] <= 0:
                raise OptionError(f"--{name.replace('_', '-')} must be more than zero, not {opts[name]}")
        cluster = opts.get("cluster") or ""
        if cluster and not re.fullmatch(r"[a-z]([-a-z0-9]{0,61}[a-z0-9])?", cluster):
            raise OptionError(
                f"--cluster {cluster!r}: SkyPilot cluster names are lowercase letters, digits and "
                "dashes, starting with a letter"
            )
        time_minutes = parse_minutes(opts["time"]) if opts.get("time") else None
        python = opts.get("python") or DEFAULT_PYTHON
        rid = f"sky-{uuid.uuid4().hex[:8]}"
        cluster = cluster or f"monarch-{rid[4:]}"
        port = request.agent_port or DEFAULT_AGENT_PORT
        agent = request.agent_command(rid, python=python, port=port, keys_stdin=True)
        staged = bundle_staged.stage(opts.get("wheelhouse"), machines=ARCHES[arch])
        task = self.task_config(request.hosts, opts, agent, python, time_minutes, cluster)
        task["file_mounts"] = {BUNDLE_MOUNT: str(staged.directory)}
        shown = {**task, "secrets": {KEYS_SECRET: REDACTED}}
        yaml_text = to_yaml(shown)
        steps = [
            f"sky launch -c {cluster}: {request.hosts} node(s), {self._shape(opts)}; the reservation's keys "
            f"as the SkyPilot secret {KEYS_SECRET} (<redacted>)",
            f"file mount {BUNDLE_MOUNT} on every node: {staged.describe()}",
            f"setup on every node: unzip the parts for {python}'s version into ~/.monarch-cli/bundles with the "
            "standard library (no pip, no package index; nothing installed into the interpreter)",
            f"run on every node: the host agent on port {port}, keys handed over on stdin"
            + (f", ended after {time_minutes} min" if time_minutes else ""),
            f"find the agents on port {port} of the nodes' addresses from the cluster handle"
            + {
                "auto": "; reach them directly if they answer there, else through SSH tunnels to the head",
                "direct": "; reach them directly",
                "tunnel": "; reach them through SSH tunnels to the cluster's head",
            }[opts.get("reach", "auto")],
        ]
        if "autostop" in task["resources"]:
            stop = task["resources"]["autostop"]
            steps.append(
                f"once the agents end, {'tear down' if stop['down'] else 'stop'} the cluster after "
                f"{stop['idle_minutes']} idle minute(s)"
            )
        summary = f"a SkyPilot cluster {cluster} of {request.hosts} node(s), one host agent per node"
        return Plan(
            self.name,
            rid,
            request.hosts,
            list(request.command),
            str(workdir.resolve()),
            summary,
            steps,
            artifacts={"task.yaml (secrets redacted)": yaml_text, "equivalent command": launch_line(cluster)},
            options=opts,
            data={
                "cluster": cluster,
                "task": task,
                "port": port,
                "version": __version__,
                "bundle": staged.to_json(),
                "reach": opts.get("reach", "auto"),
                "keep": {"idle_minutes": opts.get("autostop") or DEFAULT_KEEP_MINUTES, "down": bool(opts.get("down"))},
            },
        )

    def task_config(
        self, hosts: int, opts: dict[str, Any], agent: AgentCommand, python: str, time_minutes: int | None, cluster: str
    ) -> dict[str, Any]:
        """The SkyPilot task as ``Task.from_yaml_config`` takes it, without the secret's value."""
        resources: dict[str, Any] = {}
        if opts.get("cloud"):
            resources["infra"] = opts["cloud"] + (f"/{opts['region']}" if opts.get("region") else "")
        if opts.get("gpus"):
            resources["accelerators"] = opts["gpus"]
        if opts.get("image"):
            resources["image_id"] = opts["image"]
        if opts.get("disk_size"):
            resources["disk_size"] = opts["disk_size"]
        if opts.get("use_spot"):
            resources["use_spot"] = True
        ports = [agent.port] + ([format_port_range(agent.port_range)] if agent.port_range else [])
        resources["ports"] = ports
        if opts.get("autostop") or time_minutes or opts.get("down"):
            resources["autostop"] = {
                "idle_minutes": opts.get("autostop") or 1,
                "down": bool(opts.get("down") or time_minutes),
            }
        return {
            "name": cluster,
            "num_nodes": hosts,
            "resources": resources,
            "secrets": {KEYS_SECRET: None},
            "setup": setup_script(python),
            "run": run_script(agent, python, time_minutes),
        }

    @staticmethod
    def _shape(opts: dict[str, Any]) -> str:
        parts = [opts.get("gpus") or "no GPUs", opts.get("cloud") or "any cloud"]
        if opts.get("use_spot"):
            parts.append("spot")
        return ", ".join(parts)

    # ---------------------------------------------------------------- reserving
    def reserve(self, plan: Plan, keys: Keys, progress: Progress) -> Reservation:
        self.check_plan(plan)
        try:
            cluster, task, port = plan.data["cluster"], dict(plan.data["task"]), int(plan.data["port"])
        except (KeyError, TypeError, ValueError) as e:
            raise PlanError(
                f"malformed skypilot plan ({type(e).__name__}: {e}); make a new one with --dry-run"
            ) from None
        if plan.data.get("version") != __version__:
            raise PlanError(f"this plan was made by monarch-cli {plan.data.get('version')}, not {__version__}")
        mounted = (task.get("file_mounts") or {}).get(BUNDLE_MOUNT)
        if mounted and not Path(mounted).is_dir():
            raise PlanError(f"this plan's bundle {mounted} is no longer in this client's cache; make a new plan")
        reach = plan.data.get("reach", "auto")
        prov = provisioner()
        reused = self._reusable(prov, cluster, task, progress)
        try:
            nodes = prov.launch(cluster, task, {KEYS_SECRET: keys.encode()}, progress)
            ips, internal = nodes.ips, nodes.internal_ips or nodes.ips
            if len(ips) != plan.hosts or len(internal) != plan.hosts:
                raise SchedulerError(f"cluster {cluster} has {len(ips)} node(s), not {plan.hosts}")
            if reach == "tunnel" and nodes.ssh is None:
                raise SchedulerError(
                    f"--reach tunnel: SkyPilot gives no SSH access to cluster {cluster} that "
                    "monarch can use (see docs/skypilot.md)"
                )
            names = [f"node{i}" for i in range(len(ips))]
            check = lambda: _check_up(prov, cluster)  # noqa: E731
            head = None
            if nodes.ssh is not None and reach != "direct":  # the head sees every agent, whatever is open to us
                from .ssh_access import connect, listening

                try:
                    head = connect(nodes.ssh)
                except SchedulerError as e:
                    if reach == "tunnel":
                        raise
                    progress(f"{e}; reaching the agents directly")
            if head is not None:
                try:
                    found = wait_for_agents(
                        lambda: listening(head, names, internal, port),
                        names,
                        progress,
                        timeout=AGENT_START_TIMEOUT,
                        check=check,
                        interval=0.2,
                    )
                finally:
                    head.close()
                direct = {} if reach == "tunnel" else _listening(names, ips, port, timeout=1.0)
                if len(direct) == len(names):
                    found = [dataclasses.replace(h, agent=direct[h.name]) for h in found]
                    reach = "direct"
                else:
                    if reach == "auto":
                        progress("the agents' port is closed to this machine: reaching them through SSH tunnels")
                    reach = "tunnel"
            else:
                found = wait_for_agents(
                    lambda: _listening(names, ips, port),
                    names,
                    progress,
                    timeout=AGENT_START_TIMEOUT,
                    check=check,
                    interval=0.2,
                )
                reach = "direct"
        except BaseException:  # a failed launch or Ctrl-C: no cluster we made is left costing money
            self._undo(prov, cluster, reused, plan.data.get("keep") or {}, progress)
            raise
        return Reservation(
            plan.reservation_id,
            found,
            {
                "cluster": cluster,
                "node_ips": ips,
                "internal_ips": internal,
                "port": port,
                "autostop": task["resources"].get("autostop"),
                "reach": reach,
                "ssh": nodes.ssh.to_json() if nodes.ssh is not None else None,
                "keep": plan.data.get("keep"),
                "reused": reused,
            },
        )

    @staticmethod
    def _reusable(prov: Provisioner, cluster: str, task: dict[str, Any], progress: Progress) -> bool:
        """Whether ``cluster`` exists and can run ``task`` (then it is reused); refuse one of another shape."""
        shape = prov.existing(cluster)
        if shape is None:
            return False
        wanted = task["resources"]
        mismatch = []
        if shape.nodes != task["num_nodes"]:
            mismatch.append(f"{shape.nodes} node(s), not {task['num_nodes']}")
        if wanted.get("accelerators") and (shape.accelerators or "").lower() != wanted["accelerators"].lower():
            mismatch.append(f"{shape.accelerators or 'no GPUs'}, not {wanted['accelerators']}")
        cloud = (wanted.get("infra") or "").split("/")[0].lower()
        if cloud and shape.cloud and shape.cloud != cloud:
            mismatch.append(f"on {shape.cloud}, not {cloud}")
        if mismatch:
            raise SchedulerError(
                f"cluster {cluster} exists ({shape.state}) with {'; '.join(mismatch)}: name another "
                f"--cluster, or take it down with `sky down {cluster}`"
            )
        progress(f"reusing cluster {cluster} ({shape.state}, {shape.nodes} node(s))")
        return True

    @staticmethod
    def _undo(prov: Provisioner, cluster: str, reused: bool, keep: dict[str, Any], progress: Progress) -> None:
        """After a failed serve: tear down a cluster we made; one we reused is left as it was kept."""
        try:
            if reused:
                progress(f"ending the agents on {cluster}; it stays up")
                prov.keep(cluster, int(keep.get("idle_minutes") or DEFAULT_KEEP_MINUTES), bool(keep.get("down")))
            else:
                progress(f"tearing down {cluster}")
                prov.down(cluster)
        except SchedulerError as e:  # the first error is the one to report
            progress(f"could not clean up {cluster}: {e}")

    # ---------------------------------------------------------------- the reservation
    def release(self, reservation: ReservationRecord) -> None:
        cluster = reservation.scheduler_data.get("cluster")
        if cluster:
            provisioner().down(cluster)

    def check_stop_options(self, options: dict[str, Any]) -> dict[str, Any]:
        opts = super().check_stop_options(options)
        if "autostop" in opts and not opts.get("keep_cluster"):
            raise OptionError("--autostop (of stop) needs --keep-cluster")
        if "autostop" in opts and opts["autostop"] <= 0:
            raise OptionError(f"--autostop must be more than zero, not {opts['autostop']}")
        return opts

    def release_with(self, reservation: ReservationRecord, options: dict[str, Any]) -> None:
        """``--keep-cluster``: the agents end (SkyPilot cancels their job), the cluster stays up with autostop."""
        data = reservation.scheduler_data
        if not options.get("keep_cluster"):
            self.release(reservation)
            return
        keep = data.get("keep") or {}
        minutes = int(options.get("autostop") or keep.get("idle_minutes") or DEFAULT_KEEP_MINUTES)
        if data.get("cluster"):
            provisioner().keep(data["cluster"], minutes, bool(keep.get("down")))

    def probe(self, reservation: ReservationRecord) -> Probe:
        """Every agent's port accepts: alive, without asking SkyPilot (it runs before every run, and
        importing SkyPilot and asking its API server costs seconds). Otherwise SkyPilot says why."""
        data = reservation.scheduler_data
        ips, port, cluster = data.get("node_ips", []), data.get("port"), data.get("cluster", "")
        names = [f"node{i}" for i in range(len(ips))]
        answering: dict[str, str] = {}
        if ips and port and data.get("reach") == "tunnel":
            from .ssh_access import listening, shared_client

            try:
                head = shared_client(reservation.reservation_id, SshAccess.from_json(data["ssh"]))
                answering = listening(head, names, data.get("internal_ips") or ips, int(port))
            except SchedulerError:  # the head is unreachable: SkyPilot says why
                pass
        elif ips and port:
            answering = _listening(names, ips, int(port))
        if ips and len(answering) == len(ips):
            return Probe(Liveness.ALIVE)
        state, reason = provisioner().state(cluster)
        if state in ("GONE", "STOPPED"):
            return Probe(Liveness.GONE, reason)
        silent = ", ".join(n for n in names if n not in answering)
        return Probe(Liveness.UNKNOWN, f"{reason}; no agent answers on {silent}" if state == "UP" else reason)

    def agent_addresses(self, reservation: ReservationRecord) -> list[str]:
        """Tunnelled: a loopback port of this process per node, forwarded over the head's SSH connection."""
        data = reservation.scheduler_data
        if data.get("reach") != "tunnel":
            return super().agent_addresses(reservation)
        from .ssh_access import forwards

        targets = [(ip, int(data["port"])) for ip in data.get("internal_ips") or data.get("node_ips", [])]
        try:
            return forwards(reservation.reservation_id, SshAccess.from_json(data["ssh"]), targets)
        except SchedulerError:  # the head is unreachable: the agents will not answer, and say so by name
            return super().agent_addresses(reservation)

    def can_serve(self, reservation: ReservationRecord, request: ReserveRequest) -> str | None:
        wanted = request.options.get("cluster")
        had = reservation.scheduler_data.get("cluster")
        if wanted and wanted != had:
            return f"it is cluster {had}, not {wanted}"
        return super().can_serve(reservation, request)

    def describe(self, reservation: ReservationRecord) -> dict[str, Any]:
        data = reservation.scheduler_data
        return {
            "skypilot": {
                "cluster": data.get("cluster"),
                "nodes": data.get("node_ips", []),
                "port": data.get("port"),
                "autostop": data.get("autostop"),
                "reach": data.get("reach", "direct"),
                "reused": bool(data.get("reused")),
            }
        }

    def status_lines(self, reservation: ReservationRecord) -> list[str]:
        data = reservation.scheduler_data
        state, reason = provisioner().state(data.get("cluster", ""))
        lines = [f"cluster {data.get('cluster')}: {state}" + (f" ({reason})" if state in ("GONE", "UNKNOWN") else "")]
        if data.get("reach") == "tunnel":
            ssh = data.get("ssh") or {}
            lines.append(f"agents reached through SSH tunnels to {ssh.get('user')}@{ssh.get('host')}:{ssh.get('port')}")
            lines += [
                f"node{i}: {ip}:{data.get('port')} (internal)" for i, ip in enumerate(data.get("internal_ips") or [])
            ]
        else:
            lines += [f"node{i}: {ip}:{data.get('port')}" for i, ip in enumerate(data.get("node_ips", []))]
        return lines


def _listening(names: list[str], ips: list[str], port: int, timeout: float = 0.5) -> dict[str, str]:
    """The agents whose fixed port accepts a connection (CURVE then proves they are ours)."""
    found = {}
    for name, ip in zip(names, ips):
        try:
            with socket.create_connection((ip, port), timeout=timeout):
                found[name] = f"tcp://{ip}:{port}"
        except OSError:
            continue
    return found


def _check_up(prov: Provisioner, cluster: str) -> None:
    state, reason = prov.state(cluster)
    if state in ("GONE", "STOPPED"):
        raise SchedulerError(f"the agents did not come up: {reason}")


__all__ = [
    "SkyPilotScheduler",
    "parse_minutes",
    "to_yaml",
    "KEYS_SECRET",
    "DEFAULT_AGENT_PORT",
]
