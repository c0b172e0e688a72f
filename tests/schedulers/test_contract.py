"""The scheduler contract as a backend author and a user meet it: a third-party backend
registered through an entry point, its options as flags, plans, ports, liveness, errors."""

from __future__ import annotations

import io
import json
import os
import random
import subprocess
import sys
import textwrap
from pathlib import Path

import psutil
import pytest

from monarch_cli.jobs import serve
from monarch_cli.runtime.launch.command import AgentCommand
from monarch_cli.schedulers import Liveness, get_scheduler

from ..conftest import REPO, one_line_error, write_script

BACKEND = '''
from monarch_cli.schedulers import Option
from monarch_cli.schedulers.local import LocalScheduler


class FlavouredScheduler(LocalScheduler):
    """Local agents, with one option of its own: a backend in another package."""

    name = "flavoured"
    options = (Option("flavour", str, None, "Which flavour of host.", short="-f"),
               Option("copies", int, None, "How many copies."))
    stop_options = (Option("linger", int, None, "Seconds to linger before stopping."),)

    def release_with(self, reservation, options):
        import json, os
        with open(os.environ["FLAVOUR_STOP_LOG"], "a") as f:
            f.write(json.dumps(options) + "\\n")
        self.release(reservation)

    def check_options(self, options):
        return {k: v for k, v in options.items() if v is not None}

    def plan(self, request, workdir):
        plan = super().plan(request, workdir)
        plan.options = dict(request.options)
        plan.scheduler = self.name
        return plan


class BrokenScheduler(LocalScheduler):
    name = "broken"

    def plan(self, request, workdir):
        return {}["a bug in the backend"]
'''


@pytest.fixture()
def third_party(tmp_path: Path) -> Path:
    """A package that registers two backends through the ``monarch_cli.schedulers`` entry-point group."""
    site = tmp_path / "site"
    site.mkdir()
    (site / "flavoured_backend.py").write_text(BACKEND)
    info = site / "flavoured_backend-0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: flavoured-backend\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text(
        textwrap.dedent("""\
        [monarch_cli.schedulers]
        flavoured = flavoured_backend:FlavouredScheduler
        broken = flavoured_backend:BrokenScheduler
    """)
    )
    return site


def monarch(*args: str, cwd: Path, site: Path, timeout: float = 60) -> subprocess.CompletedProcess:
    env = {
        **os.environ,
        "PYTHONPATH": f"{REPO}{os.pathsep}{site}",
        "MONARCH_STATE": str(cwd / ".monarch" / "s.pkl"),
        "TMPDIR": str(cwd),
    }
    return subprocess.run(
        [sys.executable, "-m", "monarch_cli", *args],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
        stdin=subprocess.DEVNULL,
    )


def test_a_backend_from_another_package_gets_its_options_as_flags(tmp_path: Path, third_party: Path) -> None:
    helped = monarch("serve", "--scheduler", "flavoured", "--help", cwd=tmp_path, site=third_party)
    assert helped.returncode == 0 and "--flavour" in helped.stdout and "Which flavour of host." in helped.stdout
    assert "--partition" not in helped.stdout  # only the named backend's options
    every = monarch("serve", "--help", cwd=tmp_path, site=third_party)
    assert "--flavour" in every.stdout and "--partition" in every.stdout  # no backend named: all of them

    flags = monarch(
        "serve",
        "-s",
        "flavoured",
        "--dry-run",
        "--json",
        "-f",
        "mint",
        "--copies",
        "3",
        "--",
        "python",
        "t.py",
        cwd=tmp_path,
        site=third_party,
    )
    assert flags.returncode == 0, flags.stderr
    assert json.loads(flags.stdout)["options"] == {"flavour": "mint", "copies": 3}
    pairs = monarch(
        "serve",
        "-s",
        "flavoured",
        "--dry-run",
        "--json",
        "-o",
        "flavour=lemon",
        "-o",
        "copies=2",
        cwd=tmp_path,
        site=third_party,
    )
    assert json.loads(pairs.stdout)["options"] == {"flavour": "lemon", "copies": 2}
    one_line_error(
        monarch("serve", "-s", "flavoured", "--dry-run", "-o", "copies=many", cwd=tmp_path, site=third_party),
        "copies= takes a whole number",
    )
    one_line_error(
        monarch("serve", "-s", "flavoured", "--dry-run", "-o", "colour=red", cwd=tmp_path, site=third_party),
        "has no option 'colour'",
        "flavour, copies",
    )
    one_line_error(
        monarch("serve", "-s", "nope", "--dry-run", cwd=tmp_path, site=third_party),
        "unknown scheduler 'nope'",
        "flavoured",
    )


def test_a_backend_from_another_package_gets_its_stop_options_as_flags(
    tmp_path: Path, third_party: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    log = tmp_path / "stops.jsonl"
    monkeypatch.setenv("FLAVOUR_STOP_LOG", str(log))
    helped = monarch("stop", "--help", cwd=tmp_path, site=third_party)
    assert helped.returncode == 0 and "--linger" in helped.stdout and "--keep-cluster" in helped.stdout
    for stop in (["--linger", "5"], ["-o", "linger=7"]):
        served = monarch("serve", "-s", "flavoured", cwd=tmp_path, site=third_party)
        assert served.returncode == 0, served.stderr
        # Another backend's stop option, or a bad value: one line, and the reservation is still there.
        one_line_error(
            monarch("stop", "--keep-cluster", cwd=tmp_path, site=third_party),
            "unknown flavoured stop option(s): keep_cluster",
            "known: linger",
        )
        one_line_error(
            monarch("stop", "-o", "linger=soon", cwd=tmp_path, site=third_party), "linger= takes a whole number"
        )
        assert not log.exists() and monarch("status", cwd=tmp_path, site=third_party).returncode == 0
        stopped = monarch("stop", *stop, cwd=tmp_path, site=third_party)
        assert stopped.returncode == 0, stopped.stderr
        assert json.loads(log.read_text().splitlines()[-1]) == {"linger": int(stop[-1][-1])}
        log.unlink()


def test_a_bug_is_an_internal_error_with_its_traceback_kept(tmp_path: Path, third_party: Path) -> None:
    done = monarch("serve", "-s", "broken", "--dry-run", cwd=tmp_path, site=third_party)
    line = one_line_error(done, "internal error: KeyError", "a bug in monarch-cli", "--debug")
    assert done.returncode == 70
    saved = Path(line.split("traceback in ")[1].split(";")[0])
    assert "Traceback" in saved.read_text() and "a bug in the backend" in saved.read_text()
    assert oct(saved.stat().st_mode & 0o777) == "0o600"

    debug = monarch("--debug", "serve", "-s", "broken", "--dry-run", cwd=tmp_path, site=third_party)
    assert debug.returncode == 70 and "Traceback" in debug.stderr and "flavoured_backend.py" in debug.stderr

    as_json = monarch("serve", "-s", "broken", "--dry-run", "--json", cwd=tmp_path, site=third_party)
    error = json.loads(as_json.stdout)
    assert as_json.returncode == 70 and error["kind"] == "internal" and "KeyError" in error["error"]


def test_user_errors_with_json_are_json(tmp_path: Path, third_party: Path) -> None:
    done = monarch("run-spmd", "--json", cwd=tmp_path, site=third_party)
    error = json.loads(done.stdout)
    assert done.returncode == 2 and error["kind"] == "job" and "no reservation" in error["error"]
    bad = monarch(
        "serve", "--dry-run", "--json", "--", "torchrun", "--bogus-flag", "t.py", cwd=tmp_path, site=third_party
    )
    assert bad.returncode == 2 and "--bogus-flag" in json.loads(bad.stdout)["error"]


def test_agent_command_round_trips_and_matches_the_agents_parser() -> None:
    from monarch_cli.runtime.launch.command import parser

    cmd = AgentCommand(
        name="n0",
        host="10.0.0.1",
        port=4000,
        port_range=(5000, 5100),
        preload="torch",
        warm_up=True,
        keys_stdin=True,
        address_file="/tmp/a.addr",
    )
    assert AgentCommand.from_json(json.loads(json.dumps(cmd.to_json()))) == cmd
    args = parser().parse_args(cmd.argv()[3:])
    assert (args.name, args.host, args.port, args.port_range, args.preload, args.warm_up, args.keys_stdin) == (
        "n0",
        "10.0.0.1",
        4000,
        (5000, 5100),
        "torch",
        True,
        True,
    )
    with pytest.raises(SystemExit):
        parser().parse_args(["--port-range", "9-2"])


def _listening(pid: int) -> list[int]:
    ports = []
    for proc in [psutil.Process(pid), *psutil.Process(pid).children(recursive=True)]:
        try:
            ports += [c.laddr.port for c in proc.net_connections("tcp") if c.status == psutil.CONN_LISTEN]
        except psutil.NoSuchProcess:
            pass
    return ports


PORTS = """
import os
print("master_port", os.environ["MASTER_PORT"])
"""


@pytest.mark.slow
def test_agents_listen_on_a_fixed_port_and_keep_their_ports_in_a_range(tmp_path: Path) -> None:
    base = random.randrange(30000, 60000, 100)
    state = tmp_path / ".monarch" / "job_state.pkl"
    job = serve(None, hosts=2, state=state, agent_port=base, port_range=(base + 10, base + 40))
    try:
        assert [h.agent.rsplit(":", 1)[1] for h in job.state.hosts] == [str(base), str(base + 1)]
        assert get_scheduler("local").probe(job.state).liveness is Liveness.ALIVE
        script = write_script(tmp_path, "ports.py", PORTS)
        out = io.BytesIO()
        result = job.run_spmd(["python", str(script)], stdout=out, stderr=io.BytesIO())
        assert result.exit_code == 0
        master = int(out.getvalue().split(b"master_port ")[1].split()[0])
        assert base + 10 <= master <= base + 40  # the rendezvous port the agent reserved
        for host in job.state.hosts:
            own = [
                c.laddr.port for c in psutil.Process(host.pid).net_connections("tcp") if c.status == psutil.CONN_LISTEN
            ]
            assert own == [int(host.agent.rsplit(":", 1)[1])], own  # one port per host, heartbeats included
            others = [p for p in _listening(host.pid) if p not in (base, base + 1)]
            assert all(base + 10 <= p <= base + 40 for p in others), others
    finally:
        job.stop()
    assert get_scheduler("local").probe(job.state).liveness is Liveness.GONE
