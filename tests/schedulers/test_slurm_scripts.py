"""The sbatch scripts monarch generates, against golden files; option parsing and validation.

None of this needs Slurm: a dry run renders the script and submits nothing. To accept a
deliberate change of a script, run with MONARCH_UPDATE_GOLDEN=1 and review the diff.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from monarch_cli.errors import UserError
from monarch_cli.jobs import JobError, dryrun
from monarch_cli.jobs.slurm_batch import render_batch_script, split_sbatch_options

from ..conftest import assert_golden

GOLDEN = Path(__file__).parent / "golden"
REPO = Path(__file__).resolve().parents[2]
TORCHRUN = ["torchrun", "--nproc-per-node=2", "train.py", "--epochs", "3"]


@pytest.fixture(autouse=True)
def _outside_any_allocation(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in list(os.environ):
        if name.startswith("SLURM_"):
            monkeypatch.delenv(name)


def _normalize(text: str, workdir: Path) -> str:
    text = text.replace(str(workdir.resolve()), "/project").replace(sys.executable, "/usr/bin/python3")
    return re.sub(r"(slurm-|monarch-)[0-9a-f]{8}\b", r"\1RID", text)


def _golden(name: str, text: str) -> None:
    assert_golden(GOLDEN / name, text)


def test_serve_script_minimal(tmp_path: Path) -> None:
    plan = dryrun(TORCHRUN, "slurm", hosts=2, state=tmp_path / ".monarch" / "job_state.pkl")
    assert plan.scheduler == "slurm" and "2 node(s)" in plan.summary
    _golden("serve_minimal.sbatch", _normalize(plan.artifacts["sbatch script"], tmp_path))


def test_serve_script_with_every_cluster_option(tmp_path: Path) -> None:
    plan = dryrun(
        TORCHRUN,
        "slurm",
        hosts=4,
        state=tmp_path / ".monarch" / "job_state.pkl",
        preload="torch,numpy",
        partition="gpu",
        time="2:00:00",
        gpus_per_node=8,
        cpus_per_task=16,
        mem="200G",
        account="research",
        qos="high",
        constraint="a100",
        exclusive=True,
        sbatch_args=["--reservation=big", "--mail-type=END"],
    )
    _golden("serve_all_options.sbatch", _normalize(plan.artifacts["sbatch script"], tmp_path))


def test_batch_script_through_the_cli(tmp_path: Path) -> None:
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "monarch_cli",
            "sbatch",
            "-N",
            "2",
            "--time",
            "1:00:00",
            "--signal=B:USR1@120",
            "--requeue",
            "-p",
            "gpu",
            "--dry-run",
            "--",
            *TORCHRUN,
        ],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=60,
        env={k: v for k, v in os.environ.items() if not k.startswith("SLURM_")} | {"PYTHONPATH": str(REPO)},
    )
    assert done.returncode == 0, done.stderr
    _golden("batch.sbatch", _normalize(done.stdout, tmp_path))


def test_batch_script_keeps_a_given_job_name_and_task_layout(tmp_path: Path) -> None:
    _, options, _ = split_sbatch_options(["-J", "mine", "--ntasks-per-node=8", "--", "python", "t.py"])
    script = render_batch_script(["python", "t.py"], options, tmp_path, "/usr/bin/python3")
    assert "#SBATCH -J mine\n" in script and "--job-name" not in script
    assert "#SBATCH --ntasks-per-node=8\n" in script and "--ntasks-per-node=1" not in script


@pytest.mark.parametrize(
    "args, own, options, command",
    [
        (["-N", "2", "--", "torchrun", "t.py"], {}, ["-N 2"], ["torchrun", "t.py"]),
        (["--nodes=2", "python", "t.py", "--lr", "1"], {}, ["--nodes=2"], ["python", "t.py", "--lr", "1"]),
        (
            ["-N2", "--exclusive", "--time", "5", "python", "-u", "t.py"],
            {},
            ["-N2", "--exclusive", "--time=5"],
            ["python", "-u", "t.py"],
        ),
        (
            ["--dry-run", "--state", "s.pkl", "--requeue", "--", "python", "t.py", "--dry-run"],
            {"--dry-run": True, "--state": "s.pkl"},
            ["--requeue"],
            ["python", "t.py", "--dry-run"],
        ),
        (["--signal", "B:USR1@60", "--wait"], {"--wait": True}, ["--signal=B:USR1@60"], []),
    ],
)
def test_split_sbatch_options(args, own, options, command) -> None:
    assert split_sbatch_options(args, ("--dry-run", "--json", "--wait"), ("--state",)) == (own, options, command)


def test_option_without_its_value_is_an_error() -> None:
    with pytest.raises(JobError, match="--time needs a value"):
        split_sbatch_options(["--time"])


@pytest.mark.parametrize(
    "options, needle",
    [
        ({"partition": "a b"}, "--partition for Slurm must be non-empty and without spaces"),
        ({"sbatch_args": ["reservation=x"]}, "--sbatch-arg takes one sbatch option"),
        ({"colour": "blue"}, "unknown slurm option(s): colour"),
    ],
)
def test_bad_slurm_options_are_refused_before_anything_starts(tmp_path: Path, options, needle) -> None:
    with pytest.raises(UserError) as info:
        dryrun(TORCHRUN, "slurm", hosts=1, state=tmp_path / "s.pkl", **options)
    assert needle in str(info.value) and "\n" not in str(info.value)


def test_cli_refuses_a_bad_option_in_one_line(tmp_path: Path) -> None:
    done = subprocess.run(
        [sys.executable, "-m", "monarch_cli", "serve", "--scheduler", "slurm", "--partition", "a b", "--dry-run"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=60,
        env={k: v for k, v in os.environ.items() if not k.startswith("SLURM_")} | {"PYTHONPATH": str(REPO)},
    )
    lines = [l for l in done.stderr.splitlines() if l.strip()]
    assert done.returncode == 2 and len(lines) == 1 and "without spaces" in lines[0], done.stderr


def test_serve_dry_run_through_the_cli_prints_the_same_script(tmp_path: Path) -> None:
    """The CLI's cluster flags map onto the same sbatch lines as the Python options."""
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "monarch_cli",
            "serve",
            "--scheduler",
            "slurm",
            "--nodes",
            "4",
            "--dry-run",
            "--preload",
            "torch,numpy",
            "--partition",
            "gpu",
            "--time",
            "2:00:00",
            "--gpus-per-node",
            "8",
            "--cpus-per-task",
            "16",
            "--mem",
            "200G",
            "--account",
            "research",
            "--qos",
            "high",
            "--constraint",
            "a100",
            "--exclusive",
            "--sbatch-arg=--reservation=big",
            "--sbatch-arg=--mail-type=END",
            "--",
            *TORCHRUN,
        ],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=60,
        env={k: v for k, v in os.environ.items() if not k.startswith("SLURM_")} | {"PYTHONPATH": str(REPO)},
    )
    assert done.returncode == 0, done.stderr
    assert (GOLDEN / "serve_all_options.sbatch").read_text() in _normalize(done.stdout, tmp_path), done.stdout


def test_sbatch_dry_run_makes_the_checks_the_real_submit_makes(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")} | {"PYTHONPATH": str(REPO)}
    for args, needle in ((["--parsable"], "not an option here"), (["--", "torchrun", "--nnode=2", "t.py"], "--nnodes")):
        argv = [*args, "--", "python", "t.py"] if args[0] != "--" else args
        done = subprocess.run(
            [sys.executable, "-m", "monarch_cli", "sbatch", "--dry-run", *argv],
            cwd=tmp_path,
            capture_output=True,
            text=True,
            timeout=60,
            env=env,
        )
        lines = [l for l in done.stderr.splitlines() if l.strip()]
        assert done.returncode == 2 and len(lines) == 1 and needle in lines[0], done.stderr
