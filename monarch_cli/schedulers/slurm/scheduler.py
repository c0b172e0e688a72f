"""The Slurm backend: one host agent per node of a Slurm job, found through a shared directory.

Outside an allocation, ``reserve`` renders an sbatch script (``templates/slurm_serve.sbatch``),
submits it and waits: while the job pends it reports state and reason, then it waits for one
address file per node. Inside an allocation (``salloc``, a batch script: ``$SLURM_JOB_ID``
set) it starts the agents as a backgrounded ``srun --overlap`` step instead, which outlives
the CLI. Agents bind ephemeral ports, so reservations on the same nodes never collide.

Only the plain ``squeue -h -o`` / ``scontrol show hostnames`` outputs are read: they are
the same in every Slurm version, unlike ``squeue --json``, and need no accounting (no sacct).
"""

from __future__ import annotations

import os
import shlex
import signal
import string
import subprocess
import sys
import time
import uuid
from collections.abc import Sequence
from importlib import resources
from pathlib import Path
from typing import TYPE_CHECKING, Any

import psutil

from ...config import KEY_FILE_ENV, KEYS_ENV
from ...errors import OptionError, PlanError, UserError
from ...runtime.launch.command import AgentCommand, format_port_range
from ...sysutil import signal_if_alive
from ..agents import read_address_files, wait_for_agents
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
from .commands import SlurmError, allocation_id, find_step, hostnames, job_info, run, steps, submit

if TYPE_CHECKING:
    from ...runtime.transport.keys import Keys

#: The node-side entry point that every srun task runs (it becomes the node's host agent).
NODE_MODULE = "monarch_cli.schedulers.slurm.node"
#: serve's Slurm options, as data: each becomes a ``monarch serve`` flag, ``-o name=value`` and an sbatch option.
OPTIONS = (
    Option("partition", str, None, "Slurm partition.", short="-p"),
    Option("time", str, None, "Slurm time limit (e.g. 1:00:00).", short="-t"),
    Option("gpus_per_node", int, None, "GPUs per node (also given to the agents' srun step)."),
    Option("cpus_per_task", int, None, "CPUs per node's agent task (its ranks share them)."),
    Option("mem", str, None, "Memory per node (e.g. 64G)."),
    Option("account", str, None, "Slurm account to charge.", short="-A"),
    Option("qos", str, None, "Slurm quality of service."),
    Option("constraint", str, None, "Node features the nodes must have.", short="-C"),
    Option("exclusive", bool, False, "Nodes not shared with other jobs."),
    Option(
        "sbatch_args", list, None, "Extra sbatch argument such as --reservation=x (repeatable).", flag="--sbatch-arg"
    ),
)
#: serve's Slurm options and the sbatch flag each becomes (None: passed through as given).
OPTION_FLAGS = {o.name: (None if o.type is list else o.cli_flag) for o in OPTIONS}
#: How long agents may take to come up once the job runs (they import torch to warm up).
AGENT_START_TIMEOUT = 180.0
_TERMINAL_GRACE = 20.0
_SETTLE_S = 10.0
#: What a job state means for a reservation, in words (squeue's reason alone is often "None").
_ENDINGS = {
    "TIMEOUT": "its time limit was reached",
    "NODE_FAIL": "a node failed",
    "CANCELLED": "it was cancelled",
    "PREEMPTED": "it was preempted",
    "OUT_OF_MEMORY": "it ran out of memory",
    "BOOT_FAIL": "a node failed to boot",
    "DEADLINE": "its deadline passed",
    "FAILED": "its agents exited with an error",
    "COMPLETED": "its agents exited",
    "PENDING": "it was requeued and waits to run again, with new agents",
    "SUSPENDED": "it is suspended",
}


class SlurmScheduler(Scheduler):
    name = "slurm"
    options = OPTIONS

    # ------------------------------------------------------------ planning
    def default_hosts(self) -> int | None:
        """Inside an allocation, serve all of its nodes unless told otherwise."""
        nodes = os.environ.get("SLURM_JOB_NUM_NODES") or os.environ.get("SLURM_NNODES")
        return int(nodes) if allocation_id() and nodes and nodes.isdigit() else None

    def check_options(self, options: dict[str, Any]) -> dict[str, Any]:
        return _check_options(super().check_options(options))

    def plan(self, request: ReserveRequest, workdir: Path) -> Plan:
        options = self.check_options(request.options)
        rid = _new_id()
        job_dir = _job_dir(workdir, rid)
        node_args = _node_args(request.agent_command(rid))
        data: dict[str, Any] = {"job_dir": str(job_dir)}
        keys = f"write a fresh key pair to {job_dir / 'keys'} (0600; the nodes read it from the shared filesystem)"
        if allocation_id():
            _allocation_options(options)
            nodes = _allocation_nodes(request.hosts)
            cmd = _step_command(job_dir, nodes, options, node_args)
            data.update(mode="allocation", job_id=allocation_id(), nodes=nodes, srun=cmd)
            summary = (
                f"inside Slurm allocation {allocation_id()}: start {len(nodes)} host agent(s) on "
                f"{','.join(nodes)} as a background `srun --overlap` step"
            )
            steps = [
                keys,
                f"run in the background: {shlex.join(cmd)}",
                f"wait until {len(nodes)} agent(s) have written {job_dir / 'agents'}/<node>.addr",
            ]
            return Plan(
                self.name,
                rid,
                len(nodes),
                list(request.command),
                str(workdir.resolve()),
                summary,
                steps,
                {"srun command": shlex.join(cmd)},
                _plain(options),
                data,
            )
        script = render_serve_script(
            request.hosts, f"monarch-{rid[6:]}", job_dir, sys.executable, options, node_args=node_args
        )
        data.update(mode="batch")
        summary = f"submit an sbatch script: {request.hosts} node(s), one host agent each"
        steps = [
            keys,
            f"write the script below to {job_dir / 'serve.sbatch'} and submit it with `sbatch --parsable`",
            "report the job's state while it pends",
            f"wait until {request.hosts} agent(s) have written {job_dir / 'agents'}/<node>.addr",
        ]
        return Plan(
            self.name,
            rid,
            request.hosts,
            list(request.command),
            str(workdir.resolve()),
            summary,
            steps,
            {"sbatch script": script},
            _plain(options),
            data,
        )

    # ----------------------------------------------------------- reserving
    def reserve(self, plan: Plan, keys: Keys, progress: Progress) -> Reservation:
        self.check_plan(plan)
        job_dir = Path(plan.data["job_dir"])
        if plan.data.get("mode") == "allocation":
            if allocation_id() != plan.data.get("job_id"):
                raise PlanError(
                    f"this plan starts agents inside Slurm allocation {plan.data.get('job_id')}, but this "
                    f"process runs {'in ' + str(allocation_id()) if allocation_id() else 'outside any'}"
                )
            _make_job_dir(job_dir, keys)
            return self._reserve_in_allocation(plan, job_dir, progress)
        _make_job_dir(job_dir, keys)
        (job_dir / "serve.sbatch").write_text(plan.artifacts["sbatch script"])
        try:
            job_id = submit(job_dir / "serve.sbatch")
        except BaseException:
            _forget_keys(job_dir)
            raise
        output = str(job_dir / f"slurm-{job_id}.out")
        data = {"mode": "batch", "job_id": job_id, "dir": str(job_dir), "options": plan.options, "output": output}
        try:
            hosts = _wait_for_agents(job_id, None, job_dir, plan.hosts, progress, output)
        except BaseException:
            run(["scancel", job_id], check=False)
            _forget_keys(job_dir)
            raise
        return Reservation(plan.reservation_id, hosts, data)

    def _reserve_in_allocation(self, plan: Plan, job_dir: Path, progress: Progress) -> Reservation:
        job_id = allocation_id() or ""
        cmd, nodes = list(plan.data["srun"]), list(plan.data["nodes"])
        env = {k: v for k, v in os.environ.items() if k != KEYS_ENV}
        env[KEY_FILE_ENV] = str(job_dir / "keys")
        log_path = job_dir / "agents.log"
        progress(f"starting {len(nodes)} agent(s) in allocation {job_id} (srun --overlap)")
        with open(log_path, "ab") as log:
            try:
                srun = subprocess.Popen(
                    cmd, stdin=subprocess.DEVNULL, stdout=log, stderr=log, env=env, start_new_session=True
                )  # outlives this CLI, not the allocation
            except FileNotFoundError:
                _forget_keys(job_dir)
                raise SlurmError("srun not found on PATH, though $SLURM_JOB_ID is set") from None
        data: dict[str, Any] = {
            "mode": "allocation",
            "job_id": job_id,
            "dir": str(job_dir),
            "srun_pid": srun.pid,
            "options": plan.options,
            "output": str(log_path),
        }
        try:
            hosts = _wait_for_agents(job_id, srun, job_dir, len(nodes), progress, str(log_path), names=nodes)
            data["step"] = find_step(job_id, f"monarch-agents-{plan.reservation_id[6:]}")
        except BaseException:
            _end_step(data)
            _forget_keys(job_dir)
            raise
        return Reservation(plan.reservation_id, hosts, data)

    # ------------------------------------------------------------ checking
    def can_serve(self, reservation: ReservationRecord, request: ReserveRequest) -> str | None:
        why = super().can_serve(reservation, request)
        if why is None and request.options and request.options != reservation.scheduler_data.get("options"):
            why = "it was reserved with other Slurm options"
        return why

    def probe(self, reservation: ReservationRecord) -> Probe:
        data = reservation.scheduler_data
        job_id = str(data.get("job_id", ""))
        info = job_info(job_id)
        settle = time.monotonic() + _SETTLE_S
        while info and info["state"] == "COMPLETING" and time.monotonic() < settle:
            time.sleep(0.5)  # ending now: wait for the state that says why (TIMEOUT, NODE_FAIL...)
            info = job_info(job_id)
        if info is None:
            return Probe(Liveness.UNKNOWN, "squeue did not answer")
        if not info:
            return Probe(Liveness.GONE, f"Slurm job {job_id} has ended and is no longer known to Slurm")
        if info["state"] != "RUNNING":
            return Probe(
                Liveness.GONE, f"Slurm job {job_id} is {info['state']}{_explain(info['state'], info['reason'])}"
            )
        step = data.get("step")
        if data.get("mode") == "allocation" and step and step not in steps(job_id):
            return Probe(Liveness.GONE, f"agent step {step} of Slurm allocation {job_id} has ended")
        return Probe(Liveness.ALIVE)

    def describe(self, reservation: ReservationRecord) -> dict[str, Any]:
        data = reservation.scheduler_data
        raw = job_info(str(data.get("job_id", "")))
        info = raw or {}
        known = "no longer known to Slurm" if raw == {} else "unknown (squeue did not answer)"
        return {
            "slurm": {
                "job_id": data.get("job_id"),
                "mode": data.get("mode"),
                "step": data.get("step"),
                "state": info.get("state", known),
                "reason": info.get("reason"),
                "elapsed": info.get("elapsed"),
                "time_left": info.get("time_left"),
                "nodes": info.get("nodes"),
                "partition": info.get("partition"),
                "output": data.get("output"),
                "dir": data.get("dir"),
            }
        }

    def status_lines(self, reservation: ReservationRecord) -> list[str]:
        return [slurm_line(self.describe(reservation)["slurm"])]

    # ----------------------------------------------------------- releasing
    def release(self, reservation: ReservationRecord) -> None:
        data = reservation.scheduler_data
        if data.get("mode") == "allocation":
            _end_step(data)
        elif data.get("job_id"):
            run(["scancel", str(data["job_id"])], check=False)
            _wait_terminal(str(data["job_id"]))
        if data.get("dir"):
            _forget_keys(Path(data["dir"]))


def slurm_line(slurm: dict[str, Any]) -> str:
    """One line of Slurm facts for ``monarch status``."""
    head = f"slurm: job {slurm.get('job_id')}"
    if slurm.get("step"):
        head += f" (agents in step {slurm['step']})"
    if slurm.get("state"):
        head += f" {slurm['state']}"
    if slurm.get("reason") not in (None, "", "None"):
        head += f" ({slurm['reason']})"
    facts = []
    if slurm.get("nodes"):
        facts.append(f"nodes {slurm['nodes']}")
    if slurm.get("partition"):
        facts.append(f"partition {slurm['partition']}")
    if slurm.get("elapsed"):
        facts.append(f"elapsed {slurm['elapsed']}")
    if slurm.get("state") == "RUNNING" and slurm.get("time_left") not in (None, "", "INVALID"):
        facts.append(f"time left {slurm['time_left']}")
    return ", ".join([head, *facts])


# ---------------------------------------------------------------------- rendering
def _explain(state: str, reason: str) -> str:
    words = [w for w in (_ENDINGS.get(state.split()[0], ""), reason) if w and w not in ("None", "TimeLimit")]
    return f" ({': '.join(words)})" if words else ""


def render_serve_script(
    nodes: int,
    job_name: str,
    job_dir: Path,
    python: str,
    options: dict[str, Any],
    preload: str | None = None,
    node_args: list[str] | None = None,
) -> str:
    """The sbatch script of a reservation (``monarch serve --scheduler slurm``)."""
    _no_whitespace(str(job_dir), "the state directory")
    srun_extra = f" --gpus-per-node={options['gpus_per_node']}" if options.get("gpus_per_node") else ""
    if node_args is None:
        node_args = ["--preload", preload] if preload is not None else []
    agent_args = "".join(f" {shlex.quote(a)}" for a in node_args)
    return load_template("slurm_serve.sbatch").substitute(
        job_name=job_name,
        nodes=nodes,
        job_dir=str(job_dir),
        sbatch_lines=sbatch_lines(sbatch_option_args(options)),
        key_file_var=KEY_FILE_ENV,
        key_file=shlex.quote(str(job_dir / "keys")),
        python=shlex.quote(python),
        node_module=NODE_MODULE,
        srun_extra=srun_extra,
        agent_args=agent_args,
    )


def sbatch_lines(args: Sequence[str]) -> str:
    """``#SBATCH`` directives, one per option (each ends with a newline)."""
    return "".join(f"#SBATCH {a}\n" for a in args)


def sbatch_option_args(options: dict[str, Any]) -> list[str]:
    """serve's Slurm options as sbatch arguments, in a fixed order."""
    args = []
    for key, flag in OPTION_FLAGS.items():
        value = options.get(key)
        if value is None or value is False or flag is None:
            continue
        args.append(flag if value is True else f"{flag}={value}")
    args.extend(options.get("sbatch_args") or [])
    return args


def load_template(name: str) -> string.Template:
    return string.Template(resources.files("monarch_cli.templates").joinpath(name).read_text())


def _check_options(options: dict[str, Any]) -> dict[str, Any]:
    checked: dict[str, Any] = {}
    for key, value in options.items():
        if value is None:
            continue
        if key == "sbatch_args":
            value = [value] if isinstance(value, str) else list(value)
            for arg in value:
                if "\n" in str(arg) or not str(arg).startswith("-"):
                    raise OptionError(f"--sbatch-arg takes one sbatch option such as --reservation=x, not {arg!r}")
            checked[key] = [str(a) for a in value]
        elif key == "exclusive":
            checked[key] = bool(value)
        else:
            _no_whitespace(str(value), f"--{key.replace('_', '-')}")
            checked[key] = value
    return checked


def _no_whitespace(value: str, what: str) -> None:
    if not value or any(c.isspace() for c in value):
        raise OptionError(f"{what} for Slurm must be non-empty and without spaces, not {value!r}")


def _plain(options: dict[str, Any]) -> dict[str, Any]:
    return {k: (list(v) if isinstance(v, (list, tuple)) else v) for k, v in options.items()}


def _new_id() -> str:
    return f"slurm-{uuid.uuid4().hex[:8]}"


def _job_dir(workdir: Path, rid: str) -> Path:
    return workdir.resolve() / "slurm" / rid


def _make_job_dir(job_dir: Path, keys: Keys) -> None:
    """The reservation's directory (0700) with its keys (0600) and an empty agents/."""
    (job_dir / "agents").mkdir(parents=True, mode=0o700)
    os.chmod(job_dir, 0o700)
    keys.write(job_dir / "keys")


def _allocation_options(options: dict[str, Any]) -> None:
    """Inside an allocation there is nothing to ask Slurm for: say so rather than ignore options."""
    moot = sorted(k for k in options if k != "gpus_per_node")
    if moot:
        flags = ", ".join("--" + k.replace("_", "-") for k in moot)
        raise OptionError(
            f"inside Slurm allocation {allocation_id()}, {flags} cannot apply (the allocation is "
            "already made); leave them out, or run `monarch serve` outside the allocation"
        )


def _allocation_nodes(count: int) -> list[str]:
    nodelist = os.environ.get("SLURM_JOB_NODELIST") or os.environ.get("SLURM_NODELIST")
    if not nodelist:
        raise SlurmError(f"inside Slurm job {allocation_id()} but $SLURM_JOB_NODELIST is not set")
    nodes = hostnames(nodelist)
    if count > len(nodes):
        raise UserError(
            f"--nodes {count} is more than the {len(nodes)} node(s) of allocation {allocation_id()} "
            f"({nodelist}); ask for at most {len(nodes)}"
        )
    return nodes[:count]


def _node_args(agent: AgentCommand) -> list[str]:
    """The node entry point's agent options (the node adds its own name, address and address file)."""
    args: list[str] = []
    if agent.preload is not None:
        args += ["--preload", agent.preload]
    if agent.port is not None:
        args += ["--port", str(agent.port)]
    if agent.port_range is not None:
        args += ["--port-range", format_port_range(agent.port_range)]
    return args


def _step_command(job_dir: Path, nodes: list[str], options: dict[str, Any], node_args: list[str]) -> list[str]:
    """``srun`` for agents inside an existing allocation: overlapping, so the user's own steps still fit."""
    count = len(nodes)
    cmd = [
        "srun",
        "--overlap",
        f"--nodes={count}",
        f"--ntasks={count}",
        "--ntasks-per-node=1",
        f"--nodelist={','.join(nodes)}",
        f"--job-name=monarch-agents-{job_dir.name[6:]}",
        "--kill-on-bad-exit=0",
        "--cpu-bind=none",
    ]
    if options.get("gpus_per_node"):
        cmd.append(f"--gpus-per-node={options['gpus_per_node']}")
    return cmd + [sys.executable, "-m", NODE_MODULE, "--dir", str(job_dir), *node_args]


# ------------------------------------------------------------------- waiting
def _wait_for_agents(
    job_id: str,
    srun: subprocess.Popen | None,
    job_dir: Path,
    count: int,
    progress: Progress,
    output: str,
    names: list[str] | None = None,
) -> list[HostRecord]:
    """Report the job's progress while it pends, then wait until one agent per node has written its address."""
    started = time.monotonic()
    last = ""
    while names is None:
        info = job_info(job_id)
        if info == {}:
            raise SlurmError(f"Slurm job {job_id} ended before its agents came up: {_tail(output)}")
        state = (info or {}).get("state", "UNKNOWN")
        if state == "RUNNING" and info:
            names = hostnames(info["nodes"])
        elif state in ("PENDING", "CONFIGURING", "UNKNOWN", "REQUEUED", "RESIZING"):
            reason = (info or {}).get("reason", "")
            why = f" ({reason})" if reason not in ("", "None") else ""
            msg = f"Slurm job {job_id} {state.lower()}{why} for {_clock(time.monotonic() - started)}"
            if msg != last:
                progress(msg)
                last = msg
            time.sleep(0.5)
        else:
            raise SlurmError(
                f"Slurm job {job_id} is {state} ({info.get('reason') if info else ''}) "
                f"before its agents came up: {_tail(output)}"
            )
    found_names: list[str] = names

    def check() -> None:
        if srun is not None and srun.poll() is not None:
            raise SlurmError(
                f"the agent step (srun) exited with status {srun.returncode} before the agents came up: {_tail(output)}"
            )
        if srun is None:  # our own job: it may fail on the nodes (no Python there, a bad path...)
            info = job_info(job_id)
            if info == {} or (info and info["state"] != "RUNNING"):
                how = f"is {info['state']}" if info else "ended"
                raise SlurmError(f"Slurm job {job_id} {how} before its agents came up: {_tail(output)}")

    try:
        return wait_for_agents(
            lambda: read_address_files(job_dir / "agents", found_names),
            found_names,
            progress,
            timeout=AGENT_START_TIMEOUT,
            check=check,
            interval=0.3,
            label=f"Slurm job {job_id} running on {','.join(found_names)}; agents up",
        )
    except SlurmError:
        raise
    except UserError as e:  # the timeout: say which job, and show its output
        raise SlurmError(f"{e} of job {job_id} starting: {_tail(output)}") from None


def _tail(path: str, lines: int = 3) -> str:
    try:
        text = Path(path).read_text(errors="replace").strip().splitlines()
    except OSError:
        return f"no output yet ({path})"
    return " | ".join(text[-lines:]) + f" (full output: {path})" if text else f"no output ({path})"


def _clock(seconds: float) -> str:
    return f"{int(seconds) // 60}:{int(seconds) % 60:02d}"


# ------------------------------------------------------------------- ending
def _end_step(data: dict[str, Any]) -> None:
    """End only our agent step of an allocation that is not ours to cancel."""
    if data.get("step"):
        run(["scancel", str(data["step"])], check=False)
    pid = data.get("srun_pid")
    if pid and _is_agent_srun(int(pid), Path(str(data.get("dir", "")))) and not _wait_gone(int(pid), _TERMINAL_GRACE):
        signal_if_alive(int(pid), signal.SIGKILL)
        _wait_gone(int(pid), 5)


def _wait_terminal(job_id: str) -> None:
    """Wait (briefly) until the job is no longer running, so no agent is left when stop returns."""
    deadline = time.monotonic() + _TERMINAL_GRACE
    while time.monotonic() < deadline:
        info = job_info(job_id)
        if info is None or info == {} or info["state"] not in ("RUNNING", "COMPLETING", "PENDING", "CONFIGURING"):
            return
        time.sleep(0.25)


def _is_agent_srun(pid: int, job_dir: Path) -> bool:
    """Is ``pid`` still our srun (not a process that reused the id since)?"""
    try:
        cmdline = psutil.Process(pid).cmdline()
    except (psutil.NoSuchProcess, psutil.AccessDenied):
        return False
    return bool(cmdline) and os.path.basename(cmdline[0]) == "srun" and str(job_dir) in cmdline


def _wait_gone(pid: int, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if os.waitpid(pid, os.WNOHANG)[0] == pid:
                return True
        except ChildProcessError:
            pass  # not our child: check it by its status instead
        try:
            if psutil.Process(pid).status() == psutil.STATUS_ZOMBIE:
                return True
        except psutil.NoSuchProcess:
            return True
        time.sleep(0.1)
    return False


def _forget_keys(job_dir: Path) -> None:
    """The keys are useless once the agents are gone; do not leave them lying around."""
    try:
        (job_dir / "keys").unlink()
    except OSError:
        pass


__all__ = [
    "SlurmScheduler",
    "SlurmError",
    "render_serve_script",
    "sbatch_option_args",
    "sbatch_lines",
    "load_template",
    "slurm_line",
    "OPTIONS",
    "OPTION_FLAGS",
    "NODE_MODULE",
]
