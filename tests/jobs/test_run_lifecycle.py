"""How a run is ended from outside, seen as a user sees it: SIGTERM to `monarch run-spmd` (a
scheduler's time limit), `monarch stop` from another terminal, Ctrl-C pressed twice, a rank
that hangs after the others finished, and a KeyboardInterrupt inside a rank.

Everything is real: the CLI runs as a subprocess, signals are sent to it as a terminal or a
scheduler would, ranks are real processes on a 2-host local reservation.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest

from monarch_cli.jobs import Job, serve

from ..conftest import wait_until, write_script
from .conftest import ConsoleReader, living, spmd
from .test_run_failures import rank_processes


class Cli(ConsoleReader):
    """``monarch run-spmd ...`` in its own process, its console read line by line (with
    ``--json``: stderr, the ranks' output and notices; stdout is kept whole for the JSON)."""

    what = "monarch run-spmd"

    def __init__(self, state: Path, *args: str, cwd: Path) -> None:
        as_json = "--json" in args
        proc = subprocess.Popen(
            [sys.executable, "-m", "monarch_cli", "run-spmd", "--state", str(state), *args],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE if as_json else subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            cwd=cwd,
            env={**os.environ, "COLUMNS": "200"},
        )
        super().__init__(proc, proc.stderr if as_json else proc.stdout)
        self.stdout = b""
        self._out = threading.Thread(target=self._read_out, daemon=True)
        if as_json:
            self._out.start()

    def _read_out(self) -> None:
        assert self.proc.stdout is not None
        self.stdout = self.proc.stdout.read()

    def _finished(self) -> None:
        if self._out.is_alive():
            self._out.join(5)

    def text(self) -> str:
        return "\n".join(self.seen)


def torchrun(script: Path, *flags: str) -> list[str]:
    return ["--", "torchrun", "--nproc-per-node=2", *flags, str(script)]


@pytest.fixture(autouse=True)
def nothing_left(job: Job) -> Iterator[None]:
    """After every test, no rank of it is left under the shared reservation's agents."""
    yield
    assert wait_until(lambda: not rank_processes(job), 8), rank_processes(job)


# ------------------------------------------------------------------------ SIGTERM
@pytest.mark.slow
def test_sigterm_to_run_spmd_reaches_the_ranks_and_is_summarised(job: Job, tmp_path: Path) -> None:
    """A scheduler's time limit: ranks get SIGTERM (they can checkpoint), one that ignores it
    gets SIGKILL after torchrun's --shutdown-timeout, and monarch says what happened, 143."""
    marks = tmp_path / "marks"
    marks.mkdir()
    script = write_script(
        tmp_path,
        "checkpoint.py",
        f"""
        import os, signal, sys, time
        rank = os.environ["RANK"]
        def on_term(sig, frame):
            open(os.path.join({str(marks)!r}, rank), "w").write(signal.Signals(sig).name)
            print("checkpointed", flush=True)
            if rank != "1":  # rank 1 keeps going: it must be killed after the timeout
                sys.exit(0)
        signal.signal(signal.SIGTERM, on_term)
        print("ready", flush=True)
        while True:
            time.sleep(0.05)
    """,
    )
    with Cli(job.path, *torchrun(script, "--shutdown-timeout=2"), cwd=tmp_path) as cli:
        cli.wait_for("ready", 4)
        sent = time.monotonic()
        cli.proc.send_signal(signal.SIGTERM)
        code = cli.finish(timeout=15)
        took = time.monotonic() - sent
    assert code == 143, cli.text()
    assert sorted(p.name for p in marks.iterdir()) == ["0", "1", "2", "3"], "a rank never saw SIGTERM"
    assert {p.read_text() for p in marks.iterdir()} == {"SIGTERM"}
    assert "monarch: received SIGTERM; forwarded it to the ranks; ranks still running in 2 s get SIGKILL" in cli.text()
    assert (
        "received SIGTERM; forwarded to ranks; rank 1 still running after the 2 s grace got SIGKILL; "
        "exit status 143" in cli.text()
    )
    assert any("│ 1 " in line and "killed by SIGKILL" in line for line in cli.seen), cli.text()
    assert sum("exit 0" in line and "│" in line for line in cli.seen) == 3, cli.text()
    assert 1.5 < took < 8, f"SIGKILL came {took:.1f} s after SIGTERM; the timeout was 2 s"


@pytest.mark.slow
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGHUP], ids=["SIGTERM", "SIGHUP"])
def test_ranks_ended_by_the_forwarded_signal_end_the_run_at_once_with_a_json_summary(
    job: Job, tmp_path: Path, sig: signal.Signals
) -> None:
    """kill, or a closed terminal (SIGHUP): forwarded as torchrun does; status 128+N."""
    script = write_script(
        tmp_path,
        "plain.py",
        """
        import time
        print("ready", flush=True)
        time.sleep(60)
    """,
    )
    with Cli(job.path, "--json", *torchrun(script), cwd=tmp_path) as cli:
        cli.wait_for("ready", 4)
        sent = time.monotonic()
        cli.proc.send_signal(sig)
        assert cli.finish(timeout=10) == 128 + sig, cli.text()
        assert time.monotonic() - sent < 5  # not the 30 s default timeout: ranks ended at once
    result = json.loads(cli.stdout)
    assert result["exit_code"] == 128 + sig and result["received_signal"] == sig.name
    assert result["ending"].startswith(f"received {sig.name}; forwarded to ranks; ranks exited within ")
    assert [r["how"] for r in result["ranks"]] == [f"killed by {sig.name}"] * 4


# -------------------------------------------------------------------- monarch stop
@pytest.mark.slow
def test_monarch_stop_during_a_run_ends_it_saying_so(tmp_path: Path) -> None:
    state = tmp_path / ".monarch" / "job_state.pkl"
    own = serve(None, hosts=2, state=state)  # its own: this test stops it
    pids = tmp_path / "pids"
    pids.mkdir()
    script = write_script(
        tmp_path,
        "long.py",
        f"""
        import os, time
        open(os.path.join({str(pids)!r}, str(os.getpid())), "w").close()
        print("ready", flush=True)
        time.sleep(60)
    """,
    )
    try:
        with Cli(state, "--json", *torchrun(script), cwd=tmp_path) as cli:
            cli.wait_for("ready", 4)
            stop = subprocess.Popen(
                [sys.executable, "-m", "monarch_cli", "stop", "--state", str(state), "--json"],
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
                cwd=tmp_path,
            )
            stopped, _ = stop.communicate(timeout=30)
            assert stop.returncode == 0
            code = cli.finish(timeout=10)
    finally:
        if state.exists():
            own.stop()
    result = json.loads(cli.stdout)
    assert code == 254 and result["exit_code"] == 254, cli.text()
    assert result["stopped_by"].startswith(f"monarch stop (pid {stop.pid}, from ")
    assert result["ending"] == f"reservation stopped by {result['stopped_by']}"
    assert [r["how"] for r in result["ranks"]] == ["reservation stopped"] * 4
    assert "lost" not in json.dumps(result["ranks"])
    assert json.loads(stopped) == {"stopped": own.state.reservation_id, "runs_ended": [result["run_id"]]}
    ranks = [int(p.name) for p in pids.iterdir()]
    assert len(ranks) == 4 and wait_until(lambda: not living(ranks), 10), living(ranks)


# ------------------------------------------------------------------------- Ctrl-C
@pytest.mark.slow
def test_ctrl_c_twice_says_what_it_does_and_ends_the_run_even_when_a_host_never_reports(
    job: Job, tmp_path: Path
) -> None:
    """Ranks ignore SIGINT; host local1's fork server is frozen, so its ranks' exits never come."""
    parents = tmp_path / "parents"
    parents.mkdir()
    script = write_script(
        tmp_path,
        "deaf.py",
        f"""
        import os, signal, time
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        open(os.path.join({str(parents)!r}, os.environ["RANK"]), "w").write(str(os.getppid()))
        print("ready", flush=True)
        time.sleep(60)
    """,
    )
    frozen: psutil.Process | None = None
    try:
        with Cli(job.path, *torchrun(script), cwd=tmp_path) as cli:
            cli.wait_for("ready", 4)
            frozen = psutil.Process(int((parents / "2").read_text()))  # what reports local1's exits
            assert int((parents / "3").read_text()) == frozen.pid
            frozen.suspend()
            cli.proc.send_signal(signal.SIGINT)
            cli.wait_for("monarch: stopping ranks (SIGINT sent), press Ctrl-C again to kill", timeout=5)
            time.sleep(1.0)
            assert cli.proc.poll() is None, "the ranks ignore SIGINT: one Ctrl-C must not end the run"
            sent = time.monotonic()
            cli.proc.send_signal(signal.SIGINT)
            cli.wait_for(
                "monarch: killing ranks (SIGKILL sent), press Ctrl-C again to stop waiting for them", timeout=5
            )
            code = cli.finish(timeout=15)
            took = time.monotonic() - sent
    finally:
        if frozen is not None:
            frozen.resume()
    assert code == 137, cli.text()
    assert took < 9, f"the run took {took:.1f} s to end after the second Ctrl-C"
    assert "interrupted by Ctrl-C x2 (ranks killed); exit status 137" in cli.text()
    table = [line for line in cli.seen if line.startswith("│ ")]
    assert sum("killed by SIGKILL" in line for line in table) == 2, cli.text()
    assert sum("lost: no exit reported 5 s after SIGKILL" in line for line in table) == 2, cli.text()


# ----------------------------------------------------------------------- stragglers
def test_ranks_still_running_after_the_first_exit_are_named_once(job: Job, tmp_path: Path) -> None:
    script = write_script(
        tmp_path,
        "straggle.py",
        """
        import os, time
        rank = int(os.environ["RANK"])
        time.sleep({0: 0, 1: 0.3, 2: 3, 3: 3}[rank])
    """,
    )
    notices: list[str] = []
    result = job.run_spmd(
        ["torchrun", "--nproc-per-node=2", str(script)],
        straggler_grace=1.0,
        on_event=notices.append,
        stdout=open(os.devnull, "wb"),
        stderr=open(os.devnull, "wb"),
    )
    assert result.exit_code == 0
    assert notices == ["ranks 2,3 on local1 still running 1 s after rank 0 exited"]
    assert result.stragglers == [2, 3] and result.to_json()["stragglers"] == [2, 3]


# ------------------------------------------------------------------ KeyboardInterrupt
@pytest.mark.parametrize("cold", [False, True], ids=["warm", "cold"])
def test_keyboard_interrupt_in_a_rank_is_reported_as_sigint(job: Job, tmp_path: Path, cold: bool) -> None:
    script = write_script(
        tmp_path,
        "kbd.py",
        """
        import os
        if os.environ["RANK"] == "1":
            raise KeyboardInterrupt
    """,
    )
    run = spmd(job, script, cold=cold)
    failure = run.result.first_failure
    assert failure is not None and failure.rank == 1
    assert (failure.signal, failure.exitcode) == (signal.SIGINT, None)
    assert (failure.how, failure.status) == ("killed by SIGINT", 130)
    assert run.result.exit_code == 130
    assert run.log(1).decode().rstrip().endswith("KeyboardInterrupt")
