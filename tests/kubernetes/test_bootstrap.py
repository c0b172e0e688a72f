"""The bootstrap (a pod's or a torchx replica's ``python3 -c``) and the client's side of it, without a cluster.

Shared by the kubernetes and torchx backends (monarch_cli/schedulers/bootstrap.py): tested once, here.

The bootstrap runs as a real process under a stock interpreter (torch, nothing of ours), with
the reservation keys in a 0400 file as the Secret volume gives them; the client talks to it
over a real socket: an unsigned header and a zip that is not what the header says are refused
and leave nothing behind, then :func:`bootstrap.ship` sends the real bundle and the bootstrap
execs the "agent" (here a one-line script) from the parts it unzipped.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import os
import socket
import subprocess
from pathlib import Path

import pytest

from monarch_cli.runtime.launch import bundle
from monarch_cli.runtime.transport.keys import Keys
from monarch_cli.schedulers import bootstrap

#: Stands for the agent: importing monarch_cli appends the bundle's dependencies (zmq) to sys.path.
AGENT = "import sys, monarch_cli, zmq; print('agent', zmq.__file__, monarch_cli.__file__, sys.argv[1:], flush=True)"


def _connect(port: int) -> socket.socket:
    return socket.create_connection(("127.0.0.1", port), timeout=30)


def _answer(sock: socket.socket) -> str:
    return sock.makefile("rb").readline().decode().strip()


@pytest.mark.slow  # builds and unzips the real bundle (a few seconds)
def test_the_bootstrap_takes_only_a_signed_bundle_and_runs_the_agent_from_it(stock: str, tmp_path: Path) -> None:
    keys = Keys.generate()
    secret = tmp_path / "secret" / "keys"  # as the Secret volume has it: mode 0400
    secret.parent.mkdir()
    fd = os.open(secret, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o400)
    os.write(fd, keys.encode().encode() + b"\n")
    os.close(fd)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    where = tmp_path / "volume" / "bundles"
    argv = bootstrap.command(stock, port, ["python3", "-c", AGENT, "--name", "h0"], where=str(where))
    env = {"PATH": "/usr/bin:/bin", "MONARCH_KEY_FILE": str(secret), "MONARCH_HOST": "127.0.0.1"}
    proc = subprocess.Popen(argv, env=env, cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        assert proc.stdout is not None
        assert "listening on 127.0.0.1" in proc.stdout.readline()
        assert oct(where.stat().st_mode & 0o777) == "0o700"

        with _connect(port) as sock:  # signed with other keys: refused before a byte more is read
            kind, hello = bootstrap.greeting(sock)
            assert kind == "bootstrap" and hello is not None and hello["held"] == []
            assert tuple(hello["python"][:2]) >= bundle.MIN_PYTHON and hello["machine"]
            header = json.dumps({"parts": [], "code": "code-0", "deps": "deps-0", "unpack": "print(1)"}).encode()
            other = bootstrap.hmac_key(Keys.generate().encode())
            mac = hmac.new(other, hello["nonce"].encode() + b"\0" + header, "sha256").hexdigest().encode()
            sock.sendall(mac + b" " + header + b"\n")
            assert _answer(sock) == "error: not signed with this reservation's keys"

        key = bootstrap.hmac_key(keys.encode())
        with _connect(port) as sock:  # signed, but the bytes are not those the header names
            _, hello = bootstrap.greeting(sock)
            assert hello is not None
            data = b"PK not really a zip"
            part = {"name": "code-0123abcd", "size": len(data), "sha256": hashlib.sha256(b"something else").hexdigest()}
            header = json.dumps(
                {"parts": [part], "code": "code-0123abcd", "deps": "deps-0", "unpack": bundle.UNPACK_SCRIPT}
            ).encode()
            mac = hmac.new(key, hello["nonce"].encode() + b"\0" + header, "sha256").hexdigest().encode()
            sock.sendall(mac + b" " + header + b"\n" + data)
            assert "code-0123abcd arrived with SHA-256" in _answer(sock)

        with _connect(port) as sock:  # a replayed header (the last nonce) is refused too
            _, fresh = bootstrap.greeting(sock)
            assert fresh is not None and fresh["nonce"] != hello["nonce"]
            sock.sendall(mac + b" " + header + b"\n")
            assert _answer(sock) == "error: not signed with this reservation's keys"
        assert list(where.iterdir()) == []  # nothing refused stays

        with _connect(port) as sock:
            _, hello = bootstrap.greeting(sock)
            assert hello is not None
            said: list[str] = []
            got = bootstrap.ship(sock, hello, key, None, said.append)
        assert got["shipped"] > 1_000_000 and "shipping deps-" in said[0], (got, said)
        out, _ = proc.communicate(timeout=60)
    finally:
        proc.kill()
    ran = [line for line in out.splitlines() if line.startswith("agent ")]
    assert ran, out
    _, zmq_file, ours, args = ran[0].split(" ", 3)
    assert zmq_file.startswith(f"{where}/{got['deps']}/site/zmq/")  # the stock interpreter had none
    assert ours == f"{where}/{got['code']}/monarch_cli/__init__.py" and args == "['--name', 'h0']"
    assert sorted(p.name for p in where.iterdir()) == sorted([got["code"], got["deps"]])  # the zips are gone


def test_the_bootstrap_says_nothing_kubernetes_would_expand() -> None:
    """Kubernetes expands ``$(NAME)`` (and ``$$`` to ``$``) in a container's command: the script has neither."""
    assert "$(" not in bootstrap.BOOTSTRAP and "$$" not in bootstrap.BOOTSTRAP
    compile(bootstrap.BOOTSTRAP, "bootstrap", "exec")


def test_unsigned_connections_cannot_pile_up_threads_in_the_bootstrap(stock: str, tmp_path: Path) -> None:
    """Before the signed header, a connection costs the bootstrap a thread: at most 16 at once;
    the rest are closed at once. Once they go, a client is greeted again."""
    import time

    keys = Keys.generate()
    secret = tmp_path / "keys"
    secret.write_text(keys.encode() + "\n")
    secret.chmod(0o400)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    argv = bootstrap.command(stock, port, ["python3", "-c", "pass"], where=str(tmp_path / "bundles"))
    env = {"PATH": "/usr/bin:/bin", "MONARCH_KEY_FILE": str(secret), "MONARCH_HOST": "127.0.0.1"}
    proc = subprocess.Popen(argv, env=env, cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    idle: list[socket.socket] = []
    try:
        assert proc.stdout is not None and "listening on" in proc.stdout.readline()
        idle = [_connect(port) for _ in range(40)]  # say nothing
        greeted = 0
        for sock in idle:  # the first 16 are greeted; the rest are closed without a word
            sock.settimeout(5)
            greeted += sock.recv(20).startswith(b"MONARCH-BOOTSTRAP")
        assert greeted == 16, greeted
        assert len(os.listdir(f"/proc/{proc.pid}/task")) <= 1 + 16, os.listdir(f"/proc/{proc.pid}/task")
        for sock in idle:
            sock.close()
        deadline = time.monotonic() + 30
        while True:  # their threads end as their sockets close: a client is greeted again
            with _connect(port) as sock:
                kind, hello = bootstrap.greeting(sock, timeout=5)
            if hello is not None:
                break
            assert time.monotonic() < deadline, kind
            time.sleep(0.2)
    finally:
        for sock in idle:
            sock.close()
        proc.kill()
        proc.wait()
