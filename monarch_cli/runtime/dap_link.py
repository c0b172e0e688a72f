"""The pieces of an IDE's DAP (debugpy) link to a rank that only the reservation's holder may use.

A TCP port on 127.0.0.1 is open to every user of the machine, and DAP has no authentication:
whoever connects to a debugpy port can evaluate code in the rank. So no rank ever listens.
The rank's debugpy connects out to its agent, the agent relays whole DAP messages over the
CURVE-authenticated runtime to ``monarch debug --dap``, and that process listens on
loopback for the IDE. Both loopback listeners (the agent's, the client's) accept a peer only
when the kernel says its socket belongs to this process's user (``/proc/net/tcp{,6}``: the
owner's uid and the socket's inode); any other connection is closed before a byte is read.
"""

from __future__ import annotations

import ipaddress
import json
import os
import socket
import sys

LOOPBACK = "127.0.0.1"
_MAX_MESSAGE = 64 << 20  # bytes; a DAP message past this is garbage, not a variable's value


def listen_loopback() -> socket.socket:
    """A listening TCP socket on 127.0.0.1, any free port."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind((LOOPBACK, 0))
    sock.listen(8)
    return sock


def peer_uid(conn: socket.socket) -> int | None:
    """The uid owning the other end of an accepted loopback connection; None if unknown.

    The kernel lists both ends of a loopback connection; the peer's end is the entry whose
    local address is our peer and whose remote address is us. An orphaned socket (its owner
    already closed it) has inode 0 and reports uid 0: it counts as unknown, never as root.
    """
    try:
        peer, local = conn.getpeername()[:2], conn.getsockname()[:2]
    except OSError:
        return None
    want = (_ip(peer[0]), peer[1], _ip(local[0]), local[1])
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            with open(table) as f:
                lines = f.readlines()[1:]
        except OSError:
            continue
        for line in lines:
            fields = line.split()
            if len(fields) < 10:
                continue
            here, there = _endpoint(fields[1]), _endpoint(fields[2])
            if (*here, *there) == want:
                return int(fields[7]) if fields[9] != "0" else None
    return None


def accept_same_user(listener: socket.socket) -> tuple[socket.socket | None, str | None]:
    """Accept one connection: (the socket, None) if its peer is this user, else (None, why refused)."""
    conn, _ = listener.accept()
    uid = peer_uid(conn)
    if uid == os.getuid():
        return conn, None
    conn.close()  # nothing read from it, nothing sent
    who = "an unknown user" if uid is None else f"uid {uid}"
    return (
        None,
        f"refused a debugger connection from {who}: only uid {os.getuid()} (this reservation's holder) may connect",
    )


def _ip(text: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address:
    addr = ipaddress.ip_address(text)
    if isinstance(addr, ipaddress.IPv6Address) and addr.ipv4_mapped is not None:
        return addr.ipv4_mapped
    return addr


def _endpoint(text: str) -> tuple[ipaddress.IPv4Address | ipaddress.IPv6Address, int]:
    """``0100007F:1F90`` (IPv4) or 32 hex digits (IPv6): 32-bit words in host byte order."""
    host, _, port = text.partition(":")
    raw = b"".join(int(host[i : i + 8], 16).to_bytes(4, sys.byteorder) for i in range(0, len(host), 8))
    addr = ipaddress.ip_address(raw)
    if isinstance(addr, ipaddress.IPv6Address) and addr.ipv4_mapped is not None:
        addr = addr.ipv4_mapped
    return addr, int(port, 16)


class DapFrames:
    """Splits a DAP byte stream into whole messages (``Content-Length`` header, then the body).

    The relays forward whole messages only, so an IDE that goes away mid-message never
    leaves the rank's debugger (or the next IDE) a torn one.
    """

    def __init__(self) -> None:
        self._buf = b""

    def feed(self, data: bytes) -> list[bytes]:
        """The messages ``data`` completes; raises ValueError on a stream that is not DAP."""
        self._buf += data
        out: list[bytes] = []
        while True:
            head_end = self._buf.find(b"\r\n\r\n")
            if head_end < 0:
                if len(self._buf) > 4096:
                    raise ValueError("not a DAP stream: no header end in 4 KiB")
                return out
            length = None
            for line in self._buf[:head_end].split(b"\r\n"):
                name, _, value = line.partition(b":")
                if name.strip().lower() == b"content-length":
                    length = int(value.strip())
            if length is None or not 0 <= length <= _MAX_MESSAGE:
                raise ValueError("not a DAP stream: bad Content-Length")
            end = head_end + 4 + length
            if len(self._buf) < end:
                return out
            out.append(self._buf[:end])
            self._buf = self._buf[end:]


def _request(seq: int, command: str) -> bytes:
    body = json.dumps({"seq": seq, "type": "request", "command": command, "arguments": {}}).encode()
    return b"Content-Length: %d\r\n\r\n" % len(body) + body


#: Sent to a rank's debugger for an IDE that went away without a `disconnect`: as when an
#: IDE disconnects, its breakpoints go and the rank runs on.
GOODBYE = _request(1 << 30, "disconnect")


def is_goodbye(message: bytes) -> bool:
    """Is this whole DAP message an IDE's `disconnect` or `terminate` request?"""
    try:
        body = json.loads(message.partition(b"\r\n\r\n")[2])
    except ValueError:
        return False
    return (
        isinstance(body, dict) and body.get("type") == "request" and body.get("command") in ("disconnect", "terminate")
    )
