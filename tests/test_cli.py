"""The `monarch` command as a user runs it: real processes, real agents, real exit codes."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from .conftest import REPO, one_line_error

TRAIN = """
import os, torch, torch.distributed as dist
dist.init_process_group("gloo")
t = torch.ones(1)
dist.all_reduce(t)
print(f"rank {dist.get_rank()} sum {t.item():.0f} group {os.environ['GROUP_RANK']}")
dist.destroy_process_group()
"""


def monarch(*args: str, cwd: Path, state: Path | None = None, timeout: float = 120) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "MONARCH_STATE"}
    if state is not None:
        env["MONARCH_STATE"] = str(state)
    return subprocess.run(
        [sys.executable, "-m", "monarch_cli", *args],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
        stdin=subprocess.DEVNULL,
    )


def test_help_lists_the_commands(tmp_path):
    proc = monarch("--help", cwd=tmp_path)
    assert proc.returncode == 0
    for command in ("serve", "run-spmd", "exec", "status", "warm", "stop", "logs", "demo"):
        assert command in proc.stdout


def test_dry_run_starts_nothing_and_says_what_it_would_do(tmp_path):
    state = tmp_path / "s" / "job_state.pkl"
    proc = monarch(
        "serve",
        "--hosts",
        "2",
        "--dry-run",
        "--json",
        "--",
        "torchrun",
        "--nproc-per-node=2",
        "t.py",
        cwd=tmp_path,
        state=state,
    )
    assert proc.returncode == 0, proc.stderr
    plan = json.loads(proc.stdout)
    assert plan["scheduler"] == "local" and plan["hosts"] == 2
    assert sum("monarch_cli.runtime.agent" in step for step in plan["steps"]) == 2
    assert not state.exists() and not state.parent.exists()
    text = monarch("serve", "--hosts", "2", "--dry-run", "--", "python", "t.py", cwd=tmp_path, state=state)
    assert text.stdout.startswith("local: start 2 host agent(s)") and "default command: python t.py" in text.stdout


@pytest.mark.slow
def test_serve_reserves_exactly_the_plan_a_dry_run_printed(tmp_path):
    state = tmp_path / ".monarch" / "job_state.pkl"
    printed = monarch("serve", "--hosts", "2", "--dry-run", "--json", "--", "python", "t.py", cwd=tmp_path, state=state)
    assert printed.returncode == 0, printed.stderr
    plan = json.loads(printed.stdout)
    (tmp_path / "plan.json").write_text(printed.stdout)
    served = monarch("serve", "--plan", "plan.json", "--json", cwd=tmp_path, state=state)
    assert served.returncode == 0, served.stderr
    try:
        status = json.loads(served.stdout)
        assert status["reservation_id"] == plan["reservation_id"] and status["default_command"] == ["python", "t.py"]
        # each agent runs the very command line the plan printed (the keys went on stdin);
        # its title in ps is its reservation, so the command it was started with is read from its log
        for log, step in zip(plan["data"]["logs"], plan["steps"]):
            started = [
                line for line in Path(log).read_text().splitlines() if line.startswith("monarch agent: started as: ")
            ]
            assert started and started[-1].removeprefix("monarch agent: started as: ") in step
        again = monarch("serve", "--plan", "plan.json", cwd=tmp_path, state=state)
        one_line_error(again, "--replace")  # a plan makes a new reservation; it never replaces one silently
    finally:
        monarch("stop", cwd=tmp_path, state=state)
    (tmp_path / "broken.json").write_text('{"scheduler": "local"}')
    broken = monarch("serve", "--plan", "broken.json", "--json", cwd=tmp_path, state=state)
    assert broken.returncode == 2 and json.loads(broken.stdout)["kind"] == "plan", broken.stdout


@pytest.mark.parametrize(
    "args, needle",
    [
        (("run-spmd",), "no reservation"),
        (("status",), "no reservation"),
        (("serve", "--scheduler", "pbs", "--", "python", "t.py"), "unknown scheduler 'pbs'"),
        (("serve", "--", "torchrun", "--bogus-flag", "t.py"), "--bogus-flag"),
        (("logs",), "no runs logged"),
        (("exec",), "give the command after"),
        (("serve", "--hosts", "0", "--dry-run"), "--hosts must be at least 1, not 0"),
        (("serve", "--hosts", "gpu1,gpu2", "--dry-run"), "the local scheduler takes a number of hosts, not names"),
        (("serve", "--scheduler", "ssh", "--dry-run"), "the ssh scheduler needs hosts by name"),
    ],
)
def test_bad_input_is_one_clear_line_and_a_non_zero_exit(tmp_path, args, needle):
    proc = monarch(*args, cwd=tmp_path, state=tmp_path / "none" / "job_state.pkl")
    one_line_error(proc, needle)


def test_stop_with_nothing_to_stop_succeeds_every_time(tmp_path):
    state = tmp_path / "none" / "job_state.pkl"
    for _ in range(2):
        plain = monarch("stop", cwd=tmp_path, state=state)
        assert plain.returncode == 0 and "nothing to stop" in plain.stderr, plain.stderr
    as_json = monarch("stop", "--json", cwd=tmp_path, state=state)
    assert as_json.returncode == 0
    assert json.loads(as_json.stdout) == {"stopped": None, "message": "nothing to stop"}


def test_version(tmp_path):
    from monarch_cli import __version__

    flag = monarch("--version", cwd=tmp_path)
    assert flag.returncode == 0 and flag.stdout == f"monarch-cli {__version__}\n"
    info = monarch("version", "--json", cwd=tmp_path)
    assert info.returncode == 0
    assert json.loads(info.stdout)["monarch_cli"] == __version__


def test_a_profiled_command_still_writes_its_profile(tmp_path):
    """Commands end with os._exit (cli._exit), skipping the interpreter's finalization; under a
    profiler they exit normally, so ``python -m cProfile -o`` gets to write what it measured
    (cProfile itself swallows the exit status: 0 either way)."""
    import pstats

    env = {**os.environ, "PYTHONPATH": str(REPO)}
    for args in (
        ["stop", "--state", str(tmp_path / "none.pkl")],
        ["exec", "--state", str(tmp_path / "none.pkl"), "true"],
    ):
        out = tmp_path / f"{args[0]}.prof"
        done = subprocess.run(
            [sys.executable, "-m", "cProfile", "-o", str(out), "-m", "monarch_cli", *args],
            capture_output=True,
            text=True,
            cwd=tmp_path,
            env=env,
            timeout=120,
        )
        assert ("nothing to stop" if args[0] == "stop" else "no reservation") in done.stderr, done.stderr
        assert any("monarch_cli" in f for f, *_ in pstats.Stats(str(out)).stats), args  # type: ignore[attr-defined]


def test_bash_completion_is_printed_installed_and_completes(tmp_path):
    """`--show-completion` prints the bash script; `--install-completion` installs it, and a real
    bash that sources its ~/.bashrc then completes `monarch ru<TAB>` and `monarch stop --<TAB>`."""
    bindir = Path(sys.executable).parent  # the console script `monarch` the completion script calls
    home = tmp_path / "home"
    home.mkdir()
    env = {**os.environ, "HOME": str(home), "PATH": f"{bindir}{os.pathsep}{os.environ['PATH']}"}

    def bash(script: str) -> subprocess.CompletedProcess:
        return subprocess.run(["bash", "-c", script], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=60)

    # The shell is detected from monarch's parent: `$(...)` keeps bash from exec-ing it in its own place.
    shown = bash('out=$(monarch --show-completion) && echo "$out"')
    assert shown.returncode == 0, shown.stderr
    assert "complete -o default -F _monarch_completion monarch" in shown.stdout
    installed = bash('out=$(monarch --install-completion) && echo "$out"')
    assert installed.returncode == 0 and "bash completion installed" in installed.stdout, installed.stderr
    done = bash("""
        source ~/.bashrc
        COMP_WORDS=(monarch ru); COMP_CWORD=1; _monarch_completion monarch; echo "${COMPREPLY[*]}"
        COMP_WORDS=(monarch stop --); COMP_CWORD=2; _monarch_completion monarch; echo "${COMPREPLY[*]}"
    """)
    assert done.returncode == 0, done.stderr
    commands, options = done.stdout.splitlines()
    assert commands == "run-spmd"
    assert set(options.split()) >= {"--state", "--force", "--json"}


@pytest.mark.slow
def test_from_a_subdirectory_the_reservation_and_the_served_paths_are_found(tmp_path):
    """Like git: serve in the project root, then work from anywhere below it."""
    project, sub = tmp_path / "project", tmp_path / "project" / "examples"
    sub.mkdir(parents=True)
    (sub / "train.py").write_text("import os; print('served script in', os.getcwd())\n")
    (sub / "local.py").write_text("import os; print('local script in', os.getcwd())\n")
    (project / ".monarch").mkdir()  # hermetic: a .monarch/ in a parent of tmp_path must not be used
    served = monarch(
        "serve", "--", "torchrun", "--nproc-per-node=1", "--log-dir=tlogs", "examples/train.py", cwd=project
    )
    assert served.returncode == 0, served.stderr
    state = project / ".monarch" / "job_state.pkl"
    try:
        status = monarch("status", "--json", cwd=sub)
        assert status.returncode == 0, status.stderr
        assert json.loads(status.stdout)["state_file"] == str(state)

        default = monarch("run-spmd", "--no-color", cwd=sub)  # the served relative path, from where it was served
        assert default.returncode == 0, default.stderr
        assert default.stdout == f"[rank0] served script in {project}\n"
        assert [p.read_text() for p in project.glob("tlogs/*/attempt_0/0/stdout.log")] == [
            f"served script in {project}\n"
        ]  # the relative --log-dir too

        explicit = monarch("run-spmd", "--no-color", "--", "torchrun", "--nproc-per-node=1", "local.py", cwd=sub)
        assert explicit.returncode == 0, explicit.stderr  # a command typed here means paths from here
        assert explicit.stdout == f"[rank0] local script in {sub}\n"

        logs = monarch("logs", "--rank", "0", cwd=sub)
        assert logs.returncode == 0 and logs.stdout == f"local script in {sub}\n"
        assert not (sub / ".monarch").exists() and not (sub / "tlogs").exists()

        again = monarch("serve", "--json", "--", "torchrun", "--nproc-per-node=1", "train.py", cwd=sub)
        assert again.returncode == 0, again.stderr  # the same reservation, now serving sub/train.py
        assert json.loads(again.stdout)["reservation_id"] == json.loads(status.stdout)["reservation_id"]
        from_root = monarch("run-spmd", "--no-color", cwd=project)
        assert from_root.stdout == f"[rank0] served script in {sub}\n", from_root.stderr
    finally:
        stopped = monarch("stop", cwd=sub)
    assert stopped.returncode == 0 and "released reservation" in stopped.stderr, stopped.stderr
    assert not state.exists()
    twice = monarch("stop", cwd=sub)
    assert twice.returncode == 0 and "nothing to stop" in twice.stderr


def test_corrupt_state_is_reported_and_stop_force_clears_it(tmp_path):
    state = tmp_path / ".monarch" / "job_state.pkl"
    state.parent.mkdir()
    state.write_bytes(b"\x80\x05garbage")
    one_line_error(monarch("status", cwd=tmp_path, state=state), "corrupt")
    one_line_error(monarch("run-spmd", cwd=tmp_path, state=state), "corrupt")
    proc = monarch("stop", "--force", cwd=tmp_path, state=state)
    assert proc.returncode == 0 and not state.exists()


@pytest.mark.slow
def test_serve_run_status_exec_logs_stop(tmp_path):
    (tmp_path / "train.py").write_text(TRAIN)
    state = tmp_path / ".monarch" / "job_state.pkl"
    served = monarch(
        "serve", "--hosts", "2", "--json", "--", "torchrun", "--nproc-per-node=2", "train.py", cwd=tmp_path, state=state
    )
    assert served.returncode == 0, served.stderr
    try:
        assert oct(state.stat().st_mode & 0o777) == "0o600"
        first = monarch("run-spmd", "--no-color", cwd=tmp_path, state=state)
        assert first.returncode == 0, first.stderr
        lines = sorted(l for l in first.stdout.splitlines() if l.startswith("[rank"))
        assert lines == [f"[rank{r}] rank {r} sum 4 group {r // 2}" for r in range(4)]
        assert "4 rank(s) finished" in first.stderr

        again = monarch("run-spmd", "--json", cwd=tmp_path, state=state)
        result = json.loads(again.stdout)
        assert again.returncode == 0 and result["exit_code"] == 0 and len(result["ranks"]) == 4

        failing = monarch("run-spmd", "--", "torchrun", "--nproc-per-node=1", "fail.py", cwd=tmp_path, state=state)
        assert failing.returncode != 0  # fail.py does not exist: python exits 2 on every rank
        assert "failed first" in failing.stderr and "exit status" in failing.stderr

        status = json.loads(monarch("status", "--json", cwd=tmp_path, state=state).stdout)
        assert status["alive"] and [h["name"] for h in status["hosts"]] == ["local0", "local1"]
        assert status["last_run"]["exit_code"] == failing.returncode

        ex = monarch("exec", "--no-color", "--", "echo host $GROUP_RANK-ish; exit 0", cwd=tmp_path, state=state)
        assert ex.returncode == 0
        assert sorted(l.split()[0] for l in ex.stdout.splitlines()) == ["[local0]", "[local1]"]
        ex_json = monarch("exec", "--json", "--", "exit $GROUP_RANK", cwd=tmp_path, state=state)
        report = json.loads(ex_json.stdout)
        assert ex_json.returncode == 1 and [(r["host"], r["exit_code"]) for r in report["ranks"]] == [
            ("local0", 0),
            ("local1", 1),
        ]

        logs = monarch("logs", "--json", cwd=tmp_path, state=state)
        assert logs.returncode == 0 and json.loads(logs.stdout)["run_id"].startswith("exec-")
        run_id = result["run_id"]
        rank3 = monarch("logs", run_id, "--rank", "3", cwd=tmp_path, state=state)
        assert rank3.stdout == "rank 3 sum 4 group 1\n"

        refuse = monarch("serve", "--hosts", "1", cwd=tmp_path, state=state)
        one_line_error(refuse, "--replace")
    finally:
        stopped = monarch("stop", "--json", cwd=tmp_path, state=state)
    assert stopped.returncode == 0, stopped.stderr
    assert not state.exists()
    gone = monarch("status", cwd=tmp_path, state=state)
    one_line_error(gone, "no reservation")


@pytest.mark.slow
def test_demo_runs_end_to_end(tmp_path):
    proc = monarch("demo", "--hosts", "2", "--runs", "2", cwd=tmp_path, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.count("replicas in sync") == 2
    assert proc.stderr.count("rank(s) finished in") == 2
    assert "monarch stop" in proc.stderr


@pytest.mark.slow
def test_logs_follow_prints_a_run_as_it_happens_and_stops_with_it(tmp_path):
    (tmp_path / "slow.py").write_text(
        "import os, time\n"
        "for i in range(4):\n"
        "    print(f'step {i} of rank {os.environ[\"RANK\"]}', flush=True)\n"
        "    time.sleep(0.5)\n"
    )
    state = tmp_path / ".monarch" / "job_state.pkl"
    assert monarch("serve", "--", "python", "slow.py", cwd=tmp_path, state=state).returncode == 0
    try:
        run = subprocess.Popen(
            [sys.executable, "-m", "monarch_cli", "run-spmd"],
            cwd=tmp_path,
            env={**os.environ, "MONARCH_STATE": str(state)},
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        logs_root = state.parent / "logs"
        deadline = time.monotonic() + 30
        while not (logs_root.exists() and any(logs_root.iterdir())) and time.monotonic() < deadline:
            time.sleep(0.05)
        follow = subprocess.Popen(
            [sys.executable, "-m", "monarch_cli", "logs", "-f"],
            cwd=tmp_path,
            env={**os.environ, "MONARCH_STATE": str(state)},
            stdout=subprocess.PIPE,
            text=True,
        )
        first = follow.stdout.readline()
        assert first.startswith("[rank0] step 0") and run.poll() is None  # seen while the run goes on
        rest = follow.stdout.read()  # (not communicate(): it would skip what readline buffered)
        assert follow.wait(30) == 0 and run.wait(30) == 0  # it ends by itself when the run does
        assert [l for l in (first + rest).splitlines()] == [f"[rank0] step {i} of rank 0" for i in range(4)]
    finally:
        monarch("stop", cwd=tmp_path, state=state)


def test_the_installed_monarch_command_runs() -> None:
    """The console script (not only `python -m monarch_cli`), from the interpreter's own bin/."""
    done = subprocess.run(
        [str(Path(sys.executable).parent / "monarch"), "--help"], capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stderr
    assert "run-spmd" in done.stdout and "debug" in done.stdout


def test_the_example_is_the_script_the_demo_runs() -> None:
    """One source: the example is a link to the script the package ships (and the demo runs)."""
    example = REPO / "examples" / "train_ddp.py"
    assert example.is_symlink() and example.resolve() == (REPO / "monarch_cli" / "templates" / "train_ddp.py").resolve()


def test_every_command_is_mapped_to_the_module_that_registers_it() -> None:
    """`monarch CMD` loads only CMD's module: the map must name every command, and each module
    loaded alone must register the commands the map gives it."""
    code = """
import json, sys, typer
from monarch_cli import cli
only = sys.argv[1]
app = cli._app(None if only == "all" else only)
print(json.dumps(sorted(typer.main.get_command(app).commands)))
"""

    def commands(only: str) -> set:
        done = subprocess.run([sys.executable, "-c", code, only], capture_output=True, text=True, cwd=REPO)
        assert done.returncode == 0, done.stderr
        return set(json.loads(done.stdout))

    from monarch_cli.cli import COMMAND_MODULES

    assert commands("all") == set(COMMAND_MODULES)
    for module in set(COMMAND_MODULES.values()):
        mine = {c for c, m in COMMAND_MODULES.items() if m == module}
        assert mine <= commands(module), module
