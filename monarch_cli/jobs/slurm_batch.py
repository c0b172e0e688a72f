"""``monarch sbatch``: unattended runs inside a Slurm allocation.

``python -m monarch_cli.jobs.slurm_batch run --state-dir D -- CMD`` is what a ``monarch sbatch``
script runs in the allocation (the per-node agent entry point is the Slurm backend's
:mod:`monarch_cli.schedulers.slurm.node`): it serves the allocation's nodes (agents in an ``srun
--overlap`` step), runs CMD once with ``Job.run_spmd`` (rank-prefixed output into the Slurm
output file, per-rank logs under ``D/logs``), relays Slurm's warning signals to the ranks,
stops the agents and exits with the run's status, which becomes the job's exit code.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import signal
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from ..schedulers.slurm.commands import (
    SlurmError,
    allocation_id,
    job_info,
    job_workdir,
    parse_job_id,
    submit,
    submit_and_wait,
)
from ..schedulers.slurm.scheduler import load_template, sbatch_lines
from ..sysutil import atomic_write
from .errors import JobError
from .state import find_state_dir, state_path
from .torchrun import parse_command

#: Signals a batch run relays to its ranks: Slurm's usual warning signals before a time limit
#: or preemption (``--signal=B:USR1@120``), and the SIGTERM of ``scancel``/preemption.
FORWARDED = (signal.SIGUSR1, signal.SIGUSR2, signal.SIGTERM)
#: sbatch options that take no value (anything else not written ``--opt=value`` takes the next word).
_NO_VALUE = frozenset(
    "-H --hold --ignore-pbs -k --no-kill --no-requeue -O --overcommit --parsable -Q --quiet --reboot --requeue "
    "-s --oversubscribe --spread-job --use-min-nodes -v --verbose -W --wait --contiguous --exclusive --test-only "
    "--get-user-env".split()
)
#: Options that belong on sbatch's command line, not in the script.
_COMMAND_LINE_ONLY = frozenset({"-W", "--wait", "--parsable", "--test-only"})


# ------------------------------------------------------------------- submitting
def split_sbatch_options(
    args: Sequence[str], own_flags: Sequence[str] = (), own_values: Sequence[str] = ()
) -> tuple[dict[str, Any], list[str], list[str]]:
    """Split ``[OPTIONS] [--] CMD...`` into (our own options, sbatch options as whole words, command).

    ``own_flags``/``own_values`` are monarch's options (``--dry-run``, ``--state PATH``);
    everything else before the command is sbatch's. An sbatch option takes the next word
    unless it is written ``--opt=value``/``-Nvalue`` or is one of sbatch's flags.
    """
    own: dict[str, Any] = {}
    options: list[str] = []
    i = 0
    while i < len(args):
        word = args[i]
        if word == "--":
            return own, options, list(args[i + 1 :])
        if not word.startswith("-") or word == "-":
            return own, options, list(args[i:])
        name, eq, value = word.partition("=")
        if name in own_flags and not eq:
            own[name] = True
            i += 1
            continue
        takes_value = not (eq or word in _NO_VALUE or (len(word) > 2 and word[1] != "-"))
        if takes_value and i + 1 >= len(args):
            raise JobError(f"option {word} needs a value")
        if name in own_values:
            own[name] = value if eq else args[i + 1]
            i += 1 if eq else 2
        elif takes_value:
            options.append(f"{word}={args[i + 1]}" if word.startswith("--") else f"{word} {args[i + 1]}")
            i += 2
        else:
            options.append(word)
            i += 1
    return own, options, []


def render_batch_script(command: Sequence[str], options: Sequence[str], state_root: Path, python: str) -> str:
    """The script ``monarch sbatch`` submits (``options`` as from :func:`split_sbatch_options`)."""
    for opt in options:
        if "\n" in opt:
            raise JobError(f"sbatch option {opt!r} holds a newline")
    if any(c.isspace() for c in str(state_root)):
        raise JobError(
            f"the state directory {state_root} contains whitespace, which sbatch scripts cannot carry; "
            "use --state with a path without spaces"
        )
    names = {o.split("=")[0].split(" ")[0] for o in options}
    lines = [o for o in options if o.split("=")[0] not in _COMMAND_LINE_ONLY]
    if not names & {"-J", "--job-name"}:
        lines.insert(0, "--job-name=monarch-batch")
    if not names & {"--ntasks-per-node", "-n", "--ntasks"}:
        lines.append("--ntasks-per-node=1")
    return load_template("slurm_batch.sbatch").substitute(
        sbatch_lines=sbatch_lines(lines),
        state_root=shlex.quote(str(state_root)),
        python=shlex.quote(python),
        forwarded=", ".join(signal.Signals(s).name for s in FORWARDED),
        command=shlex.join(command),
    )


def batch_script(command: Sequence[str], options: Sequence[str], state: Path | None = None) -> str:
    """The ``monarch sbatch`` script, after every check a submit makes (``--dry-run`` prints this)."""
    if not command:
        raise JobError(
            "give the command to run after `--`, e.g. monarch sbatch -N 2 -- torchrun --nproc-per-node=2 train.py"
        )
    parse_command(list(command))  # a bad command is an error now, not in the allocation
    cli_only = [o for o in options if o.split("=")[0] in _COMMAND_LINE_ONLY]
    if cli_only:
        raise JobError(f"{' '.join(cli_only)}: not an option here; use `monarch sbatch --wait` to wait for the job")
    return render_batch_script(command, options, state_path(state).parent.resolve(), sys.executable)


def write_batch_script(command: Sequence[str], options: Sequence[str], state: Path | None = None) -> Path:
    """Render the ``monarch sbatch`` script into the state directory and return its path."""
    script = batch_script(command, options, state)
    scripts = state_path(state).parent.resolve() / "slurm" / "scripts"
    scripts.mkdir(mode=0o700, parents=True, exist_ok=True)
    path = scripts / f"batch-{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}.sbatch"
    atomic_write(path, script, 0o600)
    return path


def submit_batch(
    command: Sequence[str],
    options: Sequence[str],
    state: Path | None = None,
    *,
    wait: bool = False,
    on_submitted: Callable[[str], None] | None = None,
) -> tuple[str, int | None]:
    """Submit a ``monarch sbatch`` job: (job id, its exit code when ``wait``, else None)."""
    path = write_batch_script(command, options, state)
    if not wait:
        job_id = submit(path)
        if on_submitted is not None:
            on_submitted(job_id)
        return job_id, None
    return submit_and_wait(path, on_submitted or (lambda _id: None))


def batch_dir(job_id: str, state: Path | str | None = None) -> Path:
    """Where a batch job keeps its state, result and logs (by the submitting directory's state path)."""
    if not job_id.isdigit():
        raise JobError(f"--job takes a Slurm job id (a number), not {job_id!r}")
    local = state_path(state).parent.resolve() / "slurm" / f"job-{job_id}"
    if local.exists():
        return local
    info = job_info(job_id) or {}
    workdir = job_workdir(job_id) if info else None
    if workdir is not None:
        found = find_state_dir(workdir)  # (None where the job's .monarch is another user's: not read)
        candidate = found / "slurm" / f"job-{job_id}" if found is not None else None
        if candidate is not None and candidate.exists():
            return candidate
    if info:
        return local  # known to Slurm, not started yet: this is where it will be
    raise JobError(
        f"no monarch batch job {job_id}: nothing at {local}, and Slurm does not know the job "
        "(run this where you ran `monarch sbatch`, or pass the same --state)"
    )


def batch_status(job_id: str, state: Path | None = None) -> dict[str, Any]:
    """A batch job seen from outside: Slurm's view, its record, and its reservation while it runs."""
    directory = batch_dir(job_id, state)
    info = job_info(job_id)
    record = _read_json(directory / "batch.json") or {}
    status: dict[str, Any] = {"job_id": job_id, "dir": str(directory), "slurm": info or None, **record}
    state_file = directory / "job_state.pkl"
    if state_file.exists() and record.get("phase") == "running":
        from .job import job_load
        from .state import StateError

        try:
            status["reservation"] = job_load(state_file).status()
        except StateError:
            pass
    if record.get("phase") == "finished":
        status["alive"] = False
    else:
        status["alive"] = info is not None and info.get("state") in ("PENDING", "CONFIGURING", "RUNNING")
    return status


def _read_json(path: Path) -> dict[str, Any] | None:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def _write_json(path: Path, data: dict[str, Any]) -> None:
    atomic_write(path, json.dumps(data, indent=1), 0o600)  # (the command and its arguments: yours only)


# ------------------------------------------------------------------- in the allocation
def run_main(state_dir: Path, command: list[str]) -> int:
    """Serve this allocation, run ``command`` once, stop, and return the run's exit status."""
    from .reserve import serve

    job_id = allocation_id()
    if not job_id:
        print("monarch batch: not inside a Slurm allocation ($SLURM_JOB_ID is not set)", file=sys.stderr)
        return 2
    state_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
    record: dict[str, Any] = {"job_id": job_id, "phase": "starting", "command": command, "started_at": time.time()}
    _write_json(state_dir / "batch.json", record)
    say = lambda msg: print(f"monarch: {msg}", file=sys.stderr, flush=True)  # noqa: E731
    nodes = int(os.environ.get("SLURM_JOB_NUM_NODES") or os.environ.get("SLURM_NNODES") or 1)
    try:
        job = serve(command, "slurm", hosts=nodes, state=state_dir / "job_state.pkl", progress=say)
    except (JobError, ValueError, OSError) as e:
        say(f"error: {e}")
        _write_json(state_dir / "batch.json", {**record, "phase": "finished", "exit_code": 1, "error": str(e)})
        return 1
    _write_json(state_dir / "batch.json", {**record, "phase": "running"})
    say(
        f"{len(job.state.hosts)} node(s) up ({', '.join(h.name for h in job.state.hosts)}); running "
        f"{shlex.join(command)}"
    )
    code, result = 1, None
    try:
        result = job.run_spmd(forward_signals=FORWARDED, on_event=say)
        code = result.exit_code
    except JobError as e:
        say(f"error: {e}")
    finally:
        job.stop()
    done = {**record, "phase": "finished", "exit_code": code, "finished_at": time.time()}
    if result is not None:
        done.update(
            run_id=result.run_id,
            log_dir=str(result.log_dir),
            duration=round(result.duration, 3),
            first_failure=result.first_failure.rank if result.first_failure else None,
        )
        how = "ok" if code == 0 else f"rank {result.first_failure.rank if result.first_failure else '?'} failed"
        say(f"run {result.run_id}: {how}, exit status {code}; per-rank logs in {result.log_dir}")
    _write_json(state_dir / "batch.json", done)
    return code


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m monarch_cli.jobs.slurm_batch", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="what", required=True)
    run = sub.add_parser("run", help="serve this allocation, run the command once, exit with its status")
    run.add_argument("--state-dir", type=Path, required=True)
    run.add_argument("command", nargs=argparse.REMAINDER)
    args = parser.parse_args(argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        parser.error("no command after --")
    return run_main(args.state_dir, command)


if __name__ == "__main__":
    sys.exit(main())


__all__ = [
    "FORWARDED",
    "split_sbatch_options",
    "render_batch_script",
    "batch_script",
    "write_batch_script",
    "submit_batch",
    "batch_dir",
    "batch_status",
    "SlurmError",
    "parse_job_id",
]
