"""SkyProvisioner against the installed SkyPilot SDK, with only its network calls answered locally.

No API server or cloud can be reached here, so ``sky.launch``/``status``/``down``/``get``/
``stream_and_get`` are replaced by functions that first bind their arguments to the REAL
functions' signatures (a renamed or removed parameter fails here, not on a user's cloud) and
then answer as SkyPilot does. The ``sky.Task`` is SkyPilot's own, built from our task.
"""

from __future__ import annotations

import inspect
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Callable, Dict, List

import pytest

from monarch_cli.errors import SchedulerError
from monarch_cli.jobs import dryrun
from monarch_cli.schedulers.skypilot import KEYS_SECRET, SkyProvisioner

import sky  # noqa: E402 - the test extra installs SkyPilot


def _checked(real: Callable[..., Any], answer: Callable[..., Any], calls: List[Dict[str, Any]]) -> Callable[..., Any]:
    signature = inspect.signature(real)

    def call(*args: Any, **kwargs: Any) -> Any:
        bound = signature.bind(*args, **kwargs)  # TypeError if SkyPilot's API no longer takes these
        calls.append({"name": real.__name__, **bound.arguments})
        return answer(*args, **kwargs)

    return call


@pytest.fixture
def sdk(monkeypatch: pytest.MonkeyPatch) -> Dict[str, Any]:
    state: Dict[str, Any] = {"calls": [], "clusters": {}}
    calls = state["calls"]

    def launch(task: Any, cluster_name: str = "", **_: Any) -> str:
        state["task"] = task
        state["clusters"][cluster_name] = "UP"
        return "req-launch"

    def stream_and_get(request_id: str, output_stream: Any = None, **_: Any) -> Any:
        output_stream.write("\x1b[32mLaunching on Kubernetes\x1b[0m\nJob submitted, ID: 1\r\n")
        return 1, SimpleNamespace(cached_external_ips=["10.0.0.1", "10.0.0.2"], external_ips=lambda: [])

    def status(cluster_names: List[str], **_: Any) -> List[Any]:
        name = cluster_names[0]
        found = state["clusters"].get(name)
        return [SimpleNamespace(status=sky.ClusterStatus[found])] if found else []

    def down(cluster_name: str, **_: Any) -> None:
        state["clusters"].pop(cluster_name, None)

    monkeypatch.setattr(sky, "launch", _checked(sky.launch, launch, calls))
    monkeypatch.setattr(sky, "stream_and_get", _checked(sky.stream_and_get, stream_and_get, calls))
    monkeypatch.setattr(sky, "status", _checked(sky.status, status, calls))
    monkeypatch.setattr(sky, "down", _checked(sky.down, down, calls))
    monkeypatch.setattr(sky, "get", _checked(sky.get, lambda value: value, calls))
    return state


def test_launch_state_and_down_through_the_sdk(sdk: Dict[str, Any], tmp_path: Path) -> None:
    plan = dryrun(["python", "train.py"], "skypilot", hosts=2, state=tmp_path / "s.pkl", gpus="L4", cloud="kubernetes")
    progress: List[str] = []
    ips = SkyProvisioner().launch("mesh", plan.data["task"], {KEYS_SECRET: "PUBLIC SECRET"}, progress.append)
    assert ips == ["10.0.0.1", "10.0.0.2"]
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
    assert [c["name"] for c in sdk["calls"]] == ["launch", "stream_and_get", "status", "get", "down", "get",
                                                 "status", "get"]


def test_a_failed_launch_is_one_line(sdk: Dict[str, Any], monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    def refuse(*_: Any, **__: Any) -> None:
        raise sky.exceptions.NoCloudAccessError("Cloud access is not set up. Run: sky check\nmore detail")

    monkeypatch.setattr(sky, "stream_and_get", refuse)
    plan = dryrun(["python", "train.py"], "skypilot", hosts=1, state=tmp_path / "s.pkl")
    with pytest.raises(SchedulerError) as err:
        SkyProvisioner().launch("mesh", plan.data["task"], {KEYS_SECRET: "k"}, lambda _: None)
    assert str(err.value) == "sky launch -c mesh failed: Cloud access is not set up. Run: sky check"
