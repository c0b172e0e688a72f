"""`monarch run-spmd` and `monarch exec` without Typer (cli/fast.py) give what Typer gives.

The fast route must parse every command line it takes exactly as Typer does, leave every
other one to Typer (help, usage errors), and print the same bytes and exit with the same
status afterwards, errors included, on a pipe and with colour forced.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

from monarch_cli.cli import _app, fast, runs

#: Command lines the fast route takes; Typer must read each one the same way.
TAKEN: list[list[str]] = [
    ["run-spmd", "--keep-ranks", "--", "torchrun", "train.py"],
    ["run-spmd"],
    ["run-spmd", "--json"],
    ["run-spmd", "--cold", "--no-color", "--ranks", "0,1", "--state", "s/job_state.pkl"],
    ["run-spmd", "--ranks=0-1", "--state=x.pkl", "--color"],
    ["run-spmd", "-e", "A=1", "-eB=2", "--env", "C", "--env=D=4", "-e", "E=--x"],
    ["run-spmd", "--straggler-grace", "2.5", "--post-mortem", "--no-sync", "--workspace", "ws"],
    ["run-spmd", "--stall-timeout", "600"],
    ["run-spmd", "--straggler-grace=0"],
    ["run-spmd", "--no-group", "--json"],
    ["run-spmd", "--group"],
    ["run-spmd", "--", "torchrun", "--nproc-per-node=2", "train.py", "--lr", "0.1"],
    ["run-spmd", "--cold", "--", "python", "-m", "pkg.train", "--help"],  # the script's --help
    ["run-spmd", "python", "train.py", "--json"],  # options end where the command starts
    ["run-spmd", "--"],
    ["exec", "--", "nvidia-smi", "-L"],
    ["exec", "--json", "--no-color", "--state", "s.pkl", "--", "sh", "-c", "echo $RANK"],
    ["exec", "hostname"],
    ["exec"],  # no command: the command's own error, on both routes
]

#: Command lines left to Typer: its help, its usage errors, and what the fast route does not judge.
LEFT: list[list[str]] = [
    ["run-spmd", "--help"],
    ["run-spmd", "-h"],
    ["exec", "--help"],
    ["run-spmd", "--cold", "-h"],
    ["run-spmd", "--bogus"],
    ["run-spmd", "--col"],
    ["run-spmd", "--ranks"],
    ["run-spmd", "--cold=yes"],
    ["run-spmd", "--straggler-grace", "-1"],
    ["run-spmd", "--straggler-grace", "soon"],
    ["run-spmd", "--straggler-grace", "1e3"],
    ["run-spmd", "--state", "a", "--state", "b"],
    ["run-spmd", "--color", "--no-color"],
    ["run-spmd", "--group", "--no-group"],
    ["run-spmd", "--state", ""],
    ["run-spmd", "-"],
    ["exec", "-e", "A=1", "--", "true"],
    ["exec", "--cold", "--", "true"],
    ["run-spmd", "-x"],
]


def _typer_params(argv: list[str], monkeypatch: pytest.MonkeyPatch) -> tuple[int, tuple[str, dict[str, Any]] | None]:
    """Typer's exit status for ``argv`` and, if it got that far, what the command was called with."""
    seen: list[tuple[str, dict[str, Any]]] = []
    names = {
        "run_spmd": [
            "command",
            "state",
            "ranks",
            "cold",
            "color",
            "post_mortem",
            "env",
            "workspace",
            "no_sync",
            "straggler_grace",
            "as_json",
            "group",
            "stall_timeout",
            "keep_ranks",
        ],
        "exec_command": ["command", "state", "color", "as_json"],
    }
    for attr, command in (("run_spmd", "run-spmd"), ("exec_command", "exec")):
        monkeypatch.setattr(runs, attr, lambda *a, _n=names[attr], _c=command: seen.append((_c, dict(zip(_n, a)))) or 0)
    done = CliRunner().invoke(_app(None), argv)
    return done.exit_code, (seen[0] if seen else None)


def _plain(params: dict[str, Any]) -> dict[str, Any]:
    return {
        **params,
        "command": params["command"] or None,
        **({"env": params["env"] or None} if "env" in params else {}),
    }


@pytest.mark.parametrize("argv", TAKEN, ids=" ".join)
def test_the_fast_route_reads_a_command_line_as_typer_does(argv: list[str], monkeypatch: pytest.MonkeyPatch) -> None:
    parsed = fast.parse(argv)
    assert parsed is not None, "the fast route should take this command line"
    code, called = _typer_params(argv, monkeypatch)
    assert code == 0 and called is not None
    assert (parsed[0], _plain(parsed[1])) == (called[0], _plain(called[1]))


@pytest.mark.parametrize("argv", LEFT, ids=" ".join)
def test_what_the_fast_route_does_not_judge_is_left_to_typer(argv: list[str]) -> None:
    assert fast.parse(argv) is None


# ---------------------------------------------------------------- whole processes, both routes
TYPER_ROUTE = (
    "import sys; from monarch_cli.cli import _app, _only_module; _app(_only_module(sys.argv[1:]))(prog_name='monarch')"
)
HELLO = "import os\nprint('hello from', os.environ['RANK'])\n"
FAILS = "import sys\nprint('about to fail')\nsys.exit(3)\n"
_VARYING = [
    (re.compile(r"(exec-)?\d{8}-\d{9}-[0-9a-f]{4}"), "RUN"),  # run ids
    (re.compile(r"\d+\.\d+ ?s\b"), "T"),  # durations
    (re.compile(r'"duration": ?[0-9.]+'), '"duration": T'),
    (re.compile(r"error-\d{8}-\d{6}-\d+\.txt"), "error-FILE.txt"),
]


@pytest.fixture(scope="module")
def work(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    from monarch_cli.jobs import serve

    work = tmp_path_factory.mktemp("fast")
    (work / "hello.py").write_text(HELLO)
    (work / "fails.py").write_text(FAILS)
    job = serve(["python", str(work / "hello.py")], hosts=1, state=work / ".monarch" / "job_state.pkl")
    yield work
    job.stop()


def _both(work: Path, argv: list[str], **env: str) -> tuple[tuple[int, str, str], tuple[int, str, str]]:
    """(status, stdout, stderr) of the fast route and of the Typer route, the varying parts masked."""
    environ = {**os.environ, "MONARCH_STATE": str(work / ".monarch" / "job_state.pkl"), **env}
    environ.pop("NO_COLOR", None)

    def run(cmd: list[str]) -> tuple[int, str, str]:
        done = subprocess.run(
            cmd, cwd=work, env=environ, capture_output=True, text=True, timeout=120, stdin=subprocess.DEVNULL
        )
        out, err = done.stdout, done.stderr
        for pattern, mask in _VARYING:
            out, err = pattern.sub(mask, out), pattern.sub(mask, err)
        return done.returncode, out, err

    return run([sys.executable, "-m", "monarch_cli", *argv]), run([sys.executable, "-c", TYPER_ROUTE, *argv])


#: (argv, exit status, a text it prints, also with colour forced)
CASES = [
    (["run-spmd"], 0, "hello from 0", True),
    (["run-spmd", "--json", "--", "python", "hello.py"], 0, '"exit_code":0', False),
    (["run-spmd", "--", "python", "fails.py"], 3, "about to fail", True),  # the failure table
    (["run-spmd", "--ranks", "7"], 2, "no such rank", True),
    (["run-spmd", "-e", "1X=2"], 2, "-e takes NAME or NAME=VALUE", False),
    (["run-spmd", "--json", "-e", "MONARCH_TEST_SURELY_UNSET"], 2, '"kind":"job"', False),
    (["run-spmd", "--state", "nowhere/job_state.pkl"], 2, "no reservation", False),
    (["exec", "--", "sh", "-c", "echo on $GROUP_RANK"], 0, "on 0", True),
    (["exec"], 2, "give the command after `--`", False),
    (["run-spmd", "--bogus"], 2, "No such option", False),  # Typer's own usage error, on both routes
]


@pytest.mark.slow
def test_both_routes_print_the_same_and_exit_the_same(work: Path) -> None:
    for argv, status, needle, in_colour in CASES:
        for env in ({}, {"FORCE_COLOR": "1"}) if in_colour else ({},):  # piped; as on a terminal (rich styles)
            fast_route, typer_route = _both(work, argv, **env)
            assert fast_route == typer_route, (argv, env)
            assert fast_route[0] == status and needle in fast_route[1] + fast_route[2], (argv, env, fast_route)
            assert ("\x1b[" in fast_route[2]) == bool(env), (argv, env, fast_route)


@pytest.mark.slow
def test_a_piped_run_loads_neither_typer_nor_rich(work: Path) -> None:
    code = (
        "import atexit, sys\n"
        "atexit.register(lambda: print('loaded:', sorted({'typer', 'rich', 'click'} & {m.split('.')[0] for m in sys.modules})))\n"
        "sys.argv = ['monarch', *sys.argv[1:]]\n"
        "from monarch_cli.cli import main\n"
        "main()\n"
    )
    environ = {**os.environ, "MONARCH_STATE": str(work / ".monarch" / "job_state.pkl")}
    for argv, status in ((["run-spmd"], 0), (["run-spmd", "--ranks", "9"], 2)):
        done = subprocess.run(
            [sys.executable, "-c", code, *argv], cwd=work, env=environ, capture_output=True, text=True, timeout=120
        )
        assert done.returncode == status, done.stderr
        assert "loaded: []" in done.stdout, done.stdout
