"""`monarch serve --scheduler slurm` on a real 2-node Slurm cluster: reserve, run, lose, re-serve, stop."""

from __future__ import annotations

import json
import re
import stat
import subprocess
import sys
from pathlib import Path

import psutil
import pytest

from monarch_cli.config import settings
from monarch_cli.jobs import serve
from monarch_cli.runtime.transport.keys import Keys

from ..conftest import one_line_error, write_script
from .conftest import ALLREDUCE, Served, clean_env, job_state, slurm, wait_for

pytestmark = [pytest.mark.slow, pytest.mark.slurm, pytest.mark.timeout(1800)]


def _agent_processes(job_dir: str, job_id: str):
    """Processes whose command line names this reservation's directory (srun, its children) or
    whose title names its Slurm job (agents, warm processes)."""
    found = []
    for p in psutil.process_iter(["pid", "cmdline"]):
        try:
            cmd = " ".join(p.info["cmdline"] or [])
            if job_dir in cmd or f" slurm-{job_id} " in cmd:
                found.append(p)
        except psutil.NoSuchProcess:
            pass
    return [p for p in found if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]


def _check_ranks(out: str, nodes: list) -> None:
    lines = sorted(l for l in out.splitlines() if " sum " in l)
    assert len(lines) == 4, out
    for rank, line in enumerate(lines):
        m = re.match(rf"\[rank{rank}\]\s+rank {rank}/4 node (\d) host (\S+) sum 10$", line)
        assert m, line
        assert m.group(2) == nodes[rank // 2] and int(m.group(1)) == rank // 2, line


def test_serve_run_twice_cancel_outside_serve_again_stop(slurm_cluster, tmp_path):
    script = write_script(tmp_path, "allreduce.py", ALLREDUCE)
    job = Served(tmp_path, tmp_path / ".monarch" / "job_state.pkl")
    try:
        served = job(
            "serve",
            "--scheduler",
            "slurm",
            "--nodes",
            "2",
            "--time",
            "30",
            "--",
            "torchrun",
            "--nproc-per-node=2",
            str(script),
        )
        assert served.returncode == 0, served.stderr
        info = job.status()
        assert info["alive"] and info["slurm"]["state"] == "RUNNING"
        assert [h["name"] for h in info["hosts"]] == slurm_cluster[:2]
        job_id, job_dir = info["slurm"]["job_id"], info["slurm"]["dir"]
        # Each agent on its own node, at its own address, on a port it chose.
        assert len({h["agent"].rsplit(":", 1)[0] for h in info["hosts"]}) == 2

        # The keys: a 0600 file, and on no process's command line.
        key_file = Path(job_dir) / "keys"
        assert stat.S_IMODE(key_file.stat().st_mode) == 0o600
        secret = Keys.read(key_file).secret.decode()
        assert any(" ".join(p.cmdline()).startswith("monarch agent ") for p in _agent_processes(job_dir, job_id))
        for p in _agent_processes(job_dir, job_id):
            assert secret not in " ".join(p.cmdline())

        for _ in range(2):
            run = job("run-spmd", "--no-color")
            assert run.returncode == 0, run.stdout + run.stderr
            _check_ranks(run.stdout, slurm_cluster)
            assert "4 rank(s) finished" in run.stderr
        logs = job("logs", "--rank", "3")  # the per-rank logs, as on the local scheduler
        assert logs.returncode == 0, logs.stderr
        assert logs.stdout.splitlines()[-1] == f"rank 3/4 node 1 host {slurm_cluster[1]} sum 10", logs.stdout

        # Debugging works the same on Slurm: ranks on both nodes pause, a client on the
        # login side lists them, casts to them, attaches to one on the second node.
        _debug_a_paused_run(tmp_path, job, slurm_cluster)

        # The allocation ends underneath: every command says so, clearly.
        slurm("scancel", job_id)
        wait_for(lambda: job_state(job_id) not in ("RUNNING", "COMPLETING"), 30, "the job to end")
        status = job("status")
        assert status.returncode == 1 and f"Slurm job {job_id} is CANCELLED" in status.stdout, status.stdout
        one_line_error(job("run-spmd"), f"Slurm job {job_id} is CANCELLED", "monarch serve")
        one_line_error(job("exec", "--", "true"), f"Slurm job {job_id} is CANCELLED")
        wait_for(lambda: not _agent_processes(job_dir, job_id), 30, "Slurm to end the agents")

        # serve makes a new one (the old one is gone: nothing to lose, no --replace needed).
        again = job("serve", "--scheduler", "slurm", "--nodes", "2")
        assert again.returncode == 0, again.stderr
        info2 = job.status()
        assert info2["alive"] and info2["slurm"]["job_id"] != job_id
        hosts = job("exec", "--no-color", "--", "hostname")
        assert hosts.returncode == 0 and sorted(l.split()[1] for l in hosts.stdout.splitlines()) == slurm_cluster[:2]

        stopped = job("stop")
        assert stopped.returncode == 0, stopped.stderr
        assert job_state(info2["slurm"]["job_id"]) in ("CANCELLED", "")
        assert not job.state.exists()
        assert not (Path(info2["slurm"]["dir"]) / "keys").exists()
        wait_for(
            lambda: not _agent_processes(info2["slurm"]["dir"], info2["slurm"]["job_id"]), 30, "every agent to exit"
        )
    finally:
        job("stop")  # whatever failed, leave no job behind


BREAK = """
    import os, socket
    rank = int(os.environ["RANK"])
    where = socket.gethostname()
    breakpoint()
    print(f"rank {rank} released on {where}", flush=True)
"""


def _debug_a_paused_run(tmp_path: Path, job: Served, nodes: list) -> None:
    import pexpect

    script = write_script(tmp_path, "pause.py", BREAK)
    run = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "monarch_cli",
            "run-spmd",
            "--no-color",
            "--state",
            str(job.state),
            "--",
            "torchrun",
            "--nproc-per-node=2",
            str(script),
        ],
        cwd=tmp_path,
        env=clean_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        last: list = []

        def paused() -> bool:
            listed = job("debug", "list", "--json")
            last[:] = [listed.stderr]
            rows = json.loads(listed.stdout or "[]")
            return len([r for r in rows if r["state"] == "paused"]) == 4

        try:
            wait_for(paused, 90, "4 ranks to pause in breakpoint()")
        except AssertionError:
            run.kill()
            raise AssertionError(f"ranks did not pause; debug list said {last!r}; run said:\n{run.communicate()[0]}")
        rows = json.loads(job("debug", "list", "--json").stdout)
        assert [r["host"] for r in rows] == [nodes[0], nodes[0], nodes[1], nodes[1]]
        cast = json.loads(job("debug", "cast", "*", "p where", "--json").stdout)
        assert {r: v["output"].strip() for r, v in cast.items()} == {str(r): repr(nodes[r // 2]) for r in range(4)}
        shell = pexpect.spawn(
            sys.executable,
            ["-m", "monarch_cli", "debug", "--state", str(job.state), "attach", "3"],
            cwd=str(tmp_path),
            env={**clean_env(), "TERM": "dumb", "NO_COLOR": "1", "MONARCH_DEBUG_HISTORY": str(tmp_path / "hist")},
            encoding="utf-8",
            timeout=60,
        )
        shell.expect_exact("(Pdb) ")
        shell.sendline("p rank, where")
        shell.expect_exact(f"(3, {nodes[1]!r})")
        shell.sendline("detach")
        shell.expect(pexpect.EOF)
        assert job("debug", "continue").returncode == 0
        out, _ = run.communicate(timeout=60)
        assert run.returncode == 0, out
        for r in range(4):
            assert f"[rank{r}] rank {r} released on {nodes[r // 2]}" in out
    finally:
        if run.poll() is None:
            run.kill()


def test_bad_partition_and_account_are_one_line_errors_quoting_sbatch(slurm_cluster, tmp_path):
    job = Served(tmp_path, tmp_path / "s.pkl")
    bad_partition = job("serve", "--scheduler", "slurm", "--nodes", "1", "--partition", "nope")
    one_line_error(bad_partition, "sbatch refused the job", "Invalid partition name specified")
    bad_account = job("serve", "--scheduler", "slurm", "--nodes", "1", "--account", "bogus")
    one_line_error(bad_account, "sbatch refused the job", "Invalid account")
    assert not (tmp_path / "s.pkl").exists()
    assert not list(tmp_path.glob("slurm/*/keys")), "a refused job left its keys behind"
    batch = Served(tmp_path, tmp_path / "b.pkl")("sbatch", "-p", "nope", "--", "python", "x.py")
    one_line_error(batch, "Invalid partition name specified")


def test_two_reservations_on_the_same_nodes_do_not_collide(slurm_cluster, tmp_path):
    a, b = Served(tmp_path, tmp_path / "a.pkl"), Served(tmp_path, tmp_path / "b.pkl")
    try:
        for job in (a, b):
            done = job("serve", "--scheduler", "slurm", "--nodes", "2")
            assert done.returncode == 0, done.stderr
        sa, sb = a.status(), b.status()
        assert [h["name"] for h in sa["hosts"]] == [h["name"] for h in sb["hosts"]] == slurm_cluster[:2]
        assert {h["agent"] for h in sa["hosts"]}.isdisjoint({h["agent"] for h in sb["hosts"]})
        procs = [
            subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "monarch_cli",
                    "exec",
                    "--no-color",
                    "--state",
                    str(j.state),
                    "--",
                    "echo $GROUP_RANK",
                ],
                cwd=tmp_path,
                env=clean_env(),
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
            )
            for j in (a, b)
        ]
        for p in procs:
            out, err = p.communicate(timeout=120)
            assert p.returncode == 0, err
            assert sorted(out.split()) == ["0", "1", f"[{slurm_cluster[0]}]", f"[{slurm_cluster[1]}]"]
    finally:
        for job in (a, b):
            job("stop")


def test_pending_job_reports_state_and_reason_then_agents(slurm_cluster, tmp_path, monkeypatch):
    monkeypatch.setattr(settings(), "host", settings().host)  # this process may pick a routable address
    events: list = []
    job = serve(None, "slurm", hosts=2, state=tmp_path / "p.pkl", progress=events.append, sbatch_args=["--begin=now+3"])
    try:
        assert any(re.search(r"Slurm job \d+ pending \(BeginTime\) for 0:0\d", e) for e in events), events
        assert any("agents up: 2/2" in e for e in events), events
        assert job.status()["alive"]
    finally:
        job.stop()


def test_serve_inside_an_allocation_starts_an_overlapping_step_and_stop_ends_only_it(slurm_cluster, tmp_path):
    script = write_script(tmp_path, "allreduce.py", ALLREDUCE)
    inner = write_script(
        tmp_path,
        "inside.sh",
        f"""
        set -u
        m() {{ c=$1; shift; {sys.executable} -m monarch_cli "$c" --state {tmp_path}/in.pkl "$@"; }}
        m serve --scheduler slurm -- torchrun --nproc-per-node=2 {script} || exit 11
        m status --json > {tmp_path}/status.json
        m run-spmd --no-color || exit 12
        m stop || exit 13
        squeue -h -s -j $SLURM_JOB_ID -o %j > {tmp_path}/steps-after-stop.txt
        squeue -h -j $SLURM_JOB_ID -o %T > {tmp_path}/job-after-stop.txt
    """,
    )
    done = subprocess.run(
        ["salloc", "-N", "2", "--time=10", "bash", str(inner)],
        cwd=tmp_path,
        env=clean_env(),
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    _check_ranks(done.stdout, slurm_cluster)
    status = json.loads((tmp_path / "status.json").read_text())
    assert status["slurm"]["mode"] == "allocation" and re.fullmatch(r"\d+\.\d+", status["slurm"]["step"])
    assert len(status["hosts"]) == 2  # all of the allocation's nodes by default
    assert "monarch-agents" not in (tmp_path / "steps-after-stop.txt").read_text()
    assert (tmp_path / "job-after-stop.txt").read_text().strip() == "RUNNING"  # only our step ended


def test_allocation_options_that_cannot_apply_are_refused(slurm_cluster, tmp_path):
    done = subprocess.run(
        [
            "salloc",
            "-N",
            "1",
            "--time=5",
            sys.executable,
            "-m",
            "monarch_cli",
            "serve",
            "--scheduler",
            "slurm",
            "--partition",
            "debug",
            "--nodes",
            "2",
            "--state",
            str(tmp_path / "x.pkl"),
        ],
        cwd=tmp_path,
        env=clean_env(),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode != 0 and "Traceback" not in done.stderr
    assert "cannot apply" in done.stderr and "--partition" in done.stderr


def _node_state(node: str) -> str:
    return slurm("sinfo", "-h", "-N", "-n", node, "-o", "%T", check=False).strip()


def test_node_failure_and_time_limit_end_reservations_clearly(slurm_cluster, tmp_path):
    """Two reservations, one node each: one loses its node, the other reaches its time limit
    (Slurm's smallest, one minute) while a run is going on it."""
    limited, failing = Served(tmp_path, tmp_path / "limited.pkl"), Served(tmp_path, tmp_path / "failing.pkl")
    sleeper = write_script(
        tmp_path,
        "sleeper.py",
        """
        import time
        print("started", flush=True)
        time.sleep(600)
    """,
    )
    failed_node = None
    try:
        # --exclusive: one node each, so that one node's failure ends only one of them.
        done = limited("serve", "--scheduler", "slurm", "--nodes", "1", "--time", "1", "--exclusive")
        assert done.returncode == 0, done.stderr
        done = failing("serve", "--scheduler", "slurm", "--nodes", "1", "--exclusive")
        assert done.returncode == 0, done.stderr
        limited_id, failing_id = limited.status()["slurm"]["job_id"], failing.status()["slurm"]["job_id"]
        failed_node = failing.status()["hosts"][0]["name"]
        run = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "monarch_cli",
                "run-spmd",
                "--json",
                "--state",
                str(limited.state),
                "--",
                "torchrun",
                "--nproc-per-node=2",
                str(sleeper),
            ],
            cwd=tmp_path,
            env=clean_env(),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )

        # Node failure: Slurm ends the job as NODE_FAIL (serve's jobs are --no-requeue, so it
        # does not come back later with agents nobody knows about).
        slurm("scontrol", "update", f"nodename={failed_node}", "state=down", "reason=monarch-test")
        wait_for(lambda: job_state(failing_id) == "NODE_FAIL", 30, "the job to fail with its node")
        status = failing("status")
        assert status.returncode == 1 and f"Slurm job {failing_id} is NODE_FAIL (a node failed" in status.stdout
        one_line_error(
            failing("run-spmd", "--", "python", str(sleeper)), f"Slurm job {failing_id} is NODE_FAIL (a node failed"
        )
        wait_for(lambda: _node_state(failed_node) == "idle", 60, f"{failed_node} to come back")
        failed_node = None

        # Time limit: the run going on is ended with the allocation and says why; then every
        # command names the time limit.
        # Slurm signals the ranks, then kills the agents: the client sees the one or the other
        # first (SIGTERM, 143, or a lost host, 255); either way each rank says why.
        out, err = run.communicate(timeout=240)
        assert run.returncode in (143, 255), err
        ranks = json.loads(out)["ranks"]
        assert all("started" in r["last_lines"] for r in ranks), ranks
        for r in ranks:
            assert r["how"].startswith(f"lost: host {r['host']} stopped answering") or r["how"].startswith(
                "killed by SIGTERM"
            ), r
            assert r["how"].endswith(f"Slurm job {limited_id} is TIMEOUT (its time limit was reached)"), r
        wait_for(lambda: job_state(limited_id) == "TIMEOUT", 60, "the job to reach its time limit")
        status = limited("status")
        assert (
            status.returncode == 1
            and f"Slurm job {limited_id} is TIMEOUT (its time limit was reached)" in status.stdout
        )
        one_line_error(limited("exec", "--", "true"), f"Slurm job {limited_id} is TIMEOUT (its time limit was reached)")
    finally:
        if failed_node is not None:
            slurm("scontrol", "update", f"nodename={failed_node}", "state=resume", check=False)
        for job in (limited, failing):
            job("stop")


def test_serve_reserves_exactly_the_plan_a_dry_run_printed(slurm_cluster, tmp_path):
    job = Served(tmp_path, tmp_path / ".monarch" / "job_state.pkl")
    write_script(tmp_path, "planned.py", "print('planned')\n")
    printed = job(
        "serve",
        "--scheduler",
        "slurm",
        "--nodes",
        "2",
        "-o",
        "time=30",
        "--dry-run",
        "--json",
        "--",
        "python",
        "planned.py",
    )
    assert printed.returncode == 0, printed.stderr
    plan = json.loads(printed.stdout)
    assert plan["scheduler"] == "slurm" and plan["options"] == {"time": "30"} and "keys" not in plan["data"]
    (tmp_path / "plan.json").write_text(printed.stdout)
    try:
        served = job("serve", "--plan", str(tmp_path / "plan.json"))
        assert served.returncode == 0, served.stderr
        info = job.status()
        assert info["alive"] and info["reservation_id"] == plan["reservation_id"]
        assert info["slurm"]["dir"] == plan["data"]["job_dir"]
        # the script Slurm ran is, byte for byte, the one the dry run printed
        assert (Path(plan["data"]["job_dir"]) / "serve.sbatch").read_text() == plan["artifacts"]["sbatch script"]
        run = job("run-spmd", "--no-color")
        assert run.returncode == 0 and "[rank0] planned" in run.stdout, run.stdout + run.stderr
    finally:
        stopped = job("stop")
    assert stopped.returncode == 0, stopped.stderr
