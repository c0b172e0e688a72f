"""SkyProvisioner against the installed SkyPilot SDK, with only its network calls answered locally.

No API server or cloud can be reached here, so ``sky.launch``/``status``/``down``/``get``/
``stream_and_get`` are replaced by functions that first bind their arguments to the REAL
functions' signatures (a renamed or removed parameter fails here, not on a user's cloud) and
then answer as SkyPilot does. The ``sky.Task`` is SkyPilot's own, built from our task.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import sky  # noqa: E402 - the test extra installs SkyPilot

from monarch_cli.errors import OptionError, SchedulerError
from monarch_cli.jobs import dryrun
from monarch_cli.schedulers import Reservation
from monarch_cli.schedulers.skypilot import KEYS_SECRET, ClusterStatus, SkyPilotScheduler
from monarch_cli.schedulers.skypilot.sdk import SkyProvisioner


def _checked(real: Callable[..., Any], answer: Callable[..., Any], calls: list[dict[str, Any]]) -> Callable[..., Any]:
    signature = inspect.signature(real)

    def call(*args: Any, **kwargs: Any) -> Any:
        bound = signature.bind(*args, **kwargs)  # TypeError if SkyPilot's API no longer takes these
        calls.append({"name": real.__name__, **bound.arguments})
        return answer(*args, **kwargs)

    return call


@pytest.fixture
def sdk(monkeypatch: pytest.MonkeyPatch) -> dict[str, Any]:
    state: dict[str, Any] = {"calls": [], "clusters": {}}
    calls = state["calls"]

    # What SkyPilot's handle and credentials hold for a 2-node AWS cluster (CloudVmRayResourceHandle's fields).
    handle = SimpleNamespace(
        cached_external_ips=["34.1.1.1", "34.1.1.2"],
        external_ips=lambda: [],
        cached_internal_ips=["172.31.0.5", "172.31.0.6"],
        cached_external_ssh_ports=[22, 22],
        launched_nodes=2,
        launched_resources=sky.Resources(infra="aws", accelerators="L4:1"),
    )
    credentials = {
        "ssh_user": "ubuntu",
        "ssh_private_key": "~/.sky/clients/abc/ssh/sky-key",
        "ssh_control_name": "mesh",
        "ssh_proxy_command": None,
    }
    state["credentials"] = credentials

    def launch(task: Any, cluster_name: str = "", _include_credentials: bool = False, **_: Any) -> str:
        state["task"] = task
        state["clusters"][cluster_name] = "UP"
        return "req-launch-creds" if _include_credentials else "req-launch"

    def stream_and_get(request_id: str, output_stream: Any = None, **_: Any) -> Any:
        output_stream.write("\x1b[32mLaunching on Kubernetes\x1b[0m\nJob submitted, ID: 1\r\n")
        # A server new enough adds the credentials when asked (MIN_LAUNCH_CREDENTIALS_API_VERSION).
        return (1, handle, state["credentials"]) if request_id == "req-launch-creds" else (1, handle)

    def status(cluster_names: list[str], **_: Any) -> list[Any]:
        name = cluster_names[0]
        found = state["clusters"].get(name)
        return [{"name": name, "status": sky.ClusterStatus[found], "handle": handle}] if found else []

    def down(cluster_name: str, **_: Any) -> None:
        state["clusters"].pop(cluster_name, None)

    def cancel(cluster_name: str, **_: Any) -> None:
        state["cancelled"] = cluster_name

    def autostop(cluster_name: str, idle_minutes: int, **_: Any) -> None:
        state["autostop"] = idle_minutes

    monkeypatch.setattr(sky, "cancel", _checked(sky.cancel, cancel, calls))
    monkeypatch.setattr(sky, "autostop", _checked(sky.autostop, autostop, calls))

    monkeypatch.setattr(sky, "launch", _checked(sky.launch, launch, calls))
    monkeypatch.setattr(sky, "stream_and_get", _checked(sky.stream_and_get, stream_and_get, calls))
    monkeypatch.setattr(sky, "status", _checked(sky.status, status, calls))
    monkeypatch.setattr(sky, "down", _checked(sky.down, down, calls))
    monkeypatch.setattr(sky, "get", _checked(sky.get, lambda value: value, calls))
    return state


def test_launch_state_and_down_through_the_sdk(sdk: dict[str, Any], tmp_path: Path) -> None:
    plan = dryrun(["python", "train.py"], "skypilot", hosts=2, state=tmp_path / "s.pkl", gpus="L4", cloud="kubernetes")
    progress: list[str] = []
    nodes = SkyProvisioner().launch("mesh", plan.data["task"], {KEYS_SECRET: "PUBLIC SECRET"}, progress.append)
    assert nodes.ips == ["34.1.1.1", "34.1.1.2"] and nodes.internal_ips == ["172.31.0.5", "172.31.0.6"]
    # SSH access to the head, for the tunnels: its external address and port, SkyPilot's user and key.
    assert nodes.ssh is not None and (nodes.ssh.host, nodes.ssh.port, nodes.ssh.user) == ("34.1.1.1", 22, "ubuntu")
    assert nodes.ssh.key_file == str(Path("~/.sky/clients/abc/ssh/sky-key").expanduser())
    assert sdk["calls"][0]["_include_credentials"] is True
    assert progress[1:] == ["sky: Launching on Kubernetes", "sky: Job submitted, ID: 1"]  # SkyPilot's log, clean
    task = sdk["task"]
    assert isinstance(task, sky.Task) and task.num_nodes == 2 and task.run == plan.data["task"]["run"]
    assert task.secrets[KEYS_SECRET].get_secret_value() == "PUBLIC SECRET"  # the value, in memory only
    # The task YAML SkyPilot keeps and shows (its dashboard, `sky jobs queue`) has it redacted.
    assert "PUBLIC SECRET" not in str(task.to_yaml_config(use_user_specified_yaml=True))
    assert SkyProvisioner().state("mesh") == ("UP", "SkyPilot reports cluster mesh as UP")
    SkyProvisioner().down("mesh")
    state, reason = SkyProvisioner().state("mesh")
    assert state == "GONE" and "has no cluster mesh" in reason
    assert [c["name"] for c in sdk["calls"]] == [
        "launch",
        "stream_and_get",
        "status",
        "get",
        "down",
        "get",
        "status",
        "get",
    ]


def test_a_key_sent_by_the_api_server_is_kept_0600_and_removed_with_the_cluster(
    sdk: dict[str, Any], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("HOME", str(tmp_path))
    sdk["credentials"] = {"ssh_user": "ubuntu", "ssh_private_key_content": "-----BEGIN KEY-----\nxyz\n"}
    plan = dryrun(["python", "train.py"], "skypilot", hosts=2, state=tmp_path / "s.pkl")
    nodes = SkyProvisioner().launch("mesh", plan.data["task"], {KEYS_SECRET: "k"}, lambda _: None)
    key = Path(nodes.ssh.key_file)
    assert key.read_text() == "-----BEGIN KEY-----\nxyz\n" and key.stat().st_mode & 0o777 == 0o600
    assert key.parent.stat().st_mode & 0o077 == 0
    SkyProvisioner().down("mesh")
    assert not key.exists()


def test_an_old_server_without_credentials_in_the_launch_is_asked_through_status(
    sdk: dict[str, Any], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    real_status = sky.status

    def status(cluster_names: list[str], **kwargs: Any) -> list[Any]:
        records = real_status(cluster_names, **kwargs)
        return (
            [{**r, "credentials": {"ssh_user": "gcpuser", "ssh_private_key": "/k"}} for r in records]
            if kwargs.get("_include_credentials")
            else records
        )

    monkeypatch.setattr(sky, "status", status)
    monkeypatch.setattr(sky, "launch", lambda *a, **k: "req-launch")  # answered with (job id, handle) only
    sdk["clusters"]["mesh"] = "UP"
    plan = dryrun(["python", "train.py"], "skypilot", hosts=2, state=tmp_path / "s.pkl")
    nodes = SkyProvisioner().launch("mesh", plan.data["task"], {KEYS_SECRET: "k"}, lambda _: None)
    assert nodes.ssh is not None and (nodes.ssh.user, nodes.ssh.key_file) == ("gcpuser", "/k")


def test_a_cluster_behind_a_proxy_command_is_reached_directly_only(sdk: dict[str, Any], tmp_path: Path) -> None:
    sdk["credentials"] = {"ssh_user": "sky", "ssh_private_key": "/k", "ssh_proxy_command": "ssh -W %h:%p jump"}
    plan = dryrun(["python", "train.py"], "skypilot", hosts=2, state=tmp_path / "s.pkl")
    progress: list[str] = []
    nodes = SkyProvisioner().launch("mesh", plan.data["task"], {KEYS_SECRET: "k"}, progress.append)
    assert nodes.ssh is None and any("proxy command" in p for p in progress)


def test_an_existing_cluster_is_described_from_its_handle(sdk: dict[str, Any]) -> None:
    assert SkyProvisioner().existing("mesh") is None
    sdk["clusters"]["mesh"] = "STOPPED"
    assert SkyProvisioner().existing("mesh") == ClusterStatus("STOPPED", 2, "L4:1", "aws")


def test_stop_keep_cluster_cancels_the_job_and_sets_autostop_without_down(sdk: dict[str, Any], tmp_path: Path) -> None:
    sdk["clusters"]["mesh"] = "UP"
    record = Reservation("sky-1", [], {"cluster": "mesh", "keep": {"idle_minutes": 30, "down": False}})
    scheduler = SkyPilotScheduler()
    scheduler.release_with(record, scheduler.check_stop_options({"keep_cluster": True}))
    assert [c["name"] for c in sdk["calls"]] == ["cancel", "get", "autostop", "get"]
    assert sdk["calls"][0]["all"] is True and sdk["calls"][2]["idle_minutes"] == 30 and not sdk["calls"][2]["down"]
    assert sdk["clusters"] == {"mesh": "UP"}  # not torn down
    sdk["calls"].clear()
    scheduler.release_with(record, scheduler.check_stop_options({"keep_cluster": True, "autostop": 5}))
    assert sdk["calls"][2]["idle_minutes"] == 5  # stop's own --autostop wins
    sdk["calls"].clear()
    scheduler.release_with(record, scheduler.check_stop_options({}))  # a plain stop: sky down
    assert [c["name"] for c in sdk["calls"]] == ["down", "get"] and sdk["clusters"] == {}
    for bad, message in (
        ({"autostop": 5}, "needs --keep-cluster"),
        ({"keep_cluster": True, "autostop": 0}, "more than zero"),
        ({"keep": True}, "unknown"),
    ):
        with pytest.raises(OptionError, match=message):
            scheduler.check_stop_options(bad)


def test_a_failed_launch_is_one_line(sdk: dict[str, Any], monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    def refuse(*_: Any, **__: Any) -> None:
        raise sky.exceptions.NoCloudAccessError("Cloud access is not set up. Run: sky check\nmore detail")

    monkeypatch.setattr(sky, "stream_and_get", refuse)
    plan = dryrun(["python", "train.py"], "skypilot", hosts=1, state=tmp_path / "s.pkl")
    with pytest.raises(SchedulerError) as err:
        SkyProvisioner().launch("mesh", plan.data["task"], {KEYS_SECRET: "k"}, lambda _: None)
    assert str(err.value) == "sky launch -c mesh failed: Cloud access is not set up. Run: sky check"
