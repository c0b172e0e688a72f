"""The SkyPilot task monarch builds: golden YAML, read back by SkyPilot's own loader; the dry run; bad input.

None of this contacts SkyPilot: the plan is data. To accept a deliberate change of a task,
run with MONARCH_UPDATE_GOLDEN=1 and review the diff.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from monarch_cli import __version__
from monarch_cli.jobs import dryrun
from monarch_cli.schedulers.skypilot import KEYS_SECRET, parse_minutes

from ..conftest import assert_golden, one_line_error

GOLDEN = Path(__file__).parent / "golden"
REPO = Path(__file__).resolve().parents[2]
TASK = "task.yaml (secrets redacted)"
ALL_OPTIONS: dict[str, Any] = dict(
    cluster="train-a100",
    gpus="A100:8",
    cloud="aws",
    region="us-east-1",
    image="docker:pytorch/pytorch:latest",
    disk_size=512,
    use_spot=True,
    autostop=30,
    time="1h30m",
)


def _normalize(text: str) -> str:
    text = re.sub(r"\b(sky-|monarch-)[0-9a-f]{8}\b", r"\1RID", text).replace(__version__, "VERSION")
    return re.sub(r'[^"\s]*/staged/bundle-[0-9a-f]{20}', "CACHE/staged/bundle-HASH", text)  # content-addressed


def _golden(name: str, text: str) -> str:
    return assert_golden(GOLDEN / name, text)


def _sky_task(text: str) -> Any:
    """``text`` read by SkyPilot itself, as ``sky launch task.yaml`` would."""
    import sky

    return sky.Task.from_yaml_config(yaml.safe_load(text))


def _monarch(*args: str, cwd: Path, pythonpath: str = str(REPO)) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "monarch_cli", *args],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, "PYTHONPATH": pythonpath},
    )


def _without_skypilot(tmp_path: Path) -> str:
    """A PYTHONPATH on which ``import sky`` fails, as without the extra."""
    fake = tmp_path / "nosky" / "sky"
    fake.mkdir(parents=True)
    (fake / "__init__.py").write_text("raise ImportError(\"No module named 'sky'\")\n")
    return f"{tmp_path / 'nosky'}:{REPO}"


def test_minimal_task_is_golden_and_skypilot_reads_it(tmp_path: Path) -> None:
    plan = dryrun(["python", "train.py"], "skypilot", hosts=2, state=tmp_path / ".monarch" / "job_state.pkl")
    text = _golden("task_minimal.yaml", _normalize(plan.artifacts[TASK]))
    task = _sky_task(text)
    (res,) = task.resources
    assert task.num_nodes == 2 and res.cloud is None and res.accelerators is None
    assert res.ports == ["26600"]  # the agents' fixed port, opened where the cloud has a firewall
    assert not res.autostop_config or not res.autostop_config.enabled  # nothing asked: the cluster stays up
    assert "pip" not in task.setup and "monarch-cli==" not in task.setup  # nothing installed by name
    assert "zipfile" in task.setup and task.file_mounts == {"~/.monarch-bundle": "CACHE/staged/bundle-HASH"}
    assert "--keys-stdin --port 26600" in task.run and '--name "node$SKYPILOT_NODE_RANK"' in task.run


def test_task_with_every_option_is_golden_and_skypilot_reads_it(tmp_path: Path) -> None:
    plan = dryrun(
        ["python", "train.py"],
        "skypilot",
        hosts=4,
        state=tmp_path / "s.pkl",
        agent_port=29000,
        port_range=(30000, 30100),
        **ALL_OPTIONS,
    )
    text = _golden("task_all_options.yaml", _normalize(plan.artifacts[TASK]))
    task = _sky_task(text)
    (res,) = task.resources
    assert task.name == "train-a100" and task.num_nodes == 4
    assert str(res.cloud) == "AWS" and res.region == "us-east-1" and res.accelerators == {"A100": 8}
    assert res.use_spot and res.disk_size == 512 and list(res.image_id.values()) == ["docker:pytorch/pytorch:latest"]
    assert res.ports == ["29000", "30000-30100"]
    # --time 1h30m: the agents end after 90 min, then the idle cluster is torn down (autostop 30 min, down).
    assert res.autostop_config.enabled and res.autostop_config.idle_minutes == 30 and res.autostop_config.down
    assert "timeout --signal=TERM --kill-after=30s 5400s" in task.run
    assert _normalize(plan.data["task"]["run"]) == task.run  # what reserve launches is what prints


def test_the_secret_is_never_in_the_plan(tmp_path: Path) -> None:
    plan = dryrun(["python", "train.py"], "skypilot", hosts=1, state=tmp_path / "s.pkl", **ALL_OPTIONS)
    assert plan.data["task"]["secrets"] == {KEYS_SECRET: None}  # the value is added in memory at launch
    task = _sky_task(plan.artifacts[TASK])
    assert {k: v.get_secret_value() for k, v in task.secrets.items()} == {KEYS_SECRET: "<redacted>"}
    # The run script hands the secret to the agent on stdin and drops it before exec.
    run = plan.data["task"]["run"]
    assert f'exec 3<<<"${KEYS_SECRET}"\nunset {KEYS_SECRET}\nexec ' in run and run.rstrip().endswith("<&3 3<&-")


def test_dry_run_from_the_cli_prints_yaml_and_the_sky_launch_line(tmp_path: Path) -> None:
    # SkyPilot cannot even be imported: the dry run neither needs it nor contacts its API server.
    done = _monarch(
        "serve",
        "--scheduler",
        "skypilot",
        "--hosts",
        "2",
        "--gpus",
        "H100:8",
        "--cloud",
        "gcp",
        "--cluster",
        "mesh",
        "--dry-run",
        "--",
        "python",
        "train.py",
        cwd=tmp_path,
        pythonpath=_without_skypilot(tmp_path),
    )
    assert done.returncode == 0, done.stderr
    out = done.stdout
    assert "# task.yaml (secrets redacted)" in out and "accelerators: H100:8" in out and "num_nodes: 2" in out
    assert f"sky launch -c mesh --secret {KEYS_SECRET} --detach-run -y task.yaml" in out
    assert f"{KEYS_SECRET}: <redacted>" in out
    assert not (tmp_path / ".monarch").exists() or not any((tmp_path / ".monarch").iterdir())  # nothing reserved
    done = _monarch("serve", "--scheduler", "skypilot", "--hosts", "2", "--dry-run", "--json", cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    plan = json.loads(done.stdout)
    assert plan["scheduler"] == "skypilot" and plan["data"]["task"]["num_nodes"] == 2
    assert plan["artifacts"]["equivalent command"].startswith("sky launch -c monarch-")
    _sky_task(plan["artifacts"][TASK])


def test_without_skypilot_installed_serve_says_what_to_install(tmp_path: Path) -> None:
    done = _monarch(
        "serve",
        "--scheduler",
        "skypilot",
        "--",
        "python",
        "train.py",
        cwd=tmp_path,
        pythonpath=_without_skypilot(tmp_path),
    )
    one_line_error(done, "the skypilot scheduler needs SkyPilot, which is not installed: pip install 'skypilot>=0.10'")


@pytest.mark.parametrize(
    "args, message",
    [
        (["--hosts", "0"], "--hosts must be at least 1"),
        (["--time", "soon"], "--time takes minutes"),
        (["--time", "0m"], "--time must be more than zero"),
        (["--region", "us-east-1"], "--region needs --cloud"),
        (["--autostop", "-5"], "--autostop must be more than zero"),
        (["--cluster", "Bad_Name"], "SkyPilot cluster names are lowercase"),
        (["-o", "gpu=A100"], "no option 'gpu'"),
        (["--reach", "ssh"], "--reach takes auto, direct, tunnel"),
    ],
)
def test_bad_input_is_one_line_and_a_failure(tmp_path: Path, args: list[str], message: str) -> None:
    done = _monarch("serve", "--scheduler", "skypilot", *args, "--dry-run", cwd=tmp_path)
    assert done.returncode != 0 and message in done.stderr, done.stderr
    assert len(done.stderr.strip().splitlines()) == 1 and "Traceback" not in done.stderr


@pytest.mark.parametrize(
    "text, minutes",
    [("90", 90), ("45m", 45), ("2h", 120), ("1h30m", 90), ("1d", 1440), ("1:30:00", 90), ("0:00:30", 1), ("90s", 2)],
)
def test_time_in_minutes(text: str, minutes: int) -> None:
    assert parse_minutes(text) == minutes


def test_arm_nodes_get_a_bundle_for_their_machine(tmp_path: Path) -> None:
    """--arch: the staged bundle's index has a line for each Python on the nodes' machine, which the
    node's setup picks by its interpreter's version and platform.machine()."""
    lines = {}
    for arch in ("x86_64", "aarch64", "both"):
        plan = dryrun(["python", "train.py"], "skypilot", hosts=1, state=tmp_path / f"{arch}.pkl", arch=arch)
        mount = yaml.safe_load(plan.artifacts[TASK])["file_mounts"]["~/.monarch-bundle"]
        lines[arch] = [line.split()[0] for line in (Path(mount) / "INDEX").read_text().splitlines()]
    assert lines["x86_64"] == ["cp310-x86_64", "cp311-x86_64", "cp312-x86_64", "cp313-x86_64"]
    assert lines["aarch64"] == ["cp310-aarch64", "cp311-aarch64", "cp312-aarch64", "cp313-aarch64"]
    assert lines["both"] == lines["x86_64"] + lines["aarch64"]
    assert "platform.machine()" in plan.artifacts[TASK]  # the node's setup asks for its own line

    bad = _monarch(
        "serve", "--scheduler", "skypilot", "--arch", "mips", "--dry-run", "--", "python", "t.py", cwd=tmp_path
    )
    one_line_error(bad, "--arch takes x86_64, aarch64, both, not 'mips'")
