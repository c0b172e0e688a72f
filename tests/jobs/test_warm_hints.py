"""The first run after ``serve`` is already warm: the served script's imports (read, never run)
and what the last reservation of the workspace held are warmed before ``serve`` returns; the
user's own modules never are; the history file is the client's own and is refused otherwise.

The "installed" packages live in a site directory on PYTHONPATH outside the workspace; each
writes a line to $WARM_MARKS when imported, saying whether a rank or the warm process did.
"""

from __future__ import annotations

import json
import os
import stat
from collections.abc import Iterator
from pathlib import Path

import pytest

from monarch_cli.jobs import serve, warm_hints

from ..conftest import write_script
from .conftest import spmd

MARK = """
import os
with open(os.environ["WARM_MARKS"], "a") as _f:
    _f.write("%s %s\\n" % (__name__, "rank" if "RANK" in os.environ else "warm"))
"""


def test_the_source_is_read_not_run_and_the_workspace_is_never_hinted(tmp_path: Path) -> None:
    write_script(
        tmp_path,
        "train.py",
        "import os, numpy as np\n"
        "from torch import nn\n"
        "from typing import TYPE_CHECKING\n"
        "if TYPE_CHECKING:\n    import only_for_types\n"
        "from models import net\n"
        "import helpers.io\n"
        "def main():\n    import json\n"
        "raise SystemExit('never run')\n",
    )
    write_script(tmp_path, "models/__init__.py", "from .layers import Block\n")
    write_script(tmp_path, "models/layers.py", "import einops\nfrom . import net\n")
    write_script(tmp_path, "models/net.py", "from transformers import Trainer\n")
    write_script(tmp_path, "helpers/__init__.py", "")
    write_script(tmp_path, "helpers/io.py", "import pyarrow.parquet as pq\n")
    hints = warm_hints.source_hints(["torchrun", "--nproc-per-node=2", "train.py"], tmp_path)
    assert hints[:4] == ["os", "numpy", "torch", "torch:nn"], hints
    for installed in ("typing", "typing:TYPE_CHECKING", "json", "einops", "transformers:Trainer", "pyarrow.parquet"):
        assert installed in hints, (installed, hints)
    assert "only_for_types" not in hints
    assert not [h for h in hints if h.split(".")[0].split(":")[0] in ("models", "helpers", "train")], hints
    # Not a command it can read, or a program that is not Python: nothing to hint, no error.
    assert warm_hints.source_hints(["torchrun", "--nproc-per-node=2", "missing.py"], tmp_path) == []
    assert warm_hints.source_hints(["torchrun", "--no-python", "nvidia-smi"], tmp_path) == []


def test_history_is_refused_when_another_user_could_have_written_it(tmp_path: Path) -> None:
    state_dir = tmp_path / ".monarch"
    state_dir.mkdir()
    warm_hints.remember(state_dir, "script:train.py", ["torch", "numpy"])
    path = state_dir / warm_hints.HISTORY_FILE
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert warm_hints.load_history(state_dir) == {"script:train.py": ["torch", "numpy"]}
    path.chmod(0o666)  # anyone could have planted names in it: it names what hosts import
    assert warm_hints.load_history(state_dir) == {}
    path.chmod(0o600)
    path.write_text("{not json")
    assert warm_hints.load_history(state_dir) == {}


SCRIPT = """
import importlib, os
import hintmark
importlib.import_module(os.environ.get("LATE_MODULE", "latemark"))  # invisible to a reader
print("ran", hintmark.VALUE)
"""


@pytest.fixture
def workspace(tmp_path: Path) -> Iterator[tuple[Path, Path]]:
    site, work = tmp_path / "site", tmp_path / "work"
    write_script(site, "hintmark.py", MARK + "VALUE = 7\n")
    write_script(site, "latemark.py", MARK)
    write_script(work, "train.py", SCRIPT)
    marks = tmp_path / "marks.txt"
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("PYTHONPATH", os.pathsep.join(filter(None, [os.environ.get("PYTHONPATH"), str(site)])))
        mp.setenv("WARM_MARKS", str(marks))
        mp.setenv("MONARCH_LEARN_PRELOAD", "1")
        mp.chdir(work)
        yield work, marks


def _marks(marks: Path) -> list[str]:
    lines = marks.read_text().splitlines() if marks.exists() else []
    marks.write_text("")
    return sorted(lines)


@pytest.mark.slow
def test_the_first_run_after_serve_is_warm_and_the_next_serve_remembers(workspace: tuple[Path, Path]) -> None:
    work, marks = workspace
    command = ["torchrun", "--nproc-per-node=2", "train.py"]
    state = work / ".monarch" / "job_state.pkl"
    job = serve(command, hosts=1, state=state)
    try:
        warm = job.status()["hosts"][0]["warm"]  # serve returned: the warm process holds the hints
        assert warm["settled"] and warm["hinted"] > 0, warm
        assert _marks(marks) == ["hintmark warm"]
        first = spmd(job, work / "train.py", nproc=2)
        assert first.result.exit_code == 0 and first.text().count("ran 7") == 2, first.text()
        # Run 1: hintmark came with the fork; latemark, which no reader could see, was imported.
        assert _marks(marks) == ["latemark rank", "latemark rank"]
    finally:
        job.stop()  # keeps what the reservation held for the next one
    history = json.loads((work / ".monarch" / warm_hints.HISTORY_FILE).read_text())
    assert "latemark" in history["script:train.py"] and "hintmark" in history["script:train.py"]
    _marks(marks)
    again = serve(command, hosts=1, state=state)
    try:
        assert sorted(set(_marks(marks))) == ["hintmark warm", "latemark warm"]
        first = spmd(again, work / "train.py", nproc=2)
        assert first.result.exit_code == 0 and _marks(marks) == [], first.text()  # nothing left to import
    finally:
        again.stop()


def _warm(job) -> dict:  # type: ignore[no-untyped-def]
    return job.status()["hosts"][0]["warm"]


def _settle(job, timeout: float = 120.0) -> dict:  # type: ignore[no-untyped-def]
    assert job.wait_warm(timeout), _warm(job)
    return _warm(job)


@pytest.mark.slow
def test_what_a_run_teaches_is_learned_in_place_by_the_idle_warm_process(workspace: tuple[Path, Path]) -> None:
    """Run 1 imports a module no reader could see; the warm process, idle once the run ended,
    imports it itself (same process: torch is not imported again beside the next run), and run 2
    forks with it. A module learned in place that refuses forks retires that process instead:
    the next run starts from a new one without it, and succeeds."""
    work, marks = workspace
    write_script(work.parent / "site", "refuser.py", MARK + REFUSE)
    refusing = write_script(work, "refusing.py", "import refuser\nprint('refusing ran')\n")
    job = serve(["torchrun", "--nproc-per-node=2", "train.py"], hosts=1, state=work / ".monarch" / "job_state.pkl")
    try:
        before = _settle(job)
        _marks(marks)
        assert spmd(job, work / "train.py", nproc=2).result.exit_code == 0
        assert _marks(marks) == ["latemark rank", "latemark rank"]
        after = _settle(job)
        assert after["pid"] == before["pid"] and after["learned_held"] > before["learned_held"], (before, after)
        assert _marks(marks) == ["latemark warm"]  # imported once, by the same warm process
        again = spmd(job, work / "train.py", nproc=2)
        assert again.result.exit_code == 0 and again.text().count("ran 7") == 2 and _marks(marks) == []

        assert spmd(job, refusing, nproc=2).result.exit_code == 0
        settled = _settle(job)
        assert settled["pid"] != before["pid"], settled  # the tainted one was retired
        assert settled["excluded"]["refuser"].startswith("it starts a thread, and a process forked after it")
        third = spmd(job, refusing, nproc=2)
        assert third.result.exit_code == 0 and third.text().count("refusing ran") == 2, third.text()
    finally:
        job.stop()


REFUSE = (
    "import threading, time\n"
    "threading.Thread(target=time.sleep, args=(3600,), daemon=True).start()\n"
    "if 'RANK' not in os.environ:\n"
    "    os.register_at_fork(after_in_child=lambda: os._exit(3))\n"
)
