"""``--scheduler torchx:<name>``: real torchx, its real ``local_cwd`` scheduler, real agents and ranks.

The Slurm half (torchx's own ``slurm`` scheduler against the real test cluster) is in
``tests/slurm/test_torchx_slurm.py``; the Kubernetes half is a dry run, since no API server
runs here (docs/torchx.md).
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import psutil
import pytest

from ..conftest import one_line_error, wait_until
from ..test_cli import TRAIN, monarch


def _agents_of(reservation: str) -> list[psutil.Process]:
    """Every live process of the reservation: agents (their title names it) and their children."""
    found = []
    for proc in psutil.process_iter(["cmdline"]):
        try:
            if any(reservation in part for part in proc.info["cmdline"] or []):
                found.append(proc)
        except psutil.Error:
            continue
    return found


@pytest.mark.slow
def test_local_cwd_serve_run_rerun_status_stop_leaves_nothing(tmp_path: Path) -> None:
    (tmp_path / "train.py").write_text(TRAIN)
    state = tmp_path / ".monarch" / "job_state.pkl"
    served = monarch(
        "serve", "--scheduler", "torchx:local_cwd", "--hosts", "2", "--json", "--",
        "torchrun", "--nproc-per-node=2", "train.py", cwd=tmp_path, state=state, timeout=300,
    )  # fmt: skip
    assert served.returncode == 0, served.stderr
    info = json.loads(served.stdout)
    rid = info["reservation_id"]
    try:
        assert info["scheduler"] == "torchx:local_cwd" and len(info["hosts"]) == 2
        assert _agents_of(rid), "the agents outlive serve: torchx's local scheduler no longer holds them"
        for attempt in range(2):  # the first run warms up, the second re-uses the warm processes
            run = monarch("run-spmd", "--no-color", cwd=tmp_path, state=state, timeout=300)
            assert run.returncode == 0, run.stderr
            lines = sorted(line for line in run.stdout.splitlines() if line.startswith("[rank"))
            assert lines == [f"[rank{r}] rank {r} sum 4 group {r // 2}" for r in range(4)], (attempt, run.stdout)
        status = json.loads(monarch("status", "--json", cwd=tmp_path, state=state).stdout)
        torchx = status["torchx"]
        assert torchx["app_handle"].startswith("local_cwd://") and torchx["state"] == "RUNNING"
        assert Path(torchx["log_dir"]).is_dir()  # torchx's replica logs, kept with the reservation
    finally:
        stopped = monarch("stop", cwd=tmp_path, state=state, timeout=120)
    assert stopped.returncode == 0, stopped.stderr
    assert wait_until(lambda: not _agents_of(rid), 30), [p.cmdline() for p in _agents_of(rid)]


@pytest.mark.slow
def test_an_app_that_dies_outside_monarch_is_a_gone_reservation_in_one_line(tmp_path: Path) -> None:
    (tmp_path / "train.py").write_text(TRAIN)
    state = tmp_path / ".monarch" / "job_state.pkl"
    served = monarch(
        "serve", "--scheduler", "torchx:local_cwd", "--hosts", "2", "--json", "--", "python", "train.py",
        cwd=tmp_path, state=state, timeout=300,
    )  # fmt: skip
    assert served.returncode == 0, served.stderr
    rid = json.loads(served.stdout)["reservation_id"]
    try:
        for proc in _agents_of(rid):
            proc.kill()  # as if the torchx app failed, or a user killed it by hand
        assert wait_until(lambda: not _agents_of(rid), 30)
        run = monarch("run-spmd", cwd=tmp_path, state=state)
        line = one_line_error(run)
        assert "torchx app local_cwd://" in line and "exited" in line, line
    finally:
        monarch("stop", cwd=tmp_path, state=state)


def test_dry_run_is_torchx_own_request_and_serve_plan_carries_it_out(tmp_path: Path) -> None:
    """The printed plan holds torchx's dry run of exactly the AppDef reserve submits; `.torchxconfig`
    fills what -o leaves unset, as `torchx run` does; the plan round-trips through --plan."""
    (tmp_path / ".torchxconfig").write_text("[local_cwd]\nprepend_cwd = True\n")
    state = tmp_path / ".monarch" / "job_state.pkl"
    printed = monarch(
        "serve", "--scheduler", "torchx:local_cwd", "--hosts", "2", "--dry-run", "--json", "--", "python", "t.py",
        cwd=tmp_path, state=state,
    )  # fmt: skip
    assert printed.returncode == 0, printed.stderr
    plan = json.loads(printed.stdout)
    assert plan["data"]["cfg"]["prepend_cwd"] is True  # from .torchxconfig
    request = plan["artifacts"]["torchx local_cwd dry run"]
    assert request.count("monarch_cli.runtime.agent") == 2 and "MONARCH_KEY_FILE" in request
    assert not state.exists() and not (tmp_path / ".monarch" / "torchx").exists()  # a dry run starts nothing
    text = monarch("serve", "--scheduler", "torchx:local_cwd", "--dry-run", "--", "python", "t.py", cwd=tmp_path)
    assert text.returncode == 0 and "# torchx local_cwd dry run" in text.stdout, text.stderr
    (tmp_path / "plan.json").write_text(printed.stdout)
    served = monarch("serve", "--plan", "plan.json", "--json", cwd=tmp_path, state=state, timeout=300)
    try:
        assert served.returncode == 0, served.stderr
        assert json.loads(served.stdout)["reservation_id"] == plan["reservation_id"]
    finally:
        monarch("stop", cwd=tmp_path, state=state)
    assert wait_until(lambda: not _agents_of(plan["reservation_id"]), 30)


def test_kubernetes_dry_run_needs_no_cluster_and_holds_no_secret(tmp_path: Path) -> None:
    state = tmp_path / ".monarch" / "job_state.pkl"
    done = monarch(
        "serve", "--scheduler", "torchx:kubernetes", "--hosts", "2", "--dry-run", "--queue", "default",
        "-o", "agent_image=pytorch/pytorch:2.5.1-cuda12.4-cudnn9-runtime", "-o", "agent_python=python3",
        "--", "torchrun", "--nproc-per-node=1", "t.py", cwd=tmp_path, state=state, timeout=120,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert "kind: Job" in done.stdout and "batch.volcano.sh" in done.stdout  # torchx's Volcano job, printed
    assert done.stdout.count("image: pytorch/pytorch:2.5.1") == 2
    assert "its replicas do not share this machine's filesystem" in done.stdout  # the plan says it cannot reserve
    assert "MONARCH_KEYS" not in done.stdout and "secret" not in done.stdout.lower()
    assert done.stderr.strip() == "", done.stderr  # no torchx warnings on the user's terminal
    refused = monarch(
        "serve", "--scheduler", "torchx:kubernetes", "--hosts", "2", "--queue", "default", "--", "python", "t.py",
        cwd=tmp_path, state=state,
    )  # fmt: skip
    one_line_error(refused, "do not share this machine's filesystem")
    assert not state.exists()


def test_help_lists_the_torchx_schedulers_own_run_options(tmp_path: Path) -> None:
    from torchx.runner import get_runner

    with get_runner() as runner:
        declared = [name for name, _ in runner.scheduler_run_opts("slurm")]
    done = monarch("serve", "--scheduler", "torchx:slurm", "--help", cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert "torchx:slurm options" in done.stdout
    flat = " ".join(done.stdout.split())
    for name in declared:
        assert "--" + name.replace("_", "-") in flat or name in flat, name


def test_bad_names_and_a_missing_extra_are_one_line(tmp_path: Path) -> None:
    unknown = monarch("serve", "--scheduler", "torchx:nosuch", "--dry-run", "--", "python", "t.py", cwd=tmp_path)
    one_line_error(unknown, "torchx knows no scheduler 'nosuch'", "local_cwd", "slurm")
    bad = monarch(
        "serve", "--scheduler", "torchx:local_cwd", "--dry-run", "-o", "prepend_cwd=maybe", "--", "python", "t.py",
        cwd=tmp_path,
    )  # fmt: skip
    one_line_error(bad, "prepend_cwd")
    shadow = tmp_path / "shadow" / "torchx"
    shadow.mkdir(parents=True)
    (shadow / "__init__.py").write_text("raise ImportError('torchx is not installed here')\n")
    env_path = os.pathsep.join([str(shadow.parent), os.environ.get("PYTHONPATH", "")])
    import subprocess

    missing = subprocess.run(
        [sys.executable, "-m", "monarch_cli", "serve", "--scheduler", "torchx:local_cwd", "--dry-run", "--",
         "python", "t.py"],
        cwd=tmp_path, capture_output=True, text=True, timeout=60, env={**os.environ, "PYTHONPATH": env_path},
    )  # fmt: skip
    line = one_line_error(missing, "torchx-nightly")
    assert "monarch-cli" not in line.split("error:", 1)[1]  # never a hint to install this project by name
