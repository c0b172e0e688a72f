"""Start-up variables a warm rank can set for itself never make a run cold (issue: env drift)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from monarch_cli.jobs import Job, serve

from ..conftest import write_script
from .conftest import spmd

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def one_host(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Job]:
    with pytest.MonkeyPatch.context() as mp:  # agents started without them, as on a fresh SSH host
        for name in ("PYTHONDONTWRITEBYTECODE", "PYTHONINTMAXSTRDIGITS"):
            mp.delenv(name, raising=False)
        j = serve(None, hosts=1, state=tmp_path_factory.mktemp("warmenv") / ".monarch" / "job_state.pkl")
    yield j
    j.stop()


def test_dont_write_bytecode_exported_after_serve_keeps_runs_warm_and_is_honoured(
    one_host: Job, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "helper.py").write_text("VALUE = 42\n")
    script = write_script(
        tmp_path,
        "show.py",
        """
        import sys, helper
        print("dont_write_bytecode", sys.dont_write_bytecode, "int_digits", sys.get_int_max_str_digits(), flush=True)
        """,
    )
    monkeypatch.setenv("PYTHONDONTWRITEBYTECODE", "1")  # as many images set it; the agents started without it
    monkeypatch.setenv("PYTHONINTMAXSTRDIGITS", "640")
    notices: list[str] = []
    run = spmd(one_host, script, nproc=2, notices=notices)
    assert run.result.exit_code == 0, run.text()
    assert not [n for n in notices if "cold" in n], notices
    assert run.lines().count(b"[rank0] dont_write_bytecode True int_digits 640") == 1, run.text()
    assert not (tmp_path / "__pycache__").exists(), "a rank wrote bytecode although PYTHONDONTWRITEBYTECODE=1"
