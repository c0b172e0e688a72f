"""``--scheduler torchx:<name>``: real torchx, its real ``local_cwd`` scheduler, real agents and ranks.

The Slurm half (torchx's own ``slurm`` scheduler against the real test cluster) is in
``tests/slurm/test_torchx_slurm.py``; the Kubernetes half is a dry run: the API server emulator
of tests/kubernetes knows no Volcano (docs/torchx.md). The zero-install path (replicas that do
not share this machine's filesystem) runs for real on ``local_cwd`` with ``-o
agent_ship_bundle=true`` and a stock interpreter that has nothing of ours.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import psutil
import pytest

from ..conftest import one_line_error, wait_until
from ..kubernetes.kubelet import stock_python
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


def test_kubernetes_dry_run_mounts_the_keys_secret_runs_the_bootstrap_and_holds_no_secret(tmp_path: Path) -> None:
    """torchx's Volcano job as it will be submitted: each pod mounts the reservation's Secret (made at
    reserve, never printed) and an emptyDir for the bundle, and runs the stdlib bootstrap under the
    image's python3; the keys are in no env value, argument or line of the output."""
    state = tmp_path / ".monarch" / "job_state.pkl"
    done = monarch(
        "serve", "--scheduler", "torchx:kubernetes", "--hosts", "2", "--dry-run", "--json", "--queue", "default",
        "-o", "agent_image=pytorch/pytorch:2.5.1-cuda12.4-cudnn9-runtime",
        "--", "torchrun", "--nproc-per-node=1", "t.py", cwd=tmp_path, state=state, timeout=120,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert done.stderr.strip() == "", done.stderr  # no torchx warnings on the user's terminal
    plan = json.loads(done.stdout)
    request = plan["artifacts"]["torchx kubernetes dry run"]
    assert "kind: Job" in request and "batch.volcano.sh" in request  # torchx's Volcano job, printed
    assert request.count("image: pytorch/pytorch:2.5.1") == 2
    secret = f"{plan['reservation_id']}-keys"
    assert request.count(f"secretName: {secret}") == 2 and request.count("mountPath: /etc/monarch/keys") == 2
    assert request.count("mountPath: /var/lib/monarch-cli") == 2  # the emptyDir the bundle is unzipped into
    assert request.count("exec python3 -c 'import hashlib, hmac") == 2  # the bootstrap, not our agent
    assert "value: /etc/monarch/keys/keys" in request  # MONARCH_KEY_FILE names the mounted file, nothing more
    assert request.count("fieldPath: status.podIP") == 2  # each agent's own address, from the pod
    steps = " ".join(plan["steps"])
    assert f"create Secret default/{secret}" in steps and "HMAC" in steps
    assert not state.exists() and not (tmp_path / ".monarch" / "torchx").exists()  # a dry run starts nothing
    # No cluster here: reserving stops at the first API call (the Secret), in one line, and leaves nothing.
    (tmp_path / "plan.json").write_text(done.stdout)
    refused = monarch("serve", "--plan", "plan.json", cwd=tmp_path, state=state, timeout=120)
    one_line_error(refused, "cannot load the Kubernetes configuration")
    assert not state.exists() and not (tmp_path / ".monarch" / "torchx" / plan["reservation_id"]).exists()


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
    missing = subprocess.run(
        [sys.executable, "-m", "monarch_cli", "serve", "--scheduler", "torchx:local_cwd", "--dry-run", "--",
         "python", "t.py"],
        cwd=tmp_path, capture_output=True, text=True, timeout=60, env={**os.environ, "PYTHONPATH": env_path},
    )  # fmt: skip
    line = one_line_error(missing, "torchx-nightly")
    assert "monarch-cli" not in line.split("error:", 1)[1]  # never a hint to install this project by name


def _maps_of(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/maps").read_text(errors="replace")
    except OSError:  # it has exited since it was listed
        return ""


@pytest.mark.slow
def test_replicas_without_our_code_get_the_bundle_shipped_and_run_a_two_host_job(
    tmp_path_factory: pytest.TempPathFactory, tmp_path: Path
) -> None:
    """The path of replicas that do not see this machine's filesystem (torchx:kubernetes, local_docker),
    forced on local_cwd: each replica runs the bootstrap under a stock interpreter (torch, no zmq, nothing
    of ours), the client ships the bundle to it, and the agents run from the shipped parts."""
    stock = stock_python(tmp_path_factory.mktemp("stock") / "venv")
    lacks = subprocess.run([stock, "-c", "import zmq"], capture_output=True, text=True, cwd="/")
    assert "No module named 'zmq'" in lacks.stderr
    (tmp_path / "train.py").write_text(TRAIN)
    state = tmp_path / ".monarch" / "job_state.pkl"
    served = monarch(
        "serve", "--scheduler", "torchx:local_cwd", "--hosts", "2", "--json",
        "-o", "agent_ship_bundle=true", "-o", f"agent_python={stock}",
        "--", "torchrun", "--nproc-per-node=1", "train.py", cwd=tmp_path, state=state, timeout=300,
    )  # fmt: skip
    assert served.returncode == 0, served.stderr
    rid = json.loads(served.stdout)["reservation_id"]
    try:
        torchx = json.loads(monarch("status", "--json", cwd=tmp_path, state=state).stdout)["torchx"]
        shipped = torchx["bundle"]
        assert len(shipped) == 2 and all(p and p["shipped"] > 1_000_000 for p in shipped), shipped
        agents = {p.pid: p.info["cmdline"] for p in psutil.process_iter(["cmdline"])}
        agents = {pid: cmd for pid, cmd in agents.items() if cmd and cmd[0].startswith(f"monarch agent {rid} host")}
        assert len(agents) == 2, agents
        for pid, cmd in agents.items():
            host = cmd[0].rsplit(" ", 1)[1]
            where = f"/bundles/{host}/{shipped[0]['deps']}/site/zmq"
            assert where in _maps_of(pid) and str(tmp_path) in _maps_of(pid), (pid, host)  # pyzmq as shipped
        run = monarch("run-spmd", "--no-color", cwd=tmp_path, state=state, timeout=300)
        assert run.returncode == 0, run.stderr
        lines = sorted(line for line in run.stdout.splitlines() if line.startswith("[rank"))
        assert lines == [f"[rank{r}] rank {r} sum 2 group {r}" for r in range(2)], run.stdout
        text = monarch("status", cwd=tmp_path, state=state).stdout
        assert f"bundle: {shipped[0]['code']} and {shipped[0]['deps']} shipped to 2 replica(s)" in text, text
    finally:
        stopped = monarch("stop", cwd=tmp_path, state=state, timeout=120)
    assert stopped.returncode == 0, stopped.stderr
    assert wait_until(lambda: not _agents_of(rid), 30), [p.cmdline() for p in _agents_of(rid)]
    left = sorted(p.name for p in (tmp_path / ".monarch" / "torchx" / rid).iterdir())
    assert left == ["logs"], left  # the key file and the shipped bundles go with the reservation; torchx's logs stay


def test_local_docker_dry_run_bind_mounts_the_key_file_and_runs_the_bootstrap(tmp_path: Path) -> None:
    """No docker daemon here: the plan only. The containers get the 0600 key file read-only (the daemon is
    on this machine) and the image's python3 runs the bootstrap; no key exists yet, so none is printed."""
    done = monarch(
        "serve", "--scheduler", "torchx:local_docker", "--hosts", "2", "--dry-run", "--json",
        "-o", "agent_image=pytorch/pytorch:2.5.1-cuda12.4-cudnn9-runtime", "--", "python", "t.py", cwd=tmp_path,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    plan = json.loads(done.stdout)
    request = plan["artifacts"]["torchx local_docker dry run"]
    keys = f"{tmp_path}/.monarch/torchx/{plan['reservation_id']}/keys"
    assert request.count(f"Source: {keys}") == 1 and "Target: /etc/monarch/keys/keys" in request  # one anchor
    assert request.count("ReadOnly: true") == 1 and request.count("mounts: *") == 1  # ...shared by both
    assert request.count("exec python3 -c 'import hashlib, hmac") == 2
    assert "(0600), bind-mounted read-only" in " ".join(plan["steps"])
    assert not (tmp_path / ".monarch" / "torchx").exists()


def test_a_registered_scheduler_without_a_key_channel_plans_but_refuses_to_reserve_in_one_line(tmp_path: Path) -> None:
    """A scheduler another package registers with torchx (here a torchx plugin named ``elsewhere``): monarch
    knows no secure way to hand its replicas the keys, so the plan says so and serve refuses, naming what to
    use instead; ``-o agent_shared_fs=true`` (its hosts do share this filesystem) makes it reservable."""
    plugins = tmp_path / "plugins" / "torchx_plugins" / "schedulers"
    plugins.mkdir(parents=True)
    (plugins / "elsewhere.py").write_text(
        "from torchx.plugins import register\n"
        "from torchx.schedulers.local_scheduler import create_scheduler\n\n\n"
        "@register.scheduler()\n"
        "def elsewhere(session_name, **kwargs):\n"
        "    return create_scheduler(session_name, **kwargs)\n"
    )
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path / "plugins"), os.environ.get("PYTHONPATH", "")])}

    def monarch_here(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run(
            [sys.executable, "-m", "monarch_cli", *args], cwd=tmp_path, capture_output=True, text=True, timeout=120,
            env={**env, "MONARCH_STATE": str(tmp_path / ".monarch" / "job_state.pkl")}, stdin=subprocess.DEVNULL,
        )  # fmt: skip

    planned = monarch_here(
        "serve", "--scheduler", "torchx:elsewhere", "--hosts", "2", "--dry-run", "--", "python", "t.py"
    )
    assert planned.returncode == 0, planned.stderr
    assert "no secure way to hand them the reservation keys" in planned.stdout
    refused = monarch_here("serve", "--scheduler", "torchx:elsewhere", "--hosts", "2", "--", "python", "t.py")
    one_line_error(refused, "torchx elsewhere", "no secure way", "-o agent_shared_fs=true")
    assert not (tmp_path / ".monarch" / "job_state.pkl").exists()
    shared = monarch_here(
        "serve", "--scheduler", "torchx:elsewhere", "--hosts", "2", "--dry-run", "-o", "agent_shared_fs=true",
        "--", "python", "t.py",
    )  # fmt: skip
    assert shared.returncode == 0 and "no secure way" not in shared.stdout, shared.stderr


def test_a_replica_address_without_a_route_from_here_is_said_once_while_waiting() -> None:
    """torchx:kubernetes gives pod IPs; from outside a cluster they may have no route: serve says so at once
    (once per replica), rather than only timing out minutes later. A refused port (not listening yet) is quiet."""
    from monarch_cli.schedulers.torchx.shipping import BundleShipper

    if os.geteuid() != 0:
        pytest.skip("an unreachable route needs root")
    subnet = "10.219.77.0/24"
    subprocess.run(["ip", "route", "del", "unreachable", subnet], capture_output=True)
    subprocess.run(["ip", "route", "add", "unreachable", subnet], check=True)
    said: list[str] = []
    try:
        shipper = BundleShipper(b"key", None, "/bundles", said.append)
        assert not shipper.answers(0, "10.219.77.5", 26600) and not shipper.answers(0, "10.219.77.5", 26600)
        assert not shipper.answers(1, "127.0.0.1", 1)  # refused: nothing listens there yet
    finally:
        subprocess.run(["ip", "route", "del", "unreachable", subnet], capture_output=True)
    assert said == [
        "replica 0: 10.219.77.5:26600 does not answer from here (No route to host); its address must be routable "
        "from this client (torchx:kubernetes: run serve in the cluster)"
    ], said
