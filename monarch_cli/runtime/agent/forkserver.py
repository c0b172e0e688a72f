"""The agent's handle on one fork server (a zygote process, :mod:`.zygote`): starting it, asking
it for forks and spares without ever blocking the agent's loop, reading what it reports."""

from __future__ import annotations

import array
import collections
import errno
import os
import pickle
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Sequence
from typing import Any

from ...config import PRELOAD_ENV
from .. import protocol
from ..rank.preload import LEARNED_ENV, READY_ENV


class ForkServerHandle:
    """The agent's handle on a fork server (``preload``: modules it imports up front; ``learned``
    and ``ready``: a warm-rank zygote's learned modules and report file, see :mod:`..rank.preload`)."""

    def __init__(
        self,
        preload: str = "",
        title: str = "monarch fork-server",
        learned: str | None = None,
        ready: str | None = None,
    ) -> None:
        self.sock, child = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        env = {**os.environ, PRELOAD_ENV: preload}
        env.update({k: v for k, v in ((READY_ENV, ready), (LEARNED_ENV, learned)) if v})
        self.process = subprocess.Popen(
            [sys.executable, "-m", "monarch_cli.runtime.agent.zygote", str(child.fileno()), title],
            pass_fds=[child.fileno()],
            stdin=subprocess.DEVNULL,
            env=env,
        )
        child.close()
        self.started = time.monotonic()
        # Requests the socket did not take yet (their fds duplicated): sent as the zygote answers,
        # so asking for hundreds of forks never blocks the agent's loop (nor deadlocks with the
        # zygote's replies).
        self._queued: collections.deque[tuple[bytes, list[int]]] = collections.deque()

    def fork(
        self, req_id: int, boot: protocol.RankSpec | protocol.ProcBoot, fds: Sequence[int] = (), kind: str = "proc"
    ) -> None:
        """Ask for a fork; the caller may close ``fds`` on return (a queued request holds duplicates)."""
        self._ask(protocol.Fork(req_id, kind, boot), list(fds))

    def spares(self, count: int) -> None:
        """Ask a warm zygote to keep ``count`` rank children forked ahead (see :mod:`.zygote`)."""
        self._ask(protocol.Spares(count), [])

    def learn_more(self, learned: str, ready: str) -> None:
        """Ask a warm zygote with no rank running to import more in place (see :class:`~..protocol.LearnMore`)."""
        self._ask(protocol.LearnMore(learned, ready), [])

    def _ask(self, msg: Any, fds: list[int]) -> None:
        """Send now if nothing is queued before it and the socket takes it, else queue it."""
        data = pickle.dumps(protocol.header(msg))
        if not self._queued and self._send(data, fds):
            return
        self._queued.append((data, [os.dup(fd) for fd in fds]))

    def _send(self, data: bytes, fds: list[int]) -> bool:
        try:
            # (socket.send_fds ignores its flags before Python 3.12)
            ancillary = [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", fds))] if fds else []
            self.sock.sendmsg([data], ancillary, socket.MSG_DONTWAIT)
        except (BlockingIOError, InterruptedError):
            return False
        except OSError as e:
            if e.errno == errno.ETOOMANYREFS:  # too many fds in flight: the zygote is reading them
                return False
            raise
        return True

    def _flush(self) -> None:
        while self._queued:
            data, fds = self._queued[0]
            try:
                if not self._send(data, fds):
                    return
            except OSError:  # it is gone: its socket closing says so
                return
            self._queued.popleft()
            for fd in fds:
                os.close(fd)

    def _drop_queued(self) -> None:
        while self._queued:
            for fd in self._queued.popleft()[1]:
                os.close(fd)

    def receive(self) -> Any | None:
        """The zygote's next message (:class:`~..protocol.Forked`, ``ChildExited``, ``WarmReady``);
        None once it is gone."""
        try:
            data = self.sock.recv(1 << 16)
        except ConnectionResetError:  # it died with our last request unread
            data = b""
        if not data:
            self._drop_queued()
            return None
        self._flush()  # it read a request (or a child exited): room for what waits
        return protocol.decode(pickle.loads(data))

    def kill(self) -> None:
        try:
            self.process.kill()
        except ProcessLookupError:
            pass

    def how_it_died(self) -> str:
        """``signal SIGKILL`` or ``exit 1``, once its socket has closed."""
        try:
            code = self.process.wait(timeout=2)
        except subprocess.TimeoutExpired:  # closed its socket but lives on: useless, end it
            self.kill()
            code = self.process.wait()
        if code < 0:
            try:
                return f"signal {signal.Signals(-code).name}"
            except ValueError:
                return f"signal {-code}"
        return f"exit {code}"
