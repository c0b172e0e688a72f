"""How a host with a stock interpreter gets our code: a stdlib-only bootstrap that the client ships the bundle to.

Shared by the backends whose hosts do not see the client's filesystem (the kubernetes backend's
pods, the torchx backends' replicas). A pod's (a replica's) container runs :data:`BOOTSTRAP` (``python3 -c``), not the agent: it checks the
interpreter (CPython >= :data:`~...runtime.launch.bundle.MIN_PYTHON`), listens on the agent's
port, and greets each connection with one line: its platform (what the ssh backend's probe
learns) and the bundle parts it holds, and a fresh nonce. The client (:func:`ship`), over the
connection it opens to the pod anyway (the pod IP, or a port-forward over the API), answers
with a header that names each zip it sends (name, size, SHA-256) and the stdlib unzip script,
authenticated by an HMAC over the nonce and the header with a key derived from the
reservation's keys (the Secret the pod mounts; never in the manifest, an argument or an env
value), then the zips' bytes. The pod checks the HMAC before reading a byte more, each zip's
SHA-256, unzips them into a private (0700) content-addressed directory on an ``emptyDir``
(:data:`BUNDLES_DIR`), and execs the agent from there on the same port. Nothing is installed
by name; the image needs no registry push and nothing of ours.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import os
import socket
from collections.abc import Callable
from typing import Any

from ..config import KEY_FILE_ENV, EnvSettings
from ..errors import SchedulerError
from ..runtime.launch import bundle

#: The emptyDir volume the pod's bundle parts are unzipped into (gone with the pod).
VOLUME = "monarch-bundle"
MOUNT = "/var/lib/monarch-cli"
BUNDLES_DIR = f"{MOUNT}/bundles"
#: The first words of the bootstrap's greeting (an agent speaks ZeroMQ: its first byte is 0xFF).
GREETING = b"MONARCH-BOOTSTRAP 1 "
#: Domain separation of the HMAC key from the reservation keys' other uses.
_KEY_CONTEXT = b"monarch-cli bundle\0"

#: ``python3 -c BOOTSTRAP PORT BUNDLES_DIR AGENT_ARGS...``: stdlib only, Python 3.6 syntax (a too-old
#: interpreter must still say so). Exits non-zero with one line for an interpreter we cannot use.
BOOTSTRAP = (
    (
        r"""
import hashlib, hmac, json, os, platform, re, socket, subprocess, sys, threading
if sys.implementation.name != "cpython" or sys.version_info[:2] < __MIN__:
    sys.exit("monarch: this image's Python is %s %d.%d.%d; CPython >= __MIN_TEXT__ is needed (another --image, or "
             "--python)" % ((sys.implementation.name,) + tuple(sys.version_info[:3])))
port, where, agent = int(sys.argv[1]), sys.argv[2], sys.argv[3:]
with open(os.environ["__KEY_FILE_VAR__"], "rb") as f:
    key = hashlib.sha256(b"monarch-cli bundle\0" + f.read().strip()).digest()
os.makedirs(where, mode=0o700, exist_ok=True)
os.chmod(where, 0o700)
host = os.environ.get("__LISTEN_HOST_VAR__") or os.environ.get("__HOST_VAR__") or "0.0.0.0"
family = socket.AF_INET6 if ":" in host else socket.AF_INET
srv = socket.socket(family, socket.SOCK_STREAM)
srv.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
srv.bind((host, port))
srv.listen(16)
srv.settimeout(0.2)
ready = []
print("monarch bootstrap: %s listening on %s:%d for the client's bundle" % (sys.executable, host, port), flush=True)

def held():
    return sorted(n for n in os.listdir(where) if re.match(r"^(code|deps)-[0-9a-f]+$", n))

def hello(nonce):
    libc, libc_version = platform.libc_ver()
    s = os.statvfs(where)
    return {"nonce": nonce, "python": list(sys.version_info[:3]), "implementation": sys.implementation.name,
            "machine": platform.machine(), "system": platform.system(), "libc": libc,
            "libc_version": libc_version, "free": s.f_bavail * s.f_frsize, "held": held()}

slots = threading.BoundedSemaphore(16)  # connections served at once: unsigned ones cannot pile threads up

def serve(conn):
    zips = []
    try:
        conn.settimeout(120)  # (the client builds its bundle for this platform between greeting and header)
        nonce = os.urandom(16).hex()
        conn.sendall(b"MONARCH-BOOTSTRAP 1 " + json.dumps(hello(nonce)).encode() + b"\n")
        f = conn.makefile("rb")
        mac, _, header = f.readline(1 << 20).strip().partition(b" ")
        good = hmac.new(key, nonce.encode() + b"\0" + header, "sha256").hexdigest().encode()
        if not hmac.compare_digest(mac, good):
            conn.sendall(b"error: not signed with this reservation's keys\n")
            return
        h = json.loads(header.decode())
        for p in h["parts"]:
            if not re.match(r"^(code|deps)-[0-9a-f]+$", p["name"]):
                raise ValueError("bad part name %r" % p["name"])
            name = "%s.%s.zip" % (p["name"], nonce)
            zips.append(name)
            digest, left = hashlib.sha256(), int(p["size"])
            with open(os.path.join(where, name), "wb") as out:
                while left:
                    chunk = f.read(min(left, 1 << 20))
                    if not chunk:
                        raise EOFError("the client went away after %d of %d bytes" % (int(p["size"]) - left, p["size"]))
                    digest.update(chunk)
                    out.write(chunk)
                    left -= len(chunk)
            if digest.hexdigest() != p["sha256"]:
                raise ValueError("%s arrived with SHA-256 %s, not %s" % (p["name"], digest.hexdigest(), p["sha256"]))
        if zips:
            done = subprocess.run([sys.executable, "-c", h["unpack"], where, "3"] + zips,
                                  stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
            if done.returncode:
                raise OSError("unzip failed: " + done.stdout.decode(errors="replace")[-300:])
        missing = [n for n in (h["code"], h["deps"]) if n not in held()]
        if missing:
            raise ValueError("%s not here and not sent" % ", ".join(missing))
        conn.sendall(b"ok\n")
        ready.append(h)
    except Exception as e:
        for name in zips:
            try:
                os.unlink(os.path.join(where, name))
            except OSError:
                pass
        try:
            conn.sendall(("error: %s: %s\n" % (type(e).__name__, e)).encode())
        except OSError:
            pass
    finally:
        conn.close()
        slots.release()

while not ready:
    try:
        conn, _ = srv.accept()
    except socket.timeout:
        continue
    if not slots.acquire(False):
        conn.close()
        continue
    threading.Thread(target=serve, args=(conn,), daemon=True).start()
srv.close()
h = ready[0]
env = dict(os.environ)
code, deps = os.path.join(where, h["code"]), os.path.join(where, h["deps"])
env["PYTHONPATH"] = code + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
env["__PY_SPY_VAR__"] = os.path.join(deps, "bin", "py-spy")
os.utime(code)
os.utime(deps)
sys.stdout.flush()
os.execve(sys.executable, [sys.executable] + agent, env)
"""
    )
    .replace("__MIN_TEXT__", ".".join(map(str, bundle.MIN_PYTHON)))
    .replace("__MIN__", repr(tuple(bundle.MIN_PYTHON)))
    .replace("__KEY_FILE_VAR__", KEY_FILE_ENV)
    .replace("__LISTEN_HOST_VAR__", EnvSettings.listen_host.var)
    .replace("__HOST_VAR__", EnvSettings.host.var)
    .replace("__PY_SPY_VAR__", EnvSettings.py_spy.var)
)


def command(python: str, port: int | str, agent_argv: list[str], where: str = BUNDLES_DIR) -> list[str]:
    """The pod's container command: the bootstrap, then (exec'd by it) the agent's arguments.
    ``port`` may be a shell expression (torchx's per-replica port); ``where``: the bundles' directory."""
    return [python, "-c", BOOTSTRAP.strip() + "\n", str(port), where, *agent_argv[1:]]


def hmac_key(encoded_keys: str) -> bytes:
    """What the bootstrap derives from the Secret's file (its content, stripped)."""
    return hashlib.sha256(_KEY_CONTEXT + encoded_keys.strip().encode()).digest()


def greeting(sock: socket.socket, timeout: float = 2.0) -> tuple[str, dict[str, Any] | None]:
    """Who answers on a fresh connection: ``("agent", None)`` (ZeroMQ's greeting), ``("bootstrap",
    hello)``, or ``("silent", None)`` (nothing yet, or the connection ended)."""
    sock.settimeout(timeout)
    buf = b""
    try:
        while b"\n" not in buf and len(buf) < 1 << 16:
            chunk = sock.recv(4096)
            if not chunk:
                break
            buf += chunk
            if buf[:1] == b"\xff":
                return "agent", None
            if not GREETING.startswith(buf[: len(GREETING)]):
                return "silent", None
    except OSError:
        pass
    if buf.startswith(GREETING) and b"\n" in buf:
        try:
            return "bootstrap", json.loads(buf[len(GREETING) :].split(b"\n", 1)[0])
        except ValueError:
            pass
    return "silent", None


def ship(
    sock: socket.socket,
    hello: dict[str, Any],
    key: bytes,
    wheelhouse: str | None,
    say: Callable[[str], None],
    *,
    where: str = BUNDLES_DIR,
    who: str = "the pod",
) -> dict[str, Any]:
    """Send the parts the pod lacks for its platform (built or found in this client's cache) and
    wait for its word: ``{"code", "deps", "shipped"}``. A SchedulerError says why not (no prefix); a
    ConnectionError is worth another try."""
    host = bundle.HostPlatform.from_probe(hello)
    built = bundle.build(host, wheelhouse)  # checks the Python; wheels from --wheelhouse or the cache
    missing = built.missing(hello.get("held") or [])
    need = sum(p.size + p.unpacked for p in missing)
    if missing and isinstance(hello.get("free"), int) and hello["free"] < need:
        raise SchedulerError(
            f"not enough space for our code and wheels in {where}: {hello['free'] / 1e6:.1f} MB free, "
            f"{need / 1e6:.1f} MB needed"
        )
    parts: list[dict[str, Any]] = [
        {"name": p.name, "size": p.path.stat().st_size, "sha256": _sha256(p.path)} for p in missing
    ]
    header = json.dumps(
        {"parts": parts, "code": built.code.name, "deps": built.deps.name, "unpack": bundle.UNPACK_SCRIPT},
        separators=(",", ":"),
    ).encode()
    mac = hmac.new(key, str(hello["nonce"]).encode() + b"\0" + header, "sha256").hexdigest().encode()
    if missing:
        say(
            f"{host.describe()}: shipping {', '.join(p.name for p in missing)} "
            f"({sum(p['size'] for p in parts) / 1e6:.1f} MB)"
        )
    sock.settimeout(300)
    try:
        sock.sendall(mac + b" " + header + b"\n")
        for part in missing:
            with open(part.path, "rb") as f:
                while chunk := f.read(1 << 20):
                    sock.sendall(chunk)
        answer = _line(sock)
    except OSError as e:
        raise ConnectionError(f"the connection ended while shipping the bundle ({e.strerror or e})") from None
    if not answer:
        raise ConnectionError(f"the connection ended before {who} took the bundle")
    if answer != "ok":
        raise SchedulerError(f"{who} did not take the bundle: {answer.removeprefix('error: ')}")
    return {"code": built.code.name, "deps": built.deps.name, "shipped": sum(p["size"] for p in parts)}


def _line(sock: socket.socket) -> str:
    buf = b""
    while not buf.endswith(b"\n"):
        chunk = sock.recv(4096)
        if not chunk:
            break
        buf += chunk
    return buf.decode(errors="replace").strip()


def _sha256(path: os.PathLike[str] | str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            h.update(chunk)
    return h.hexdigest()


__all__ = ["BOOTSTRAP", "BUNDLES_DIR", "MOUNT", "VOLUME", "command", "greeting", "hmac_key", "ship"]
