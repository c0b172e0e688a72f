"""A small Kubernetes API emulator for tests: the real REST paths and watch wire format, for the kinds monarch uses.

Pods, Secrets, Services and Events (``/api/v1``) and Jobs (``/apis/batch/v1``), namespaced:
create (``dryRun=All`` validates without storing; an existing name is 409 AlreadyExists),
get, list (``labelSelector`` of ``k=v`` terms, ``fieldSelector`` of ``a.b=v`` terms, a list
``resourceVersion``), delete (404
Status when absent; a Job deleted with ``propagationPolicy: Foreground`` keeps a
``deletionTimestamp`` and the ``foregroundDeletion`` finalizer until its pods are gone, as
the garbage collector does; ``Background`` removes it and its pods follow; ``Orphan``, and no
policy, the API's default for ``batch/v1`` Jobs, leaves its pods running without an owner)
and ``?watch=true`` from a ``resourceVersion``: a chunked
stream of ``{"type": ..., "object": ...}`` JSON lines that ends after ``timeoutSeconds``;
a version older than the kept history is answered with an ERROR event carrying a 410 Status.

Why not kmock (0.8, read before writing this): its lists carry ``resourceVersion: "..."``,
its watches replay every object and ignore ``resourceVersion`` and ``timeoutSeconds`` (a
TODO there), and it needs Python 3.11 and aiohttp; the resume-from-version watch is what the
backend relies on, and extending it meant rewriting its core. This is ~300 lines of stdlib.

``GET pods/<name>/portforward?ports=P`` upgraded to a websocket speaks the kubelet's
``v4.channel.k8s.io`` port-forward protocol (a data and an error channel per port, each first
sent the port as two little-endian bytes, every frame a channel byte then data) and relays
the data channel to a connection that :attr:`ApiServer.dial` opens to the pod's port, as the
API server proxies to the kubelet and the kubelet connects to the pod's localhost; a failed
connection is reported on the error channel. The websocket itself is the ``websockets``
library's sans-I/O protocol (handshake and framing), driven over the handler's socket.

Volcano's ``Job`` (``/apis/batch.volcano.sh/v1alpha1/.../jobs``, stored as ``vcjobs``), as torchx's
kubernetes scheduler uses it: create, get, get and replace its ``/status`` subresource (torchx
cancels by writing ``Aborted`` there), delete; :mod:`.volcano` stands in for its controller.

What it does not do: schema validation and admission (but for a namespace that does not
exist), RBAC, field selectors on watches, patch,
server-side apply. The objects' statuses are written by the test-side kubelet
(:mod:`.kubelet`) through :class:`Store`, the emulator's storage, as the real kubelet and
Job controller write them through the API.
"""

from __future__ import annotations

import builtins
import copy
import datetime
import json
import re
import select
import socket
import struct
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import parse_qs, urlparse

KINDS = {
    "pods": ("v1", "Pod"),
    "secrets": ("v1", "Secret"),
    "services": ("v1", "Service"),
    "jobs": ("batch/v1", "Job"),
    "events": ("v1", "Event"),
    "vcjobs": ("batch.volcano.sh/v1alpha1", "Job"),
}
_PATH = re.compile(
    r"^/(?:api/v1|apis/batch/v1)/namespaces/(?P<ns>[a-z0-9-]+)/"
    r"(?P<plural>pods|secrets|services|jobs|events)"
    r"(?:/(?P<name>[a-z0-9.-]+))?/?$"
)
_VOLCANO = re.compile(
    r"^/apis/batch\.volcano\.sh/v1alpha1/namespaces/(?P<ns>[a-z0-9-]+)/jobs"
    r"(?:/(?P<name>[a-z0-9.-]+)(?P<status>/status)?)?/?$"
)
_PORT_FORWARD = re.compile(r"^/api/v1/namespaces/(?P<ns>[a-z0-9-]+)/pods/(?P<name>[a-z0-9.-]+)/portforward$")
#: The kubelet's port-forward websocket subprotocol (it offers no v5 for port-forward).
PORT_FORWARD_PROTOCOL = "v4.channel.k8s.io"
#: (namespace, pod, port) -> a socket connected to that port in the pod (the kubelet's part).
Dial = Callable[[str, str, int], socket.socket]
_NAME = re.compile(r"^[a-z0-9]([-a-z0-9.]{0,251}[a-z0-9])?$")
Key = tuple[str, str, str]


def now() -> str:
    return datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def status(code: int, reason: str, message: str) -> dict[str, Any]:
    return {
        "kind": "Status",
        "apiVersion": "v1",
        "metadata": {},
        "status": "Failure",
        "message": message,
        "reason": reason,
        "code": code,
    }


class ApiError(Exception):
    def __init__(self, code: int, reason: str, message: str) -> None:
        super().__init__(message)
        self.body = status(code, reason, message)


def _fields_match(obj: dict[str, Any], selector: str) -> bool:
    """A ``fieldSelector`` of ``a.b=value`` terms (what the backend asks of events)."""
    for term in filter(None, selector.split(",")):
        path, _, value = term.partition("=")
        found: Any = obj
        for part in path.split("."):
            found = found.get(part) if isinstance(found, dict) else None
        if found != value:
            return False
    return True


def _matches(obj: dict[str, Any], selector: str) -> bool:
    labels = obj["metadata"].get("labels") or {}
    for term in filter(None, selector.split(",")):
        key, _, value = term.partition("=")
        if labels.get(key) != value:
            return False
    return True


class ControlLoop:
    """What the stand-ins for cluster controllers (the kubelet, Volcano's) share: ``_sync`` every
    50 ms on a thread of their own until :meth:`stop_loop`; an exception is a test failure kept
    in ``errors`` (the fixtures assert it is empty), not a dead thread."""

    def start_loop(self, name: str) -> None:
        self.errors: list[str] = []
        self._stop = threading.Event()
        self.thread = threading.Thread(target=self._loop, daemon=True, name=name)
        self.thread.start()

    def stop_loop(self) -> None:
        self._stop.set()
        self.thread.join(timeout=5)

    def _loop(self) -> None:
        while not self._stop.is_set():
            try:
                self._sync()
            except Exception as e:  # noqa: BLE001 - a test failure, not a dead thread
                if f"{type(e).__name__}: {e}" not in self.errors:
                    self.errors.append(f"{type(e).__name__}: {e}")
            time.sleep(0.05)

    def _sync(self) -> None:
        raise NotImplementedError


class Store:
    """Objects by (plural, namespace, name), a resourceVersion counter and the event history watches replay."""

    def __init__(self) -> None:
        self.cond = threading.Condition()
        self.version = 0
        self.objects: dict[Key, dict[str, Any]] = {}
        self.events: list[tuple[int, str, str, str, dict[str, Any]]] = []  # (rv, plural, ns, type, object)
        self.oldest = 0  # events at or below this version are forgotten
        self.namespaces = {"default"}

    def _record(self, plural: str, ns: str, kind: str, obj: dict[str, Any]) -> dict[str, Any]:
        self.version += 1
        obj["metadata"]["resourceVersion"] = str(self.version)
        self.events.append((self.version, plural, ns, kind, copy.deepcopy(obj)))
        self.cond.notify_all()
        return copy.deepcopy(obj)

    def create(self, plural: str, ns: str, obj: dict[str, Any], dry_run: bool = False) -> dict[str, Any]:
        api_version, kind = KINDS[plural]
        obj = copy.deepcopy(obj)
        meta = obj.setdefault("metadata", {})
        name = meta.get("name", "")
        if obj.get("kind") != kind or obj.get("apiVersion") != api_version:
            raise ApiError(
                400, "BadRequest", f"expected {api_version} {kind}, got {obj.get('apiVersion')} {obj.get('kind')}"
            )
        if not _NAME.match(name):
            raise ApiError(422, "Invalid", f'{kind} "{name}" is invalid: metadata.name: Invalid value')
        if meta.get("namespace", ns) != ns:
            raise ApiError(400, "BadRequest", "the namespace of the object does not match the namespace of the URL")
        if ns not in self.namespaces:  # the NamespaceLifecycle admission check, dry runs included
            raise ApiError(404, "NotFound", f'namespaces "{ns}" not found')
        with self.cond:
            if (plural, ns, name) in self.objects:
                raise ApiError(409, "AlreadyExists", f'{plural} "{name}" already exists')
            meta.update(namespace=ns, uid=str(uuid.uuid4()), creationTimestamp=now())
            obj.setdefault("status", {}) if plural in ("pods", "jobs") else None
            if dry_run:
                return obj
            self.objects[(plural, ns, name)] = obj
            return self._record(plural, ns, "ADDED", obj)

    def get(self, plural: str, ns: str, name: str) -> dict[str, Any]:
        with self.cond:
            obj = self.objects.get((plural, ns, name))
            if obj is None:
                raise ApiError(404, "NotFound", f'{plural} "{name}" not found')
            return copy.deepcopy(obj)

    def list(
        self, plural: str, ns: str | None, selector: str = "", fields: str = ""
    ) -> tuple[builtins.list[dict[str, Any]], str]:
        with self.cond:
            items = [
                copy.deepcopy(o)
                for (p, n, _), o in sorted(self.objects.items())
                if p == plural and (ns is None or n == ns) and _matches(o, selector) and _fields_match(o, fields)
            ]
            return items, str(self.version)

    def update(self, plural: str, ns: str, name: str, change: Callable[[dict[str, Any]], None]) -> dict[str, Any]:
        """Apply ``change`` to the stored object (a status write) and tell the watchers."""
        with self.cond:
            obj = self.objects.get((plural, ns, name))
            if obj is None:
                raise ApiError(404, "NotFound", f'{plural} "{name}" not found')
            change(obj)
            return self._record(plural, ns, "MODIFIED", obj)

    def remove(self, plural: str, ns: str, name: str) -> dict[str, Any] | None:
        with self.cond:
            obj = self.objects.pop((plural, ns, name), None)
            return None if obj is None else self._record(plural, ns, "DELETED", obj)

    def delete(self, plural: str, ns: str, name: str, propagation: str) -> dict[str, Any]:
        with self.cond:
            obj = self.objects.get((plural, ns, name))
            if obj is None:
                raise ApiError(404, "NotFound", f'{plural} "{name}" not found')
            if plural == "jobs" and propagation != "Foreground":
                if propagation != "Background":  # Orphan, the default: the pods stay, without an owner
                    for (p, n, _), pod in list(self.objects.items()):
                        if p == "pods" and n == ns and (pod["metadata"].get("labels") or {}).get("job-name") == name:
                            self.update(
                                "pods",
                                ns,
                                pod["metadata"]["name"],
                                lambda o: o["metadata"].pop("ownerReferences", None),
                            )
                return self.remove(plural, ns, name) or obj
            if plural in ("jobs", "pods"):  # graceful: the kubelet/garbage collector finishes it

                def mark(o: dict[str, Any]) -> None:
                    o["metadata"].setdefault("deletionTimestamp", now())
                    if plural == "jobs":
                        o["metadata"]["finalizers"] = ["foregroundDeletion"]

                return self.update(plural, ns, name, mark)
            return self.remove(plural, ns, name) or obj

    def compact(self) -> None:
        """Forget the event history, as etcd compaction does: older watches get 410 Expired."""
        with self.cond:
            self.oldest = self.version
            self.events.clear()

    def watch(self, plural: str, ns: str, selector: str, since: str | None, timeout: float) -> Iterator[dict[str, Any]]:
        """Events after ``since`` (all current objects as ADDED when None) until ``timeout`` seconds pass."""
        deadline = time.monotonic() + timeout
        with self.cond:
            if since is None or since == "" or since == "0":
                items, version = self.list(plural, ns, selector)
                after = int(version)
                initial = [{"type": "ADDED", "object": o} for o in items]
            else:
                after = int(since)
                initial = []
                if after < self.oldest:
                    initial = [
                        {
                            "type": "ERROR",
                            "object": status(410, "Expired", f"too old resource version: {after} ({self.oldest})"),
                        }
                    ]
                    after = -1
        yield from initial
        if after < 0:
            return
        while True:
            with self.cond:
                pending = [e for e in self.events if e[0] > after]
                while not pending:
                    left = deadline - time.monotonic()
                    if left <= 0:
                        return
                    self.cond.wait(left)
                    pending = [e for e in self.events if e[0] > after]
            for version, p, n, kind, obj in pending:
                after = version
                if p == plural and n == ns and _matches(obj, selector):
                    yield {"type": kind, "object": obj}


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    store: Store
    api: ApiServer

    def log_message(self, *args: Any) -> None:  # quiet
        pass

    def _send(self, code: int, body: dict[str, Any]) -> None:
        data = json.dumps(body).encode()
        self.send_response(code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def _route(self) -> tuple[str, str, str | None, dict[str, list[str]]]:
        url = urlparse(self.path)
        m = _PATH.match(url.path)
        if m:
            return m["plural"], m["ns"], m["name"], parse_qs(url.query)
        m = _VOLCANO.match(url.path)
        if not m:
            raise ApiError(404, "NotFound", f"the server could not find the requested resource ({url.path})")
        return "vcjobs", m["ns"], m["name"], parse_qs(url.query)

    def _body(self) -> dict[str, Any]:
        length = int(self.headers.get("Content-Length") or 0)
        return json.loads(self.rfile.read(length) or b"{}") if length else {}

    def _handle(self, method: str) -> None:
        try:
            plural, ns, name, query = self._route()
            one = lambda key, default="": query.get(key, [default])[0]  # noqa: E731
            if method == "GET" and name:
                return self._send(200, self.store.get(plural, ns, name))
            if method == "GET" and one("watch") in ("1", "true"):
                return self._stream(
                    self.store.watch(
                        plural,
                        ns,
                        one("labelSelector"),
                        one("resourceVersion") or None,
                        float(one("timeoutSeconds", "300")),
                    )
                )
            if method == "GET":
                items, version = self.store.list(plural, ns, one("labelSelector"), one("fieldSelector"))
                api_version, kind = KINDS[plural]
                return self._send(
                    200,
                    {
                        "kind": f"{kind}List",
                        "apiVersion": api_version,
                        "metadata": {"resourceVersion": version},
                        "items": items,
                    },
                )
            if method == "POST" and not name:
                return self._send(201, self.store.create(plural, ns, self._body(), dry_run=one("dryRun") == "All"))
            if method == "PUT" and name and plural == "vcjobs" and self.path.split("?")[0].endswith("/status"):
                body = self._body()
                return self._send(200, self.store.update(plural, ns, name, lambda o: o.update(status=body["status"])))
            if method == "DELETE" and name:
                body = self._body()
                return self._send(200, self.store.delete(plural, ns, name, body.get("propagationPolicy", "")))
            raise ApiError(405, "MethodNotAllowed", f"{method} is not supported here")
        except ApiError as e:
            self._send(e.body["code"], e.body)
        except (ValueError, KeyError) as e:
            self._send(400, status(400, "BadRequest", f"{type(e).__name__}: {e}"))

    def _stream(self, events: Iterator[dict[str, Any]]) -> None:
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Transfer-Encoding", "chunked")
        self.end_headers()
        try:
            for event in events:
                line = json.dumps(event).encode() + b"\n"
                self.wfile.write(b"%x\r\n%s\r\n" % (len(line), line))
                self.wfile.flush()
            self.wfile.write(b"0\r\n\r\n")
        except (BrokenPipeError, ConnectionResetError):
            self.close_connection = True

    def do_GET(self) -> None:
        url = urlparse(self.path)
        m = _PORT_FORWARD.match(url.path)
        if m:
            try:
                return self._port_forward(m["ns"], m["name"], parse_qs(url.query))
            except ApiError as e:
                return self._send(e.body["code"], e.body)
        self._handle("GET")

    def _port_forward(self, ns: str, name: str, query: dict[str, list[str]]) -> None:
        """The port-forward websocket: one port, its data channel relayed to the pod's port."""
        from websockets.server import ServerProtocol

        pod = self.store.get("pods", ns, name)
        ports = [p for p in ",".join(query.get("ports", [])).split(",") if p]
        if len(ports) != 1 or not ports[0].isdigit():
            raise ApiError(400, "BadRequest", f"this emulator forwards exactly one port, not {ports}")
        port = int(ports[0])
        if (pod.get("status") or {}).get("phase") != "Running" or self.api.dial is None:
            raise ApiError(400, "BadRequest", f"pod {name} is not running")
        ws = ServerProtocol(subprotocols=[PORT_FORWARD_PROTOCOL], max_size=None)
        ws.receive_data(
            self.raw_requestline + b"".join(f"{k}: {v}\r\n".encode() for k, v in self.headers.items()) + b"\r\n"
        )  # the request this handler parsed, for the protocol's own parser
        (request,) = ws.events_received()
        response = ws.accept(request)
        ws.send_response(response)
        self.close_connection = True
        conn = self.connection
        if response.status_code != 101:
            conn.sendall(b"".join(ws.data_to_send()))
            return
        header = struct.pack("<H", port)  # each channel's first frame: the port
        ws.send_binary(b"\x00" + header)
        ws.send_binary(b"\x01" + header)
        try:
            target = self.api.dial(ns, name, port)
        except OSError as e:
            ws.send_binary(
                b"\x01"
                + f"error forwarding port {port} to pod {name}, uid {pod['metadata']['uid']}: "
                f"failed to connect to localhost:{port} inside the pod: {e}".encode()
            )
            ws.send_close()
            conn.sendall(b"".join(ws.data_to_send()))
            return
        with target:
            try:
                self._relay(ws, conn, target)
            except OSError:  # either side reset: the stream ends
                pass

    @staticmethod
    def _relay(ws: Any, conn: socket.socket, target: socket.socket) -> None:
        from websockets.frames import Opcode
        from websockets.protocol import State

        conn.sendall(b"".join(ws.data_to_send()))
        while True:
            readable, _, _ = select.select([conn, target], [], [])
            done = False
            if conn in readable:
                data = conn.recv(1 << 16)
                ws.receive_data(data) if data else ws.receive_eof()
                for frame in ws.events_received():  # pings and the closing handshake answer themselves
                    if frame.opcode is Opcode.BINARY and frame.data[:1] == b"\x00" and len(frame.data) > 1:
                        target.sendall(frame.data[1:])
                    done = done or frame.opcode is Opcode.CLOSE
                done = done or not data
            if target in readable and ws.state is State.OPEN:  # (a client that began closing gets no more)
                data = target.recv(1 << 16)
                if data:
                    ws.send_binary(b"\x00" + data)
                else:  # the pod closed its side: so does the stream
                    ws.send_close()
                    done = True
            conn.sendall(b"".join(ws.data_to_send()))
            if done:
                return

    def do_POST(self) -> None:
        self._handle("POST")

    def do_DELETE(self) -> None:
        self._handle("DELETE")

    def do_PUT(self) -> None:
        self._handle("PUT")


class ApiServer:
    """The emulator on ``http://127.0.0.1:<port>``, serving :attr:`store` from threads."""

    def __init__(self) -> None:
        self.store = Store()
        #: How port-forwards reach a pod's port: set by the kubelet (:meth:`.kubelet.Kubelet.dial`).
        self.dial: Dial | None = None
        handler = type("Handler", (_Handler,), {"store": self.store, "api": self})
        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), handler)
        self.httpd.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)
        self.thread.start()

    def kubeconfig(self, path: Any, namespace: str = "default") -> str:
        """A kubeconfig file pointing at this emulator, as a user's would point at a cluster."""
        text = json.dumps(
            {
                "apiVersion": "v1",
                "kind": "Config",
                "current-context": "emulator",
                "clusters": [{"name": "emulator", "cluster": {"server": self.url}}],
                "users": [{"name": "tester", "user": {"token": "not-checked"}}],
                "contexts": [
                    {"name": "emulator", "context": {"cluster": "emulator", "user": "tester", "namespace": namespace}}
                ],
            }
        )
        with open(path, "w") as f:
            f.write(text)
        return str(path)

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


__all__ = ["ApiServer", "Store", "ApiError", "KINDS", "now"]
