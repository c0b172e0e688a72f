"""Tests for torchrun-style command parsing and the per-rank environment contract."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest

from monarch_cli.jobs.errors import JobError
from monarch_cli.jobs.torchrun import SpmdSpec, parse_command, rank_environment, resolve_nproc

T = "torchrun"

# (argv, expected SpmdSpec attributes); unlisted attributes must keep their defaults.
OK_CASES: list[tuple[list[str], dict[str, Any]]] = [
    ([T, "train.py"], {"program": ["train.py"], "python_args": ["-u"]}),
    (
        ["/usr/bin/torchrun", "--nproc-per-node=4", "train.py", "--lr", "1"],
        {"nproc_per_node": 4, "program": ["train.py", "--lr", "1"], "python_args": ["-u"]},
    ),
    ([T, "--nproc_per_node", "8", "t.py"], {"nproc_per_node": 8, "program": ["t.py"], "python_args": ["-u"]}),
    ([T, "--nproc-per-node", "gpu", "t.py"], {"nproc_per_node": "gpu", "program": ["t.py"], "python_args": ["-u"]}),
    ([T, "--nproc_per_node=cpu", "t.py"], {"nproc_per_node": "cpu", "program": ["t.py"], "python_args": ["-u"]}),
    ([T, "--nproc-per-node=auto", "t.py"], {"nproc_per_node": "auto", "program": ["t.py"], "python_args": ["-u"]}),
    ([T, "--nnodes=2", "t.py"], {"nnodes": 2, "program": ["t.py"], "python_args": ["-u"]}),
    ([T, "--nnodes", "1:4", "t.py"], {"nnodes": 4, "nnodes_min": 1, "program": ["t.py"], "python_args": ["-u"]}),
    ([T, "--nnodes=3:3", "t.py"], {"nnodes": 3, "nnodes_min": 3, "program": ["t.py"], "python_args": ["-u"]}),
    (
        [T, "--standalone", "--nproc-per-node=2", "t.py"],
        {"standalone": True, "nnodes": 1, "nproc_per_node": 2, "program": ["t.py"], "python_args": ["-u"]},
    ),
    (
        [T, "--standalone", "--nnodes=1", "t.py"],
        {"standalone": True, "nnodes": 1, "program": ["t.py"], "python_args": ["-u"]},
    ),
    (
        [T, "-m", "pkg.train", "--x", "1"],
        {"mode": "module", "program": ["pkg.train", "--x", "1"], "python_args": ["-u"]},
    ),
    ([T, "--module", "pkg.train"], {"mode": "module", "program": ["pkg.train"], "python_args": ["-u"]}),
    # torchrun's -m is a switch; flags may still follow it before the module name.
    (
        [T, "-m", "--nproc-per-node", "2", "mod"],
        {"mode": "module", "nproc_per_node": 2, "program": ["mod"], "python_args": ["-u"]},
    ),
    ([T, "--no-python", "./a.out", "-v"], {"mode": "no_python", "program": ["./a.out", "-v"]}),
    ([T, "--no_python", "/bin/echo", "hi"], {"mode": "no_python", "program": ["/bin/echo", "hi"]}),
    ([T, "--run-path", "/abs/t.py"], {"program": ["/abs/t.py"], "python_args": ["-u"]}),
    ([T, "--run_path", "--no-python", "/abs/t.py"], {"program": ["/abs/t.py"], "python_args": ["-u"]}),
    (
        [T, "--rdzv-backend=c10d", "--rdzv_endpoint", "h:29400", "--rdzv-id=abc", "--rdzv_conf", "timeout=9", "t.py"],
        {
            "rdzv_backend": "c10d",
            "rdzv_endpoint": "h:29400",
            "rdzv_id": "abc",
            "rdzv_conf": "timeout=9",
            "program": ["t.py"],
            "python_args": ["-u"],
        },
    ),
    (
        [T, "--master-addr=h0", "--master_port", "1234", "--node-rank=1", "t.py"],
        {"master_addr": "h0", "master_port": 1234, "node_rank": 1, "program": ["t.py"], "python_args": ["-u"]},
    ),
    (
        [T, "--master_addr", "h0", "--master-port=0", "--node_rank", "0", "t.py"],
        {"master_addr": "h0", "master_port": 0, "node_rank": 0, "program": ["t.py"], "python_args": ["-u"]},
    ),
    (
        [T, "--local-ranks-filter=0,2", "t.py"],
        {"local_ranks_filter": {0, 2}, "program": ["t.py"], "python_args": ["-u"]},
    ),
    ([T, "--local_ranks_filter", "", "t.py"], {"program": ["t.py"], "python_args": ["-u"]}),
    (
        [T, "--tee", "3", "-r", "0:1,1:2", "t.py"],
        {"tee": "3", "redirects": "0:1,1:2", "program": ["t.py"], "python_args": ["-u"]},
    ),
    ([T, "-t1", "--redirects=2", "t.py"], {"tee": "1", "redirects": "2", "program": ["t.py"], "python_args": ["-u"]}),
    ([T, "-t=0", "-r3", "t.py"], {"tee": "0", "redirects": "3", "program": ["t.py"], "python_args": ["-u"]}),
    ([T, "--shutdown_timeout", "5", "t.py"], {"shutdown_timeout": 5, "program": ["t.py"], "python_args": ["-u"]}),
    ([T, "--log-dir", "/tmp/logs", "t.py"], {"log_dir": "/tmp/logs", "program": ["t.py"], "python_args": ["-u"]}),
    ([T, "--log_dir=/tmp/l", "t.py"], {"log_dir": "/tmp/l", "program": ["t.py"], "python_args": ["-u"]}),
    (
        [T, "--role", "", "t.py"],
        {"role": "", "program": ["t.py"], "python_args": ["-u"]},
    ),  # torchx's dist.ddp passes --role ''
    (
        [T, "--role", "trainer", "--max-restarts", "3", "t.py"],
        {"role": "trainer", "max_restarts": 3, "program": ["t.py"], "python_args": ["-u"]},
    ),
    ([T, "--max_restarts=0", "t.py"], {"program": ["t.py"], "python_args": ["-u"]}),
    ([T, "--monitor-interval", "5", "--monitor_interval=0.5", "t.py"], {"program": ["t.py"], "python_args": ["-u"]}),
    ([T, "--start-method=fork", "--start_method", "spawn", "t.py"], {"program": ["t.py"], "python_args": ["-u"]}),
    ([T, "--start-method", "forkserver", "t.py"], {"program": ["t.py"], "python_args": ["-u"]}),
    # Everything after the script belongs to the user's program, torchrun-looking or not.
    (
        [T, "t.py", "--nnodes=3", "--standalone", "-m"],
        {"program": ["t.py", "--nnodes=3", "--standalone", "-m"], "python_args": ["-u"]},
    ),
    (
        [T, "--nproc-per-node=2", "--", "t.py", "-x"],
        {"nproc_per_node": 2, "program": ["t.py", "-x"], "python_args": ["-u"]},
    ),
    ([T, "--nnodes=2", "--nnodes=3", "t.py"], {"nnodes": 3, "program": ["t.py"], "python_args": ["-u"]}),
    # python -m torch.distributed.run / torchrun: same as torchrun; launcher flags do not leak.
    (
        ["python", "-m", "torch.distributed.run", "--nproc-per-node=2", "t.py"],
        {"nproc_per_node": 2, "program": ["t.py"], "python_args": ["-u"]},
    ),
    (
        ["python3.11", "-u", "-m", "torch.distributed.run", "--standalone", "t.py", "a"],
        {"standalone": True, "nnodes": 1, "program": ["t.py", "a"], "python_args": ["-u"]},
    ),
    (
        ["/usr/bin/python3", "-m", "torchrun", "--nnodes=2", "-m", "pkg"],
        {"nnodes": 2, "mode": "module", "program": ["pkg"], "python_args": ["-u"]},
    ),
    # Plain python: one process per node.
    (["python", "train.py", "--a"], {"program": ["train.py", "--a"]}),
    (["/usr/bin/python3", "-u", "-O", "train.py"], {"program": ["train.py"], "python_args": ["-u", "-O"]}),
    (
        ["python", "-W", "ignore", "-Xdev", "-OO", "t.py"],
        {"program": ["t.py"], "python_args": ["-W", "ignore", "-Xdev", "-OO"]},
    ),
    (["python", "-uW", "error", "t.py"], {"program": ["t.py"], "python_args": ["-uW", "error"]}),
    (["python", "-m", "mymodule", "a"], {"mode": "module", "program": ["mymodule", "a"]}),
    (["python", "-u", "-m", "mymodule"], {"mode": "module", "program": ["mymodule"], "python_args": ["-u"]}),
    (["python", "-um", "mymodule", "-v"], {"mode": "module", "program": ["mymodule", "-v"], "python_args": ["-u"]}),
    (["python", "-mmymodule", "x"], {"mode": "module", "program": ["mymodule", "x"]}),
    (["python3.13t", "--", "t.py", "-u"], {"program": ["t.py", "-u"]}),
    # Bare script.
    (["train.py", "--lr", "1"], {"program": ["train.py", "--lr", "1"]}),
    (["./scripts/train.py"], {"program": ["./scripts/train.py"]}),
    (["/my dir/train.py", "a b"], {"program": ["/my dir/train.py", "a b"]}),
]


@pytest.mark.parametrize("argv, expected", OK_CASES, ids=[" ".join(c[0]) or "<empty>" for c in OK_CASES])
def test_parse_command_accepts(argv: list[str], expected: dict[str, Any]) -> None:
    spec = parse_command(argv)
    want = SpmdSpec(**expected)
    assert spec == want


# (argv, substrings the one-line error message must contain)
ERROR_CASES: list[tuple[list[str], list[str]]] = [
    ([], ["empty command"]),
    ([T], ["names no script"]),
    ([T, "--nproc-per-node=2"], ["names no script"]),
    ([T, "--nnodes=0", "t.py"], ["--nnodes=0", "out of range"]),
    ([T, "--nnodes=0:2", "t.py"], ["--nnodes=0", "out of range"]),
    ([T, "--nnodes=3:2", "t.py"], ["MIN 3 is larger than MAX 2"]),
    ([T, "--nnodes=1:2:3", "t.py"], ["not N or MIN:MAX"]),
    ([T, "--nnodes", "two", "t.py"], ["--nnodes='two'", "not an integer"]),
    ([T, "--nnodes"], ["--nnodes needs a value"]),
    ([T, "--nproc-per-node=-1", "t.py"], ["--nproc-per-node=-1", "out of range"]),
    ([T, "--nproc_per_node=0", "t.py"], ["--nproc_per_node=0", "out of range"]),
    ([T, "--nproc-per-node=many", "t.py"], ["'many' is not valid", "gpu, cpu or auto"]),
    ([T, "--nproc-per-node=xpu", "t.py"], ["'xpu' is not supported by monarch run-spmd"]),
    ([T, "--master-port=abc", "t.py"], ["--master-port='abc'", "not an integer"]),
    ([T, "--master_port", "70000", "t.py"], ["not a TCP port"]),
    ([T, "--master-port=-1", "t.py"], ["out of range"]),
    ([T, "--standalone", "--nnodes=2", "t.py"], ["--standalone runs a single node", "up to 2"]),
    ([T, "--nnodes=1:2", "--standalone", "t.py"], ["--standalone runs a single node"]),
    ([T, "--no-python", "-m", "mod"], ["--no-python and --module cannot be used together"]),
    ([T, "--logs-specs=mine", "t.py"], ["torchrun flag --logs-specs is not supported by monarch run-spmd"]),
    ([T, "--logs_specs", "mine", "t.py"], ["--logs_specs is not supported by monarch run-spmd"]),
    ([T, "--local-addr", "h", "t.py"], ["--local-addr is not supported by monarch run-spmd"]),
    ([T, "--event-log-handler=null", "t.py"], ["--event-log-handler is not supported"]),
    ([T, "--numa-binding", "node", "t.py"], ["--numa-binding is not supported"]),
    ([T, "--signals-to-handle=SIGUSR1", "t.py"], ["--signals-to-handle is not supported"]),
    ([T, "--virtual-local-rank", "t.py"], ["--virtual-local-rank is not supported"]),
    ([T, "--duplicate-stdout-filters", "a", "t.py"], ["--duplicate-stdout-filters is not supported"]),
    ([T, "--duplicate_stderr_filters=a", "t.py"], ["--duplicate_stderr_filters is not supported"]),
    ([T, "--shutdown-timeout=-5", "t.py"], ["--shutdown-timeout=-5 is out of range"]),
    ([T, "--start-method=thread", "t.py"], ["spawn, fork or forkserver"]),
    ([T, "--foo", "t.py"], ["unknown torchrun flag --foo", "after the script"]),
    ([T, "--nproc", "2", "t.py"], ["unknown torchrun flag --nproc", "did you mean --nproc-per-node?"]),
    ([T, "--use-env", "t.py"], ["unknown torchrun flag --use-env"]),
    ([T, "-x", "t.py"], ["unknown torchrun flag -x"]),
    ([T, "-nproc=2", "t.py"], ["unknown torchrun flag -nproc"]),
    ([T, "--standalone=1", "t.py"], ["--standalone takes no value"]),
    ([T, "-mfoo", "t.py"], ["-m takes no value"]),
    ([T, "--local-ranks-filter=a,b", "t.py"], ["comma-separated list of ranks"]),
    ([T, "--local-ranks-filter=0,-1", "t.py"], ["comma-separated list of ranks"]),
    ([T, "--tee=5", "t.py"], ["--tee='5' is not valid"]),
    ([T, "-r", "x", "t.py"], ["-r='x' is not valid"]),
    ([T, "--max-restarts=-1", "t.py"], ["--max-restarts=-1 is out of range"]),
    ([T, "--node-rank=-1", "t.py"], ["--node-rank=-1 is out of range"]),
    ([T, "--monitor-interval=soon", "t.py"], ["not a number of seconds"]),
    (["python"], ["python command names no script"]),
    (["python", "-u"], ["python command names no script"]),
    (["python", "-c", "print(1)"], ["python option -c is not supported"]),
    (["python", "-", "x"], ["python option - is not supported"]),
    (["python", "-i", "t.py"], ["python option -i is not supported"]),
    (["python", "--version"], ["python option --version is not supported"]),
    (["python", "-m"], ["`python -m` names no module"]),
    (["python", "-W"], ["-W needs a value"]),
    (["python", "-m", "torch.distributed.launch", "t.py"], ["deprecated", "torchrun"]),
    (["python", "-m", "torch.distributed.run", "--nnodes=0", "t.py"], ["--nnodes=0", "out of range"]),
    (["bash", "run.sh"], ["cannot tell how to run 'bash'", "--no-python"]),
    (["FOO=1", "python", "t.py"], ["environment assignment 'FOO=1'", "export"]),
    (["torchrun --standalone train.py"], ["split it into words"]),
    (["python3 -u train.py"], ["split it into words"]),
    ([T, "--nnode=2", "t.py"], ["unknown torchrun flag --nnode", "did you mean --nnodes?"]),
    ([T, "--master-adr=h", "t.py"], ["unknown torchrun flag --master-adr", "did you mean --master-addr?"]),
]


@pytest.mark.parametrize("argv, fragments", ERROR_CASES, ids=[" ".join(c[0]) or "<empty>" for c in ERROR_CASES])
def test_parse_command_rejects(argv: list[str], fragments: list[str]) -> None:
    with pytest.raises(JobError) as info:
        parse_command(argv)
    message = str(info.value)
    assert "\n" not in message
    for fragment in fragments:
        assert fragment in message


def test_parse_command_does_not_mutate_argv() -> None:
    argv = [T, "--nproc-per-node=2", "t.py", "--x"]
    copy = list(argv)
    spec = parse_command(argv)
    spec.program.append("changed")
    assert argv == copy


def test_job_error_is_one_line() -> None:
    assert str(JobError("first line\n   second   line")) == "first line second line"


@pytest.mark.parametrize(
    "value, gpus, cpus, expected",
    [
        (4, 8, 2, 4),
        ("3", 0, 1, 3),
        ("gpu", 8, 64, 8),
        ("cpu", 8, 64, 64),
        ("auto", 8, 64, 8),
        ("auto", 0, 64, 64),
        ("cpu", 0, 0, 1),
    ],
)
def test_resolve_nproc(value: int | str, gpus: int, cpus: int, expected: int) -> None:
    assert resolve_nproc(value, gpus, cpus) == expected


@pytest.mark.parametrize(
    "value, fragment",
    [
        ("gpu", "no GPUs"),
        (0, "out of range"),
        (-2, "out of range"),
        (True, "out of range"),
        ("many", "is not valid"),
        ("xpu", "not supported"),
    ],
)
def test_resolve_nproc_rejects(value: int | str, fragment: str) -> None:
    with pytest.raises(JobError, match=fragment):
        resolve_nproc(value, 0, 16)


CONTRACT = {
    "RANK",
    "LOCAL_RANK",
    "WORLD_SIZE",
    "LOCAL_WORLD_SIZE",
    "GROUP_RANK",
    "GROUP_WORLD_SIZE",
    "ROLE_RANK",
    "ROLE_WORLD_SIZE",
    "ROLE_NAME",
    "MASTER_ADDR",
    "MASTER_PORT",
    "NODE_RANK",
    "TORCHELASTIC_RUN_ID",
    "TORCHELASTIC_RESTART_COUNT",
    "TORCHELASTIC_MAX_RESTARTS",
    "TORCHELASTIC_USE_AGENT_STORE",
    "TORCH_NCCL_ASYNC_ERROR_HANDLING",
}


def _env(spec: SpmdSpec, environ: dict[str, str], **overrides: Any) -> dict[str, str]:
    kwargs: dict[str, Any] = dict(
        node_rank=1,
        nnodes=2,
        local_rank=2,
        nproc_per_node=4,
        master_addr="h0",
        master_port=29500,
        run_id="run-1",
        cpus_on_host=16,
        environ=environ,
    )
    kwargs.update(overrides)
    return rank_environment(spec, **kwargs)


def test_rank_environment_values() -> None:
    spec = parse_command([T, "--role", "trainer", "--max-restarts=2", "t.py"])
    env = _env(spec, {}, restart_count=1)
    assert env == {
        "RANK": "6",
        "LOCAL_RANK": "2",
        "WORLD_SIZE": "8",
        "LOCAL_WORLD_SIZE": "4",
        "GROUP_RANK": "1",
        "GROUP_WORLD_SIZE": "2",
        "ROLE_RANK": "6",
        "ROLE_WORLD_SIZE": "8",
        "ROLE_NAME": "trainer",
        "MASTER_ADDR": "h0",
        "MASTER_PORT": "29500",
        "NODE_RANK": "1",
        "TORCHELASTIC_RUN_ID": "run-1",
        "TORCHELASTIC_RESTART_COUNT": "1",
        "TORCHELASTIC_MAX_RESTARTS": "2",
        "TORCHELASTIC_USE_AGENT_STORE": "False",
        "TORCH_NCCL_ASYNC_ERROR_HANDLING": "1",
        "OMP_NUM_THREADS": "1",
    }
    assert all(isinstance(value, str) for value in env.values())


def test_rank_environment_ranks_cover_world() -> None:
    spec = SpmdSpec(program=["t.py"])
    ranks = [
        int(_env(spec, {}, node_rank=n, nnodes=3, local_rank=lr, nproc_per_node=2)["RANK"])
        for n in range(3)
        for lr in range(2)
    ]
    assert ranks == list(range(6))


def test_rank_environment_inherited_settings_win() -> None:
    spec = SpmdSpec(program=["t.py"])
    inherited = {"OMP_NUM_THREADS": "8", "TORCH_NCCL_ASYNC_ERROR_HANDLING": "3"}
    env = _env(spec, inherited)
    assert "OMP_NUM_THREADS" not in env  # inherited as-is, like torchrun
    assert env["TORCH_NCCL_ASYNC_ERROR_HANDLING"] == "3"
    single = _env(spec, {}, local_rank=0, nproc_per_node=1)
    assert "OMP_NUM_THREADS" not in single and set(single) == CONTRACT


def test_rank_environment_defaults_to_os_environ(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("OMP_NUM_THREADS", "5")
    env = rank_environment(
        SpmdSpec(),
        node_rank=0,
        nnodes=1,
        local_rank=0,
        nproc_per_node=2,
        master_addr="a",
        master_port=1,
        run_id="r",
        cpus_on_host=4,
    )
    assert "OMP_NUM_THREADS" not in env
    monkeypatch.delenv("OMP_NUM_THREADS")
    env = rank_environment(
        SpmdSpec(),
        node_rank=0,
        nnodes=1,
        local_rank=0,
        nproc_per_node=2,
        master_addr="a",
        master_port=1,
        run_id="r",
        cpus_on_host=4,
    )
    assert env["OMP_NUM_THREADS"] == "1"


@pytest.mark.parametrize("overrides", [{"node_rank": 2}, {"local_rank": 4}, {"local_rank": -1}])
def test_rank_environment_rejects_out_of_range(overrides: dict[str, int]) -> None:
    with pytest.raises(ValueError):
        _env(SpmdSpec(), {}, **overrides)


# torchrun sets these too, but they belong to its agent (error-file plumbing for @record,
# signal forwarding), which monarch replaces; a new key appearing here fails the test.
_AGENT_ONLY = {"TORCHELASTIC_ERROR_FILE", "TORCHELASTIC_SIGNALS_TO_HANDLE"}
# Inherently different per launch.  USE_AGENT_STORE: torchrun's agent hosts the TCPStore
# ("True"); under monarch rank 0 hosts it, so "False" is the correct value for us.
_PRESENCE_ONLY = {"MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RUN_ID", "TORCHELASTIC_USE_AGENT_STORE"}

_DUMP = """
    import json, os, sys
    with open(os.path.join(sys.argv[1], "rank%s.json" % os.environ["RANK"]), "w") as f:
        json.dump(dict(os.environ), f)
"""


@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("torch") is None, reason="needs torch")
@pytest.mark.parametrize("nproc", [2, 1])
def test_matches_real_torchrun(tmp_path: Path, nproc: int) -> None:
    script = tmp_path / "dump_env.py"
    script.write_text(textwrap.dedent(_DUMP))
    torchrun = Path(sys.executable).with_name("torchrun")
    launcher = [str(torchrun)] if torchrun.exists() else [sys.executable, "-m", "torch.distributed.run"]
    argv = [*launcher, "--standalone", f"--nproc-per-node={nproc}", str(script), str(tmp_path)]
    spec = parse_command(argv)
    assert spec.standalone and spec.nproc_per_node == nproc and spec.program[0] == str(script)

    parent = {
        k: v
        for k, v in os.environ.items()
        if k not in CONTRACT | {"LOCAL_RANK", "OMP_NUM_THREADS"} and not k.startswith(("PET_", "TORCHELASTIC_"))
    }
    done = subprocess.run(argv, env=parent, capture_output=True, text=True, timeout=180)
    assert done.returncode == 0, done.stderr[-3000:]

    for local_rank in range(nproc):
        child = json.loads((tmp_path / f"rank{local_rank}.json").read_text())
        added = {k: v for k, v in child.items() if parent.get(k) != v}
        ours = rank_environment(
            spec,
            node_rank=0,
            nnodes=1,
            local_rank=local_rank,
            nproc_per_node=nproc,
            master_addr="127.0.0.1",
            master_port=29500,
            run_id="x",
            cpus_on_host=os.cpu_count() or 1,
            environ=parent,
        )
        assert set(added) - _AGENT_ONLY == set(ours) - {"NODE_RANK"}
        for key in set(ours) - {"NODE_RANK"}:
            if key not in _PRESENCE_ONLY:
                assert added[key] == ours[key], key
        assert ("OMP_NUM_THREADS" in added) == (nproc > 1)
