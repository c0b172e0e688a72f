"""Slurm's client commands, as the Slurm backend uses them: sbatch, squeue, scontrol, scancel.

Only plain outputs are parsed (``sbatch --parsable``, ``squeue -h -o FORMAT``, ``scontrol
show hostnames``): they read the same in every Slurm version, unlike ``squeue --json``,
and need no accounting database (no sacct). Errors quote Slurm's own words on one line.
"""

from __future__ import annotations

import os
import shlex
import subprocess
import time
from collections.abc import Callable, Sequence
from pathlib import Path

from ...errors import SchedulerError

_CMD_TIMEOUT = 30.0


class SlurmError(SchedulerError):
    """A Slurm command failed; the message quotes what Slurm said."""


def allocation_id() -> str | None:
    """The Slurm job this process runs in (salloc shell, batch script), if any."""
    return os.environ.get("SLURM_JOB_ID") or os.environ.get("SLURM_JOBID") or None


def run(cmd: Sequence[str], check: bool = True, timeout: float = _CMD_TIMEOUT) -> subprocess.CompletedProcess:
    try:
        done = subprocess.run(list(cmd), capture_output=True, text=True, timeout=timeout, stdin=subprocess.DEVNULL)
    except FileNotFoundError:
        raise SlurmError(
            f"{cmd[0]} not found on PATH: run this on a Slurm login node "
            "(with Slurm's client commands), or use --scheduler local"
        ) from None
    except subprocess.TimeoutExpired:
        raise SlurmError(f"`{shlex.join(cmd[:2])}` did not answer in {timeout:.0f} s; is slurmctld up?") from None
    if check and done.returncode != 0:
        raise SlurmError(f"`{shlex.join(cmd)}` failed: {slurm_message(done.stderr) or f'exit {done.returncode}'}")
    return done


def slurm_message(stderr: str) -> str:
    """Slurm's error lines as one line, without the repeated ``sbatch: error:`` prefixes."""
    parts = []
    for line in stderr.splitlines():
        line = line.strip()
        for prefix in ("sbatch: error: ", "squeue: error: ", "srun: error: ", "scancel: error: ", "error: "):
            if line.startswith(prefix):
                line = line[len(prefix) :]
        if line and line not in parts:
            parts.append(line)
    return "; ".join(parts)


def submit(script: Path, extra_args: Sequence[str] = ()) -> str:
    """``sbatch --parsable``; returns the job id, or raises with sbatch's own message."""
    done = run(["sbatch", "--parsable", *extra_args, str(script)], check=False)
    if done.returncode != 0:
        raise SlurmError(f"sbatch refused the job: {slurm_message(done.stderr) or f'exit {done.returncode}'}")
    return parse_job_id(done.stdout)


def submit_and_wait(script: Path, on_submitted: Callable[[str], None]) -> tuple[str, int]:
    """``sbatch --parsable --wait``: report the job id at once, return it with the job's exit code."""
    try:
        proc = subprocess.Popen(
            ["sbatch", "--parsable", "--wait", str(script)],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            stdin=subprocess.DEVNULL,
        )
    except FileNotFoundError:
        raise SlurmError("sbatch not found on PATH: run this on a Slurm login node, or use --scheduler local") from None
    assert proc.stdout is not None and proc.stderr is not None
    first = proc.stdout.readline()
    if not first.strip():
        proc.wait()
        raise SlurmError(f"sbatch refused the job: {slurm_message(proc.stderr.read()) or f'exit {proc.returncode}'}")
    job_id = parse_job_id(first)
    on_submitted(job_id)
    try:
        code = proc.wait()
    except KeyboardInterrupt:
        proc.terminate()  # the job keeps running; only the waiting stops
        raise
    return job_id, code


def parse_job_id(stdout: str) -> str:
    """``--parsable`` prints ``jobid`` or ``jobid;cluster``."""
    first = stdout.strip().splitlines()[0] if stdout.strip() else ""
    job_id = first.split(";")[0].strip()
    if not job_id.isdigit():
        raise SlurmError(f"sbatch printed no job id (got {stdout.strip()!r})")
    return job_id


def job_info(job_id: str) -> dict[str, str] | None:
    """The job's state from ``squeue``; ``{}`` if Slurm no longer knows it, None if squeue failed."""
    if not job_id:
        return {}
    try:
        done = run(["squeue", "-h", "-t", "all", "-j", job_id, "-o", "%T|%r|%M|%L|%N|%P"], check=False, timeout=15)
    except SlurmError:
        return None
    if done.returncode != 0:
        return {} if "Invalid job id" in done.stderr else None
    for line in done.stdout.splitlines():
        fields = line.strip().split("|")
        if len(fields) == 6:
            keys = ("state", "reason", "elapsed", "time_left", "nodes", "partition")
            return dict(zip(keys, fields))
    return {}


def job_workdir(job_id: str) -> Path | None:
    """The job's working directory, while Slurm still knows the job."""
    done = run(["squeue", "-h", "-t", "all", "-j", job_id, "-o", "%Z"], check=False, timeout=15)
    text = done.stdout.strip()
    return Path(text) if done.returncode == 0 and text else None


def hostnames(nodelist: str) -> list[str]:
    """Expand a compressed node list (``node[1-3,7]``) in Slurm's own order."""
    return run(["scontrol", "show", "hostnames", nodelist]).stdout.split()


def steps(job_id: str) -> list[str]:
    done = run(["squeue", "-h", "-s", "-j", job_id, "-o", "%i"], check=False, timeout=15)
    return done.stdout.split() if done.returncode == 0 else []


def find_step(job_id: str, name: str) -> str | None:
    """The step id (``123.4``) of our agent step, looked up by its name."""
    for _ in range(20):
        done = run(["squeue", "-h", "-s", "-j", job_id, "-o", "%i|%j"], check=False, timeout=15)
        for line in done.stdout.splitlines():
            step, _, step_name = line.strip().partition("|")
            if step_name == name:
                return step
        time.sleep(0.25)
    return None


__all__ = [
    "SlurmError",
    "allocation_id",
    "run",
    "slurm_message",
    "submit",
    "submit_and_wait",
    "parse_job_id",
    "job_info",
    "job_workdir",
    "hostnames",
    "steps",
    "find_step",
]
