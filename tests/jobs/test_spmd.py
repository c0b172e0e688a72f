"""SPMD runs on a real 2-host local reservation: torchrun's environment contract, gloo
collectives across hosts, warm/cold equivalence (and both against a plain interpreter),
and user code edits being picked up by every warm run.
"""

from __future__ import annotations

import io
import json
import os
import pprint
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import psutil
import pytest

from monarch_cli.jobs import Job, JobError, RunOptions, serve
from monarch_cli.jobs.run_log import rank_log

from ..conftest import write_script
from .conftest import Run, spmd, wait_warm


@pytest.fixture(scope="module")
def job(job_dir: Path):
    """This module's reservation learns (the default, set here in case the environment turns it
    off), so the equivalence tests cover learned warm ranks."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("MONARCH_LEARN_PRELOAD", "1")  # read by the agents when they start
        j = serve(None, hosts=2, state=job_dir / ".monarch" / "job_state.pkl")
    yield j
    j.stop()


CONTRACT = [
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
    "OMP_NUM_THREADS",
]

DUMP_ENV = """
import json, os, sys
keys = json.loads(sys.argv[2])
info = {k: os.environ.get(k) for k in keys}
info["ppid"] = os.getppid()
info["user_var"] = os.environ.get("MONARCH_TEST_USER_VAR")
with open(os.path.join(sys.argv[1], "env-%s.json" % os.environ["RANK"]), "w") as f:
    json.dump(info, f)
"""

ALL_REDUCE = """
import torch
import torch.distributed as dist

dist.init_process_group("gloo")
t = torch.tensor([float(dist.get_rank() + 1)])
dist.all_reduce(t)
print(f"sum={t.item():g} world={dist.get_world_size()} rank={dist.get_rank()}", flush=True)
dist.barrier()
dist.destroy_process_group()
"""


def read_dumps(directory: Path, pattern: str) -> dict[int, dict[str, Any]]:
    found = {}
    for path in directory.glob(pattern):
        data = json.loads(path.read_text())
        found[int(path.name.split("-")[1].split(".")[0])] = data
    return found


# ------------------------------------------------------------------ environment contract
def test_environment_contract_on_two_hosts(job: Job, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setenv("MONARCH_TEST_USER_VAR", "from-the-controller")  # set after serve: still seen
    script = write_script(tmp_path, "dump_env.py", DUMP_ENV)
    run = spmd(job, script, str(tmp_path), json.dumps(CONTRACT))
    assert run.result.exit_code == 0, run.text()

    envs = read_dumps(tmp_path, "env-*.json")
    assert sorted(envs) == [0, 1, 2, 3]
    agents = {h.pid: h.node_rank for h in job.state.hosts}
    for rank, env in envs.items():
        node, local = divmod(rank, 2)
        assert env["RANK"] == str(rank)
        assert env["LOCAL_RANK"] == str(local)
        assert env["WORLD_SIZE"] == "4"
        assert env["LOCAL_WORLD_SIZE"] == "2"
        assert env["GROUP_RANK"] == env["NODE_RANK"] == str(node)
        assert env["GROUP_WORLD_SIZE"] == "2"
        assert env["ROLE_RANK"] == str(rank)
        assert env["ROLE_WORLD_SIZE"] == "4"
        assert env["ROLE_NAME"] == "default"
        assert env["TORCHELASTIC_RUN_ID"] == run.result.run_id
        assert env["TORCHELASTIC_RESTART_COUNT"] == "0"
        assert env["TORCHELASTIC_MAX_RESTARTS"] == "0"
        assert env["OMP_NUM_THREADS"] == "1"  # torchrun's default with >1 rank per node
        assert env["user_var"] == "from-the-controller"
        # The rank really runs under the agent of host GROUP_RANK: rank -> zygote -> agent.
        agent_pid = psutil.Process(env["ppid"]).ppid()
        assert agents[agent_pid] == node, f"rank {rank} runs under agent {agent_pid}, not host {node}"
    assert len({(e["MASTER_ADDR"], e["MASTER_PORT"]) for e in envs.values()}) == 1
    assert 0 < int(envs[0]["MASTER_PORT"]) < 65536
    # The controller's view of placement agrees.
    assert {r.rank: r.host for r in run.result.ranks} == {0: "local0", 1: "local0", 2: "local1", 3: "local1"}


# ------------------------------------------------------------------- collectives
def test_gloo_all_reduce_across_two_hosts(job: Job, tmp_path: Path) -> None:
    script = write_script(tmp_path, "allreduce.py", ALL_REDUCE)
    run = spmd(job, script)
    assert run.result.exit_code == 0, run.text()
    lines = run.by_rank()
    assert sorted(lines) == ["rank0", "rank1", "rank2", "rank3"]
    for rank in range(4):
        assert lines[f"rank{rank}"] == [f"sum=10 world=4 rank={rank}".encode()]


def test_all_reduce_with_an_explicit_master_port(job: Job, tmp_path: Path) -> None:
    """--master-port given: rank 0 binds the store itself (no port reserved by the agent)."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    script = write_script(tmp_path, "allreduce.py", ALL_REDUCE)
    run = spmd(job, script, flags=["--master-addr=127.0.0.1", f"--master-port={port}"])
    assert run.result.exit_code == 0, run.text()
    assert sorted(run.lines()) == sorted(f"[rank{r}] sum=10 world=4 rank={r}".encode() for r in range(4))


def test_nnodes_1_uses_only_the_first_host(job: Job, tmp_path: Path) -> None:
    script = write_script(tmp_path, "allreduce.py", ALL_REDUCE)
    run = spmd(job, script, flags=["--nnodes=1"])
    assert run.result.exit_code == 0, run.text()
    assert [(r.rank, r.host) for r in run.result.ranks] == [(0, "local0"), (1, "local0")]
    assert sorted(run.lines()) == [b"[rank0] sum=3 world=2 rank=0", b"[rank1] sum=3 world=2 rank=1"]


def test_run_options_as_an_object_with_keywords_on_top(job: Job, tmp_path: Path) -> None:
    """``RunOptions`` is what ``run_spmd``'s keywords build: an options object runs as asked, a keyword given
    beside it wins, and a misspelt option is refused before anything starts."""
    script = write_script(tmp_path, "who.py", "import os\nprint('I am', os.environ['RANK'])\n")
    unused, out = io.BytesIO(), io.BytesIO()
    options = RunOptions(ranks={1}, stdout=unused, stderr=io.BytesIO())
    result = job.run_spmd(["torchrun", "--nproc-per-node=2", str(script)], options, stdout=out)
    assert result.exit_code == 0
    assert out.getvalue().splitlines() == [b"[rank1] I am 1"] and unused.getvalue() == b""
    assert rank_log(result.log_dir, 0).read_bytes() == b"I am 0\n"  # hidden from the console, still logged
    with pytest.raises(TypeError, match="colour"):
        job.run_spmd(["torchrun", "--nproc-per-node=2", str(script)], colour=True)


def test_nnodes_above_the_reservation_is_a_clear_error(job: Job, tmp_path: Path) -> None:
    script = write_script(tmp_path, "allreduce.py", ALL_REDUCE)
    with pytest.raises(JobError) as info:
        spmd(job, script, flags=["--nnodes=3"])
    message = str(info.value)
    assert "--nnodes 3" in message and "2 reserved" in message and "\n" not in message
    # Nothing was started: the reservation still runs the next command.
    assert spmd(job, script).result.exit_code == 0


# ------------------------------------------------------------------- warm vs cold
PROBE = r"""
import os, sys
PRELOADED = "torch" in sys.modules  # a warm rank's zygote imported torch; a fresh interpreter did not
LEARNED = "wave" in sys.modules  # ...and, once it learned from earlier runs, wave (imported below)
OWN_BEFORE = sorted(n for n in sys.modules if n.startswith("probe_helper"))  # never preloaded
import atexit, json, pickle, signal, warnings, wave, weakref
import probe_helper
import torch


class Thing:
    def __init__(self):
        self.value = 42


def stream(f):
    return {"line_buffering": f.line_buffering, "write_through": f.write_through, "encoding": f.encoding,
            "errors": f.errors, "buffer": type(f.buffer).__name__, "name": str(f.name), "fileno": f.fileno()}


def handlers():
    found = {}
    for sig in signal.Signals:
        try:
            h = signal.getsignal(sig)
        except (OSError, ValueError):
            continue
        found[sig.name] = h if isinstance(h, int) else getattr(h, "__qualname__", repr(h))
    return found


def pickles():
    try:
        return type(pickle.loads(pickle.dumps(Thing()))).__name__ == "Thing"
    except Exception as e:
        return repr(e)


main = sys.modules["__main__"]
out = os.path.join(os.environ["PROBE_OUT"], "probe-%s.json" % os.environ.get("RANK", "plain"))
KEPT = Thing()
weakref.finalize(KEPT, lambda path: open(path, "w").close(), out + ".finalized")  # runs at exit, as its own
info = {
    "preloaded": PRELOADED,
    "learned": LEARNED,
    "own_before": OWN_BEFORE,
    "helper": probe_helper.__file__,
    "env": dict(os.environ),
    "argv": sys.argv,
    "name": __name__,
    "main_file": getattr(main, "__file__", None),
    "file": __file__,
    "main_is_this_module": main.__dict__ is globals(),
    "cwd": os.getcwd(),
    "path0": sys.path[0],
    "path": sys.path,
    "torch_threads": torch.get_num_threads(),
    "flags": {k: getattr(sys.flags, k) for k in dir(sys.flags) if not k.startswith("_") and k not in ("count", "index", "n_fields", "n_sequence_fields", "n_unnamed_fields")},
    "dont_write_bytecode": sys.dont_write_bytecode,
    "stdout": stream(sys.stdout),
    "stderr": stream(sys.stderr),
    "stdin": stream(sys.stdin),
    "stdin_reads": sys.stdin.read(),
    "pickles": pickles(),
    "handlers": handlers(),
    "sigint_is_default": signal.getsignal(signal.SIGINT) is signal.default_int_handler,
    "sigterm_is_default": signal.getsignal(signal.SIGTERM) == signal.SIG_DFL,
    "blocked": sorted(int(s) for s in signal.pthread_sigmask(signal.SIG_BLOCK, [])),
    "recursion_limit": sys.getrecursionlimit(),
    "warnings": [repr(f) for f in warnings.filters],
    "exc_info": repr(sys.exc_info()),
    "spec": repr(getattr(main, "__spec__", None)),
    "torch_seed": torch.initial_seed(),
    "hash": hash("monarch"),
    "session_leader": os.getsid(0) == os.getpid(),
}


@atexit.register
def at_exit():
    with open(out + ".atexit", "w") as f:
        json.dump({"ran": True, "pickles": pickles(), "main_file": getattr(sys.modules["__main__"], "__file__", None)}, f)


with open(out, "w") as f:
    json.dump(info, f, indent=1)
print("probe done")
sys.exit(7)
"""

# Inherently different between two runs / processes, however they start.
RUN_SPECIFIC_ENV = {"MASTER_PORT", "TORCHELASTIC_RUN_ID", "MONARCH_RUN_ID", "PROBE_OUT"}
PROCESS_SPECIFIC = {"preloaded", "learned", "torch_seed", "hash"}
WARM_MODES = ("warm", "warm2", "learned")


def load_probes(directory: Path) -> dict[Any, dict[str, Any]]:
    found: dict[Any, dict[str, Any]] = {}
    for path in directory.glob("probe-*.json"):
        key = path.stem.split("-", 1)[1]
        data = json.loads(path.read_text())
        at_exit = path.with_name(path.name + ".atexit")
        data["atexit"] = json.loads(at_exit.read_text()) if at_exit.exists() else None
        data["finalized"] = path.with_name(path.name + ".finalized").exists()
        found[int(key) if key.isdigit() else key] = data
    return found


def comparable(probe: dict[str, Any]) -> dict[str, Any]:
    data = {k: v for k, v in probe.items() if k not in PROCESS_SPECIFIC}
    data["env"] = {k: v for k, v in probe["env"].items() if k not in RUN_SPECIFIC_ENV}
    return data


def differences(a: dict[str, Any], b: dict[str, Any]) -> dict[str, Any]:
    diff: dict[str, Any] = {}
    for key in sorted(set(a) | set(b)):
        if key == "env":
            env_diff = {
                k: (a["env"].get(k), b["env"].get(k))
                for k in set(a["env"]) | set(b["env"])
                if a["env"].get(k) != b["env"].get(k)
            }
            if env_diff:
                diff["env"] = env_diff
        elif a.get(key) != b.get(key):
            diff[key] = (a.get(key), b.get(key))
    return diff


@pytest.fixture(scope="module")
def probes(job: Job, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """The probe run warm (twice), warm again once the warm processes learned its imports
    ("learned"), cold, and by a plain ``python -u`` with rank 1's environment.

    The script is given by a relative path from its own directory, as users type it.
    """
    base = tmp_path_factory.mktemp("probe")
    write_script(base, "probe.py", PROBE)
    write_script(base, "probe_helper.py", "VALUE = 1\n")
    found: dict[str, Any] = {}
    job.forget_preload()  # what the warm processes learn comes from the probe alone
    with pytest.MonkeyPatch.context() as mp:
        mp.chdir(base)
        mp.delenv("OMP_NUM_THREADS", raising=False)
        for mode in (*WARM_MODES, "cold"):
            out = base / mode
            out.mkdir()
            mp.setenv("PROBE_OUT", str(out))
            if mode == "learned":
                found["warm_info"] = wait_warm(job)
            run = spmd(job, Path("probe.py"), "a b", "--flag", cold=mode == "cold")
            found[mode] = {"run": run, "ranks": load_probes(out)}
    plain_out = base / "plain"
    plain_out.mkdir()
    env = dict(found["warm"]["ranks"][1]["env"])
    env["PROBE_OUT"] = str(plain_out)
    env.pop("RANK")  # the plain probe names its dump probe-plain.json
    proc = subprocess.run(
        [sys.executable, "-u", "probe.py", "a b", "--flag"],
        cwd=base,
        env=env,
        stdin=subprocess.DEVNULL,
        capture_output=True,
        timeout=120,
        preexec_fn=_as_from_a_terminal,
    )
    plain = load_probes(plain_out)["plain"]
    plain["env"]["RANK"] = "1"
    found["plain"] = {"returncode": proc.returncode, "probe": plain, "stderr": proc.stderr}
    found["dir"] = base
    return found


def test_probe_ran_warm_and_cold(probes: dict[str, Any]) -> None:
    for mode in (*WARM_MODES, "cold"):
        run: Run = probes[mode]["run"]
        assert run.result.exit_code == 7, run.text()
        assert [r.exitcode for r in run.result.ranks] == [7, 7, 7, 7]
        assert sorted(run.lines()) == [f"[rank{r}] probe done".encode() for r in range(4)]
        assert sorted(probes[mode]["ranks"]) == [0, 1, 2, 3]
    # Make sure the comparison is between the two start paths, not twice the same one.
    assert all(p["preloaded"] for mode in WARM_MODES for p in probes[mode]["ranks"].values())
    assert not any(p["learned"] for mode in ("warm", "cold") for p in probes[mode]["ranks"].values())
    assert all(p["learned"] for p in probes["learned"]["ranks"].values())  # forked from the learned set
    # (cold rank 0 imports torch.distributed itself, to serve the rendezvous store)
    assert not any(p["preloaded"] for r, p in probes["cold"]["ranks"].items() if r != 0)


@pytest.mark.parametrize("mode", ["warm", "learned"])
@pytest.mark.parametrize("rank", [0, 1, 2, 3])
def test_warm_and_cold_ranks_see_the_same_process(probes: dict[str, Any], rank: int, mode: str) -> None:
    warm = comparable(probes[mode]["ranks"][rank])
    cold = comparable(probes["cold"]["ranks"][rank])
    diff = differences(warm, cold)
    assert not diff, "warm | cold differ:\n" + pprint.pformat(diff)


def _as_from_a_terminal() -> None:
    """The plain interpreter gets the dispositions of one started from a terminal, as ranks do
    (``rank.start._default_signals``), not what this test process inherited: under ``nohup``
    SIGHUP arrives ignored, and the comparison was of the test's launcher, not of the ranks."""
    for sig in (signal.SIGTERM, signal.SIGUSR1, signal.SIGUSR2, signal.SIGHUP, signal.SIGINT, signal.SIGQUIT):
        signal.signal(sig, signal.SIG_DFL)


@pytest.mark.parametrize("mode", ["warm", "learned", "cold"])
def test_ranks_match_a_plain_interpreter(probes: dict[str, Any], mode: str) -> None:
    """Rank 1 against ``python -u probe.py`` started with the same environment and cwd."""
    assert probes["plain"]["returncode"] == 7, probes["plain"]["stderr"]
    rank = comparable(probes[mode]["ranks"][1])
    plain = comparable(probes["plain"]["probe"])
    for probe in (rank, plain):
        probe.pop("session_leader")  # ranks get their own session (killpg); a plain child does not
        for key in ("file", "main_file"):  # see test_main_file_is_absolute_as_in_python
            probe.pop(key)
        probe["atexit"] = {k: v for k, v in probe["atexit"].items() if k != "main_file"}
    diff = differences(rank, plain)
    assert not diff, f"{mode} rank | plain python differ:\n" + pprint.pformat(diff)


@pytest.mark.parametrize("mode", ["warm", "learned", "cold"])
def test_what_the_probe_saw(probes: dict[str, Any], mode: str) -> None:
    base: Path = probes["dir"]
    for _rank, p in probes[mode]["ranks"].items():
        assert p["own_before"] == [] and p["helper"] == str(
            base / "probe_helper.py"
        )  # the workspace is never preloaded
        assert p["argv"] == ["probe.py", "a b", "--flag"]
        assert p["name"] == "__main__" and p["main_is_this_module"]
        assert p["main_file"] == p["file"]
        assert os.path.join(p["cwd"], p["file"]) == str(base / "probe.py")
        assert p["cwd"] == str(base)
        assert p["path0"] == str(base)
        assert p["torch_threads"] == 1
        assert p["stdout"]["write_through"] and not p["stdout"]["line_buffering"]  # `python -u`
        assert p["stdout"]["fileno"] == 1 and p["stderr"]["fileno"] == 2
        assert p["stdin_reads"] == ""
        assert p["pickles"] is True
        assert p["sigint_is_default"] and p["sigterm_is_default"]
        assert p["blocked"] == []
        assert p["exc_info"] == "(None, None, None)"
        assert p["session_leader"]
        assert p["atexit"] == {"ran": True, "pickles": True, "main_file": p["file"]}  # __main__ is still the script
        assert p["finalized"]  # its own weakref.finalize callbacks run at exit (the warm process's do not)


def test_main_file_is_absolute_as_in_python(probes: dict[str, Any]) -> None:
    plain = probes["plain"]["probe"]
    assert plain["file"] == str(probes["dir"] / "probe.py")
    for mode in ("warm", "learned", "cold"):
        assert probes[mode]["ranks"][1]["file"] == plain["file"]


def test_warm_ranks_get_their_own_torch_seed(probes: dict[str, Any]) -> None:
    """An unseeded torch draws differently in every process, as with torchrun, not once per zygote."""
    seeds = [p["torch_seed"] for mode in WARM_MODES for p in probes[mode]["ranks"].values()]
    assert len(set(seeds)) == len(seeds) == 12


def test_interpreter_start_up_variables_are_honoured(job: Job, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """PYTHONPATH and PYTHONHASHSEED set after serve act as they do for a fresh interpreter."""
    extra = tmp_path / "extra"
    write_script(extra, "extra_mod.py", "VALUE = 'extra'\n")
    script = write_script(
        tmp_path,
        "startup.py",
        """
        import extra_mod
        print(extra_mod.VALUE, hash("monarch"))
    """,
    )
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [str(extra), os.environ.get("PYTHONPATH")])))
    monkeypatch.setenv("PYTHONHASHSEED", "123")
    expected = subprocess.run(
        [sys.executable, "-c", "print(hash('monarch'))"], capture_output=True, text=True, check=True
    ).stdout.strip()
    notices: list[str] = []
    run = spmd(job, script, notices=notices)
    assert run.result.exit_code == 0, run.text()
    assert sorted(run.lines()) == [f"[rank{r}] extra {expected}".encode() for r in range(4)]
    # ...which costs a cold start, and the user is told why, once per host.
    cold = [n for n in notices if "start cold" in n]
    assert len(cold) == len(job.state.hosts) and all("PYTHONHASHSEED, PYTHONPATH differ" in n for n in cold), notices


def test_a_plain_warm_run_gives_no_cold_start_notice(job: Job, tmp_path: Path) -> None:
    notices: list[str] = []
    run = spmd(job, write_script(tmp_path, "plain.py", "print('hi')\n"), notices=notices)
    assert run.result.exit_code == 0, run.text()
    assert not [n for n in notices if "start cold" in n], notices
    assert not [n for n in notices if "not used" in n], notices


def test_rendezvous_flags_of_a_multi_node_command_run_and_are_said_to_be_unused(job: Job, tmp_path: Path) -> None:
    notices: list[str] = []
    flags = ["--rdzv-backend=c10d", "--rdzv-endpoint=elsewhere:29400", "--rdzv-conf=timeout=900", "--node-rank=0"]
    run = spmd(job, write_script(tmp_path, "plain.py", "print('hi')\n"), flags=flags, notices=notices)
    assert run.result.exit_code == 0, run.text()
    assert [n for n in notices if "not used" in n] == [
        "--rdzv-backend, --rdzv-endpoint, --rdzv-conf, --node-rank not used: the reservation's hosts and agents "
        "do torchrun's rendezvous, on rank 0's host"
    ]


# ------------------------------------------------------------------ code edits
def test_edits_are_picked_up_by_every_warm_run(job: Job, tmp_path: Path) -> None:
    write_script(tmp_path, "helper.py", "VALUE = 1\n")
    script = write_script(
        tmp_path,
        "train.py",
        """
        import helper
        print(f"v1 helper={helper.VALUE}")
    """,
    )
    first = spmd(job, script)
    assert first.result.exit_code == 0, first.text()
    assert sorted(first.lines()) == [f"[rank{r}] v1 helper=1".encode() for r in range(4)]

    write_script(tmp_path, "helper.py", "VALUE = 'two, edited'\n")
    write_script(tmp_path, "newmod.py", "NAME = 'brand new module'\n")
    write_script(
        tmp_path,
        "train.py",
        """
        import helper, newmod
        print(f"second version helper={helper.VALUE} new={newmod.NAME}")
    """,
    )
    second = spmd(job, script)
    assert second.result.exit_code == 0, second.text()
    assert sorted(second.lines()) == [
        f"[rank{r}] second version helper=two, edited new=brand new module".encode() for r in range(4)
    ]

    write_script(tmp_path, "helper.py", "raise ImportError('helper now refuses to import')\n")
    third = spmd(job, script, grace=0.5)
    assert third.result.exit_code == 1
    assert "ImportError: helper now refuses to import" in third.result.first_failure.tail[-1]
