"""`monarch dashboard` and `monarch serve --otlp` as a user runs them: real processes, real exit codes."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from tests.conftest import REPO, one_line_error
from tests.test_cli import monarch

from .conftest import wait_for


def test_without_a_reservation_or_a_store_it_says_so(tmp_path: Path) -> None:
    done = monarch("dashboard", cwd=tmp_path)
    assert done.returncode == 2
    one_line_error(done, "run `monarch serve` first")


def test_a_bad_otlp_endpoint_is_refused_before_reserving(tmp_path: Path) -> None:
    done = monarch("serve", "--otlp", "localhost:4318", cwd=tmp_path)
    assert done.returncode == 2
    one_line_error(done, "OTLP/HTTP base URL")
    assert not (tmp_path / ".monarch" / "job_state.pkl").exists()


@pytest.mark.slow
def test_serve_otlp_then_dashboard_prints_its_url_once_and_refuses_requests_without_it(tmp_path: Path) -> None:
    served = monarch("serve", "-n", "2", "--otlp", "http://127.0.0.1:9/", cwd=tmp_path)
    try:
        assert served.returncode == 0, served.stderr
        conf = tmp_path / ".monarch" / "otlp.json"
        assert json.loads(conf.read_text()) == {"endpoint": "http://127.0.0.1:9"}
        assert conf.stat().st_mode & 0o077 == 0
        (tmp_path / "hello.py").write_text("print('hello')\n")
        run = monarch("run-spmd", "--", "torchrun", "--nproc-per-node=1", "hello.py", cwd=tmp_path)
        assert run.returncode == 0 and "[rank1] hello" in run.stdout
        assert "OpenTelemetry export failed" in run.stderr and "run is unaffected" in run.stderr  # said once
        assert run.stderr.count("OpenTelemetry") == 1 and "Traceback" not in run.stderr

        env = {k: v for k, v in os.environ.items() if k != "MONARCH_STATE"}
        proc = subprocess.Popen(
            [sys.executable, "-m", "monarch_cli", "dashboard", "--json"],
            cwd=tmp_path,
            env={**env, "PYTHONPATH": str(REPO)},
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        try:
            info = json.loads(proc.stdout.readline())
            url, token = info["url"], info["url"].split("token=")[1]
            base = url.split("?")[0]
            assert base.startswith("http://127.0.0.1:") and len(token) >= 24
            with pytest.raises(urllib.error.HTTPError) as e:
                urllib.request.urlopen(base + "api/runs", timeout=10)
            assert e.value.code == 403
            for answer in (e.value.headers, urllib.request.urlopen(f"{base}?token={token}", timeout=10).headers):
                # no other site frames the page, and its token never leaves in a Referer
                assert "frame-ancestors 'none'" in answer["Content-Security-Policy"]
                assert "script-src 'self'" in answer["Content-Security-Policy"]
                assert answer["Referrer-Policy"] == "no-referrer" and answer["X-Frame-Options"] == "DENY"
            with urllib.request.urlopen(f"{base}api/runs?token={token}", timeout=10) as r:
                runs = json.loads(r.read())
            assert [r["exit_code"] for r in runs] == [0] and "hello.py" in runs[0]["command"]

            # between runs: the history, the last run's verdict, both hosts, the top rows, from the store
            def get(path: str) -> dict:
                with urllib.request.urlopen(f"{base}{path}?token={token}", timeout=60) as r:
                    return json.loads(r.read())

            assert get("api/diagnose")["verdict"] == "healthy"
            assert [h["alive"] for h in get("api/hosts")["hosts"]] == [True, True]
            top = get("api/top")
            assert top["run_id"] == runs[0]["run_id"] and sorted(r["rank"] for r in top["ranks"]) == [0, 1]
            assert get("api/runs/latest/logs")["lines"][0]["line"] == "hello"
            with urllib.request.urlopen(info["openapi"], timeout=10) as r:
                schema = json.loads(r.read())
            assert {"/api/hosts", "/api/runs", "/api/runs/{run_id}/logs", "/api/events", "/api/diagnose"} <= set(
                schema["paths"]
            )
            # each answer's shape is in the schema, for scripts and agents
            line = schema["components"]["schemas"]["LogLine"]["properties"]
            assert set(line) == {"id", "rank", "ts", "stream", "line"}
            assert {"Run", "RunDetail", "Hosts", "Series", "Stacks", "Diagnosis"} <= set(
                schema["components"]["schemas"]
            )
        finally:
            proc.send_signal(signal.SIGINT)
            out, err = proc.communicate(timeout=30)
        assert proc.returncode == 0, err
        assert token not in out + err  # printed once, on the first line only
    finally:
        monarch("stop", cwd=tmp_path)


def test_a_port_in_use_is_one_line(tmp_path: Path) -> None:
    import socket

    from monarch_cli.telemetry import _connect_rw, db_path

    _connect_rw(db_path(tmp_path / ".monarch")).close()  # a store with history, no reservation
    held = socket.socket()
    held.bind(("127.0.0.1", 0))
    held.listen(1)
    try:
        done = monarch("dashboard", "--port", str(held.getsockname()[1]), cwd=tmp_path)
    finally:
        held.close()
    assert done.returncode == 2
    one_line_error(done, "cannot listen on 127.0.0.1:")


#: A browser for $BROWSER: it only records the command line it was started with.
RECORDER = """import json, sys
with open({out!r} + ".tmp", "w") as f:
    json.dump(sys.argv, f)
import os
os.replace({out!r} + ".tmp", {out!r})
"""


def _argv_of_every_process() -> str:
    """The command lines of every process on the machine (what `ps` shows every user)."""
    found = []
    for proc in Path("/proc").iterdir():
        try:
            found.append((proc / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace"))
        except OSError:  # (gone, or not a process)
            continue
    return "\n".join(found)


def test_open_keeps_the_token_off_the_browsers_command_line(tmp_path: Path, browser) -> None:  # type: ignore[no-untyped-def]
    """--open goes through Python's webbrowser, which runs $BROWSER with a URL: that URL holds no token
    (every local user sees it in `ps`), yet opening it, in a real chromium, lands on the dashboard."""
    from monarch_cli.telemetry import _connect_rw, db_path

    _connect_rw(db_path(tmp_path / ".monarch")).close()
    argv_file, runtime = tmp_path / "argv.json", tmp_path / "run"
    runtime.mkdir(mode=0o700)
    (tmp_path / "browser.py").write_text(RECORDER.format(out=str(argv_file)))
    env = {k: v for k, v in os.environ.items() if k != "MONARCH_STATE"}
    env.update(
        PYTHONPATH=str(REPO), BROWSER=f"{sys.executable} {tmp_path / 'browser.py'} %s", XDG_RUNTIME_DIR=str(runtime)
    )
    proc = subprocess.Popen(
        [sys.executable, "-m", "monarch_cli", "dashboard", "--open"],
        cwd=tmp_path,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        printed = proc.stdout.readline()
        token = printed.split("token=")[1].split()[0]
        base = printed.split("?token=")[0].split()[-1]
        wait_for("the browser to be started", argv_file.exists)
        argv = json.loads(argv_file.read_text())
        assert token not in " ".join(argv) and token not in _argv_of_every_process()
        url = argv[-1]
        assert url.startswith("file://"), argv
        page = Path(urllib.request.url2pathname(url[len("file://") :]))
        assert page.is_relative_to(runtime) and page.stat().st_uid == os.getuid()
        assert page.stat().st_mode & 0o077 == 0 and page.parent.stat().st_mode & 0o077 == 0
        # the page logs in: chromium follows it to the dashboard, whose API then answers the page
        browser.get(url)
        wait_for("the dashboard", lambda: browser.current_url.startswith(base) and token in browser.current_url)
        wait_for(
            "the runs page",
            lambda: browser.execute_script("return document.getElementById('main').dataset.ready === '1'"),
        )
        assert "forbidden" not in browser.page_source
    finally:
        proc.send_signal(signal.SIGINT)
        proc.communicate(timeout=30)
    assert proc.returncode == 0
    assert not page.exists()  # the page (it holds the token) goes with the server


@pytest.mark.slow
def test_an_otlp_endpoint_with_credentials_stays_off_command_lines_files_and_messages(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A collector URL with a token is refused on serve's command line (ps shows it to everyone),
    taken from $MONARCH_OTLP_ENDPOINT with --otlp env instead, kept 0600 even over an older 0644
    file, and masked where it is printed."""
    secret = "s3cret-token"
    url = f"http://alice:{secret}@127.0.0.1:9/?token={secret}"
    refused = monarch("serve", "-n", "1", "--otlp", url, cwd=tmp_path)
    assert refused.returncode == 2 and secret not in refused.stdout + refused.stderr, refused.stderr
    one_line_error(refused, "MONARCH_OTLP_ENDPOINT")
    conf = tmp_path / ".monarch" / "otlp.json"
    conf.parent.mkdir()
    conf.write_text("{}")
    conf.chmod(0o644)  # as an older monarch-cli left it
    monkeypatch.setenv("MONARCH_OTLP_ENDPOINT", url)
    served = monarch("serve", "-n", "1", "--otlp", "env", cwd=tmp_path)
    try:
        assert served.returncode == 0, served.stderr
        assert conf.stat().st_mode & 0o077 == 0 and json.loads(conf.read_text())["endpoint"] == url.rstrip("/")
        (tmp_path / "hello.py").write_text("print('hello')\n")
        monkeypatch.delenv("MONARCH_OTLP_ENDPOINT")  # (the run reads the reservation's file)
        run = monarch("run-spmd", "--", "torchrun", "--nproc-per-node=1", "hello.py", cwd=tmp_path)
        assert run.returncode == 0 and "OpenTelemetry export failed" in run.stderr, run.stderr
        assert secret not in run.stdout + run.stderr and "***@127.0.0.1" in run.stderr, run.stderr
    finally:
        monarch("stop", cwd=tmp_path)
