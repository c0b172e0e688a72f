"""Real training frameworks under warm ranks: Hugging Face Trainer, Lightning (ddp), Accelerate
and an FSDP2/DTensor trainer (benchmarks/frameworks/) train exactly what cold torchrun trains,
on 1 host x 2 ranks and 2 hosts x 1 rank, on the first run and once the warm process has
learned their imports; framework state never leaks from the warm process into a rank; a
``--preload ''`` reservation stays warm without torch; learning settles.
"""

from __future__ import annotations

import io
import json
import os
import re
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from monarch_cli.jobs import Job, serve

from ..conftest import write_script
from .conftest import spmd, wait_warm

pytestmark = pytest.mark.slow
pytest.importorskip("transformers")  # the test extra installs them: a missing one is a broken set-up, said once
pytest.importorskip("lightning")
pytest.importorskip("accelerate")

FRAMEWORKS = Path(__file__).resolve().parents[2] / "benchmarks" / "frameworks"
SCRIPTS = ["hf_trainer.py", "lightning_ddp.py", "accelerate_loop.py", "fsdp2_trainer.py"]
CHECKSUM = re.compile(r"param-checksum ([0-9a-f]{64})")
STEPS = "4"


@pytest.fixture(scope="module")
def fw_env(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """What agents and ranks share: offline hub, few steps, a private cache of learned modules."""
    base = tmp_path_factory.mktemp("fw")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("HF_HUB_OFFLINE", "1")
        mp.setenv("FW_STEPS", STEPS)
        mp.setenv("MONARCH_CACHE_DIR", str(base / "cache"))
        mp.setenv("MONARCH_LEARN_PRELOAD", "1")
        mp.chdir(base)
        yield base


def checksum(text: str) -> str:
    found = CHECKSUM.findall(text)
    assert len(found) == 1, text[-3000:]
    return found[0]


def cold_torchrun(script: str, layout: str) -> str:
    """The script under plain cold torchrun in this layout: ``--standalone --nproc-per-node=2``
    on 1 host; two ``--nnodes=2 --node-rank=i`` torchruns, one per host, on 2 hosts (the
    Trainer's data order depends on the layout, so each layout has its own reference)."""
    run = [sys.executable, "-m", "torch.distributed.run"]
    if layout == "1x2":
        commands = [[*run, "--standalone", "--nproc-per-node=2", script]]
    else:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        rdzv = ["--nnodes=2", "--nproc-per-node=1", "--master-addr=127.0.0.1", f"--master-port={port}"]
        commands = [[*run, *rdzv, f"--node-rank={i}", script] for i in range(2)]
    procs = [
        subprocess.Popen(c, cwd=FRAMEWORKS, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for c in commands
    ]
    text = ""
    for p in procs:
        out, err = p.communicate(timeout=600)
        assert p.returncode == 0, out[-3000:] + err[-3000:]
        text += out
    return checksum(text)


@pytest.fixture(scope="module")
def cold_checksums(fw_env: Path) -> dict[tuple[str, str], str]:
    """Filled as the tests ask: (script, layout) -> cold torchrun's checksum."""
    return {}


@pytest.fixture(scope="module")
def jobs(fw_env: Path) -> Iterator[dict[str, Job]]:
    one = serve(None, hosts=1, state=fw_env / "one" / ".monarch" / "job_state.pkl")
    two = serve(None, hosts=2, state=fw_env / "two" / ".monarch" / "job_state.pkl")
    try:
        yield {"1x2": one, "2x1": two}
    finally:
        one.stop()
        two.stop()


# Every framework on one host; two hosts with the cheapest (FSDP2, ~13 s): the multi-host path is
# the same for all four (the suite's 25-minute budget; benchmarks/frameworks.py times every layout).
CASES = [(script, "1x2") for script in SCRIPTS] + [("fsdp2_trainer.py", "2x1")]


@pytest.mark.parametrize(("script", "layout"), CASES)
def test_frameworks_train_what_cold_torchrun_trains(
    script: str, layout: str, jobs: dict[str, Job], cold_checksums: dict[tuple[str, str], str]
) -> None:
    job = jobs[layout]
    if (script, layout) not in cold_checksums:
        cold_checksums[script, layout] = cold_torchrun(str(FRAMEWORKS / script), layout)
    reference = cold_checksums[script, layout]
    nproc = 2 if layout == "1x2" else 1
    first = spmd(job, FRAMEWORKS / script, nproc=nproc)
    assert first.result.exit_code == 0, first.text()[-3000:]
    assert checksum(first.text()) == reference, "first run"
    warm = wait_warm(job, timeout=300)
    for host in warm:  # the framework's modules were learned, torch's are never blamed for a thread
        assert not [n for n, why in host["excluded"].items() if n.startswith("torch") and "thread" in why], host
    again = spmd(job, FRAMEWORKS / script, nproc=nproc)
    assert again.result.exit_code == 0, again.text()[-3000:]
    assert "starts cold" not in again.text(), again.text()[-3000:]
    assert checksum(again.text()) == reference, "warm re-run"


PROBE = """
import os, random, sys
import numpy, torch, torch.distributed as dist
import lightning, transformers, accelerate
from accelerate.state import PartialState
from lightning.pytorch.utilities import rank_zero_only
from transformers.utils import logging as hf_logging
import huggingface_hub.constants as hub

handler = hf_logging._default_handler
print("state " + " ".join([
    f"rank_zero={rank_zero_only.rank}",
    f"partial_state={PartialState._shared_state != {}}",
    f"dist_initialized={dist.is_initialized()}",
    f"cuda_initialized={torch.cuda.is_initialized()}",
    f"hf_level={hf_logging.get_verbosity()}",
    f"hf_handler_stderr={handler is None or handler.stream is sys.stderr}",
    f"hf_flush_stderr={handler is None or getattr(handler.flush, '__self__', None) is sys.stderr}",
    f"hub_offline={hub.HF_HUB_OFFLINE}",
]), flush=True)
print("random", random.random(), numpy.random.rand(), torch.rand(1).item(), flush=True)
"""


def probe(job: Job, script: Path, env: dict[str, str] | None = None, cold: bool = False) -> tuple[list[str], str]:
    out, err = io.BytesIO(), io.BytesIO()
    result = job.run_spmd(["torchrun", "--nproc-per-node=2", str(script)], stdout=out, stderr=err, env=env, cold=cold)
    text = (out.getvalue() + err.getvalue()).decode()
    assert result.exit_code == 0, text
    states = sorted(re.findall(r"\[(rank\d)\] (state .*)", text))
    return [f"{r} {s}" for r, s in states], text


def test_framework_state_is_fresh_in_every_warm_rank(jobs: dict[str, Job], fw_env: Path) -> None:
    """What Lightning, transformers, Accelerate and torch decide at import, and the seeds, are a
    fresh interpreter's in a warm rank that holds them all (compared with --cold ranks)."""
    job = jobs["1x2"]
    script = write_script(fw_env, "probe.py", PROBE)
    probe(job, script)  # teaches the warm process these imports
    warm = wait_warm(job, timeout=300)
    assert warm[0]["modules"] > 2000, warm  # transformers, lightning... are held
    warm_states, warm_text = probe(job, script, env={"TRANSFORMERS_VERBOSITY": "info"})
    cold_states, _ = probe(job, script, env={"TRANSFORMERS_VERBOSITY": "info"}, cold=True)
    assert warm_states == cold_states, (warm_states, cold_states)
    assert "rank0 state rank_zero=0 " in warm_states[0] and "rank1 state rank_zero=1 " in warm_states[1]
    assert all(
        "partial_state=False dist_initialized=False cuda_initialized=False hf_level=20" in s for s in warm_states
    )
    assert all("hf_handler_stderr=True hf_flush_stderr=True hub_offline=True" in s for s in warm_states)
    # seeds: every rank and every run draws its own numbers, as fresh interpreters do
    _, again = probe(job, script)
    draws = re.findall(r"random (.*)", warm_text) + re.findall(r"random (.*)", again)
    assert len(draws) == 4 and len(set(draws)) == 4, draws


def test_a_variable_read_at_import_that_differs_starts_the_rank_cold(jobs: dict[str, Job], fw_env: Path) -> None:
    """huggingface_hub reads HF_HUB_OFFLINE when imported: a run that sets it otherwise than the
    warm process saw gets fresh interpreters, and one line per rank saying why."""
    job = jobs["1x2"]
    script = write_script(fw_env, "probe.py", PROBE)
    probe(job, script)
    wait_warm(job, timeout=300)
    states, text = probe(job, script, env={"HF_HUB_OFFLINE": "0"})
    lines = [line for line in text.splitlines() if "starts cold" in line]
    assert len(lines) == 2, text
    assert "HF_HUB_OFFLINE is '0' for this run, but huggingface_hub.constants read it as '1'" in lines[0], lines
    assert all("hub_offline=False" in s for s in states), states


NO_TORCH = """
import json, os, sys, decimal
print("torch" if "torch" in sys.modules else "no-torch", os.getppid(), len(sys.modules), flush=True)
"""


def test_preload_nothing_keeps_torch_out_and_stays_warm(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``serve --preload ''``: ranks of a script that never imports torch do not have it (rank 0's
    rendezvous store included), and its re-runs fork from a warm process that is not replaced."""
    monkeypatch.setenv("MONARCH_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setenv("MONARCH_LEARN_PRELOAD", "1")
    script = write_script(tmp_path, "plain.py", NO_TORCH)
    job = serve(None, hosts=1, preload="", state=tmp_path / ".monarch" / "job_state.pkl")
    try:
        pids = []
        for attempt in range(4):
            r = spmd(job, script)
            assert r.result.exit_code == 0, r.text()
            lines = [line.split() for line in r.text().splitlines() if "torch" in line]
            assert len(lines) == 2 and all(parts[1] == "no-torch" for parts in lines), (attempt, r.text())
            if attempt == 0:
                wait_warm(job)
            warm = job.status()["hosts"][0]["warm"]
            assert warm["modules"] < 600, warm  # no torch in the warm process either
            if attempt >= 1:
                assert not warm["warming"], (attempt, warm)  # nothing new to learn: no rebuild
                assert {int(parts[2]) for parts in lines} == {warm["pid"]}, (lines, warm)  # forked from it
                pids.append(warm["pid"])
        assert len(set(pids)) == 1, pids
    finally:
        job.stop()


DDP = """
import torch, torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
dist.init_process_group("gloo")
model = DDP(nn.Linear(8, 1))
model(torch.randn(4, 8)).sum().backward()
dist.destroy_process_group()
"""


def test_learning_settles_after_the_second_run(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """After the second run of an unchanged script, no run replaces the warm process."""
    monkeypatch.setenv("MONARCH_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setenv("MONARCH_LEARN_PRELOAD", "1")
    script = write_script(tmp_path, "ddp.py", DDP)
    job = serve(None, hosts=1, state=tmp_path / ".monarch" / "job_state.pkl")
    try:
        for _ in range(2):
            assert spmd(job, script).result.exit_code == 0
            wait_warm(job, timeout=300)
        settled = job.status()["hosts"][0]["warm"]
        for attempt in range(3):
            r = spmd(job, script)
            assert r.result.exit_code == 0, r.text()
            warm = job.status()["hosts"][0]["warm"]
            assert warm["pid"] == settled["pid"] and not warm["warming"], (attempt, settled, warm)
    finally:
        job.stop()


def test_an_excluded_module_is_blamed_on_what_it_imports(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A library that imports a module whose fork trial fails is left out saying which one; the
    module itself says what it does; torch (numpy's OpenBLAS pool) is never blamed."""
    site = tmp_path / "site"
    write_script(
        site,
        "spinner.py",
        "import os, threading, time\nthreading.Thread(target=time.sleep, args=(3600,), daemon=True).start()\n"
        "if 'RANK' not in os.environ:\n    os.register_at_fork(after_in_child=lambda: os._exit(3))\n",
    )
    write_script(site, "usesspinner.py", "import spinner\n")
    script = write_script(tmp_path / "work", "train.py", "import usesspinner, torch\nprint('ok')\n")
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [os.environ.get("PYTHONPATH"), str(site)])))
    monkeypatch.setenv("MONARCH_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setenv("MONARCH_LEARN_PRELOAD", "1")
    job = serve(None, hosts=1, preload="", state=tmp_path / ".monarch" / "job_state.pkl")
    try:
        assert spmd(job, script).result.exit_code == 0
        warm = wait_warm(job, timeout=300)[0]
        excluded = warm["excluded"]
        why = "starts a thread, and a process forked after it exited with status 3"
        assert excluded.get("spinner") == f"it {why}", excluded
        assert excluded.get("usesspinner") == f"it imports spinner, which {why}", excluded
        assert not [n for n in excluded if n.startswith(("torch", "numpy"))], excluded
        shown = subprocess.run(
            [sys.executable, "-m", "monarch_cli", "warm", "--json", "--state", str(job.path)],
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert json.loads(shown.stdout)["hosts"][0]["warm"]["excluded"] == excluded
    finally:
        job.stop()


FULL_ENV = """
import numpy as np, pyarrow as pa, pyarrow.compute as pc
from sklearn.linear_model import LinearRegression
import transformers
x = np.arange(40, dtype=float).reshape(20, 2) ** 1.5
fit = LinearRegression().fit(x, x @ [1.5, -2.0] + 3)
coef = [round(float(c), 6) for c in fit.coef_]
print("result", pc.sum(pa.array(range(1000))).as_py(), coef, round(float(fit.intercept_), 6), flush=True)
"""


def test_a_full_ml_environment_is_held_whole(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """pyarrow and scikit-learn start threads at import; a process forked after them works (their
    fork trial passes), so they are held, and transformers with them: nothing of the three is left
    out, the first run after serve is warm, and every run computes what a cold one computes."""
    pytest.importorskip("pyarrow")
    pytest.importorskip("sklearn")
    work = tmp_path / "work"
    script = write_script(work, "train.py", FULL_ENV)
    monkeypatch.setenv("MONARCH_LEARN_PRELOAD", "1")
    monkeypatch.chdir(work)
    job = serve(["torchrun", "--nproc-per-node=2", "train.py"], hosts=1, state=work / ".monarch" / "job_state.pkl")
    try:
        warm = job.status()["hosts"][0]["warm"]
        held_back = [n for n in warm["excluded"] if n.split(".")[0] in ("pyarrow", "sklearn", "transformers")]
        assert warm["settled"] and held_back == [], warm["excluded"]
        assert warm["modules"] > 3000, warm  # transformers, pyarrow, scikit-learn: thousands of modules
        cold = spmd(job, script, cold=True)
        assert cold.result.exit_code == 0, cold.text()[-3000:]
        expected = sorted(re.findall(r"result .*", cold.text()))
        assert len(expected) == 2, cold.text()[-3000:]
        for _ in range(2):
            again = spmd(job, script)
            assert again.result.exit_code == 0 and sorted(re.findall(r"result .*", again.text())) == expected
            assert "starts cold" not in again.text(), again.text()[-3000:]
    finally:
        job.stop()
