"""The agent's probe of the other hosts' agents: can this host reach them?

A partition between hosts leaves every agent answering its client while the ranks hang in a
collective; only a host-to-host look shows it. Each probe is a TCP connect to a peer's agent
port, made on a thread (the agent's loop never waits on the network) and answered from the
loop's tick.
"""

from __future__ import annotations

import socket
import threading
from collections.abc import Callable
from typing import TYPE_CHECKING, Any
from urllib.parse import urlsplit

from .. import protocol

if TYPE_CHECKING:
    from .core import AgentCore


def reach(address: str, timeout: float) -> str:
    """ "" when a TCP connection to the agent at ``address`` (``tcp://host:port``) opens, else why not."""
    try:
        parts = urlsplit(address)
        host, port = parts.hostname, parts.port
    except ValueError:
        return f"bad address {address!r}"
    if host is None or port is None:
        return f"bad address {address!r}"
    try:
        with socket.create_connection((host, port), timeout=timeout):
            return ""
    except TimeoutError:
        return f"no answer within {timeout:g} s"
    except OSError as e:
        return e.strerror or type(e).__name__


class PeerProbes:
    def __init__(self, agent: AgentCore) -> None:
        self.agent = agent
        self._done: list[tuple[str, int, dict[str, str]]] = []  # (reply_to, cid, answers), filled by threads
        self._lock = threading.Lock()

    def handlers(self) -> dict[type, Callable[[Any, list[Any]], None]]:
        return {protocol.ProbePeers: lambda msg, _body: self._start(msg)}

    def _start(self, msg: protocol.ProbePeers) -> None:
        peers = [str(p) for p in msg.peers][:4096]
        timeout = min(max(float(msg.timeout), 0.1), 30.0)

        def probe() -> None:
            answers: dict[str, str] = {}
            threads = []
            for peer in peers:
                t = threading.Thread(target=lambda p=peer: answers.__setitem__(p, reach(p, timeout)), daemon=True)
                t.start()
                threads.append(t)
            for t in threads:
                t.join()
            with self._lock:
                self._done.append((msg.reply_to, msg.cid, answers))

        threading.Thread(target=probe, name="monarch-peer-probe", daemon=True).start()

    def tick(self) -> None:
        """Answer the probes that finished (called from the agent's loop)."""
        with self._lock:
            done, self._done = self._done, []
        for reply_to, cid, answers in done:
            self.agent.reply(reply_to, cid, True, answers)
