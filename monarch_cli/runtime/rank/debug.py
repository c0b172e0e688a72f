"""The rank's side of remote debugging: ``breakpoint()`` becomes a pdb served over a socket.

Each rank gets one end of a socketpair from its agent. ``breakpoint()``, ``pdb.set_trace()``
and post-mortem open a :class:`RemotePdb` whose stdin and stdout are messages on that
socket; the agent relays them to whichever ``monarch debug`` client is attached and keeps
what nobody has seen yet. A daemon thread reads the socket, so a DAP (debugpy) request is
served whether or not the rank is paused. With no client attached, a paused rank simply
waits for input. For DAP, debugpy connects out to the agent, which relays it over the
authenticated runtime: the rank listens on no port.
"""

from __future__ import annotations

import code
import contextlib
import json
import os
import pdb
import queue
import socket
import sys
import threading
from types import FrameType, TracebackType
from typing import IO, Any, cast

_chan: socket.socket | None = None
_send_lock = threading.Lock()
_lines: queue.Queue[str | None] = queue.Queue()
_DAP_HANDOFF = "\x00monarch-dap\x00"
#: Characters per output message: JSON escapes a character in up to 12 bytes (an astral one as
#: two \uXXXX), and the agent reads a packet of at most 64 KiB (16,000 'é' were 96 KB: the agent
#: died on the cut JSON, and the reservation with it).
_CHUNK = 5000
_dap_connecting = False  # debugpy connects to the agent once; that connection serves every IDE session
_dap_configured = threading.Event()  # the first IDE has configured debugpy (or connecting failed)
_dap_failed = False


def _send(msg: dict[str, Any], wait: bool = True) -> None:
    """One JSON message per packet; long output is split into several output messages.
    ``wait=False``: give up at once rather than wait for the lock or the socket."""
    if _chan is None:
        return
    if msg["type"] == "output" and len(msg["data"]) > _CHUNK:
        for i in range(0, len(msg["data"]), _CHUNK):
            _send({"type": "output", "data": msg["data"][i : i + _CHUNK]}, wait)
        return
    if not _send_lock.acquire(timeout=-1 if wait else 0.05):
        return
    try:
        _chan.send(json.dumps(msg).encode(), 0 if wait else socket.MSG_DONTWAIT)
    except OSError:
        pass
    finally:
        _send_lock.release()


class _Input:
    """pdb's stdin: lines from the attached client (blocks while nobody types)."""

    def readline(self) -> str:
        line = _lines.get()
        return "" if line is None else line


class _Output:
    """pdb's stdout: every write is an output message."""

    encoding = "utf-8"

    def write(self, text: str) -> int:
        if text:
            _send({"type": "output", "data": text})
        return len(text)

    def flush(self) -> None:
        pass


class RemotePdb(pdb.Pdb):
    def __init__(self, reason: str = "breakpoint") -> None:
        # pdb (cmd.Cmd) only reads lines from stdin and writes and flushes stdout; typeshed asks for a full IO[str]
        super().__init__(stdin=cast(IO[str], _Input()), stdout=cast(IO[str], _Output()), nosigint=True, readrc=False)
        self.use_rawinput = False
        self.reason = reason
        self._handoff = False
        self._handed_over = False

    def set_trace(self, frame: FrameType | None = None) -> None:
        """bdb's set_trace, but tracing (and the visible stack) stops at the user's outermost frame."""
        if frame is None:
            frame = sys._getframe().f_back
        bottom = _user_bottom(frame)
        self.reset()
        while frame is not None:
            frame.f_trace = self.trace_dispatch
            self.botframe = frame
            if frame is bottom:
                break
            frame = frame.f_back
        self.set_step()
        sys.settrace(self.trace_dispatch)

    def dispatch_return(self, frame: FrameType, arg: Any) -> Any:
        result = super().dispatch_return(frame, arg)
        if frame is self.botframe and not self._handed_over:
            self.set_continue()  # the user's program is over: nothing of it is left to step into
        return result

    def trace_dispatch(self, frame: FrameType, event: str, arg: Any) -> Any:
        result = super().trace_dispatch(frame, event, arg)
        if self._handed_over:
            # CPython makes this return value the frame's tracer: keep debugpy's, not ours.
            tracer = frame.f_trace
            return tracer if tracer is not None and tracer != self.trace_dispatch else None
        return result

    def interaction(self, frame: FrameType | None, tb: TracebackType | None) -> None:
        where = frame if frame is not None else _last_frame(tb)
        _send(
            {
                "type": "paused",
                "file": where.f_code.co_filename if where else "?",
                "line": where.f_lineno if where else 0,
                "function": where.f_code.co_name if where else "?",
                "reason": self.reason,
            }
        )
        try:
            super().interaction(frame, tb)
        finally:
            if self._handoff:
                self._hand_over_to_dap()
            _send({"type": "resumed"})

    def onecmd(self, line: str) -> bool:
        if line.strip() == _DAP_HANDOFF:
            # Leave the command loop without pdb's set_continue, whose sys.settrace(None)
            # would pull tracing from under debugpy.
            self._handoff = True
            self.clear_all_breaks()
            self.stopframe, self.returnframe, self.quitting = self.botframe, None, False
            return True
        return super().onecmd(line)

    def do_interact(self, arg: str) -> None:
        """Like pdb's ``interact``, but over the remote session."""
        assert self.curframe is not None, "pdb runs a command while stopped in a frame"
        ns = {**self.curframe.f_globals, **self.curframe_locals}
        console = code.InteractiveConsole(ns)

        def raw_input(prompt: str = "") -> str:
            self.stdout.write(prompt)
            line = _lines.get()
            if line is None or line == "\x04\n":
                raise EOFError
            return line.rstrip("\n")

        def write(data: str) -> None:
            self.stdout.write(data)

        console.raw_input = raw_input  # type: ignore[method-assign]
        console.write = write  # type: ignore[method-assign]
        with contextlib.redirect_stdout(self.stdout), contextlib.redirect_stderr(self.stdout):
            console.interact("*interactive*", exitmsg="")

    def _hand_over_to_dap(self) -> None:
        """Wait for the IDE, then let debugpy trace this thread in pdb's place."""
        import debugpy

        frame: FrameType | None = sys._getframe()
        while frame is not None:
            frame.f_trace = None
            frame = frame.f_back
        _dap_configured.wait()  # debugpy.connect returns once the first IDE is configured
        if _dap_failed:
            return  # no debugger after all: the rank runs on
        debugpy.wait_for_client()  # at once for the first IDE; a later one: once it is configured
        debugpy.debug_this_thread()  # installs its tracer on this thread's frames
        self._handed_over = True


_OURS = os.path.dirname(os.path.abspath(__file__))


def _is_ours(frame: FrameType) -> bool:
    name = frame.f_code.co_filename
    return name.startswith(_OURS) or name.startswith("<frozen runpy")


def _user_bottom(frame: FrameType | None) -> FrameType | None:
    """The user's outermost frame: pdb's stack (``w``, ``u``) stops there, as under ``python script.py``."""
    bottom = frame
    while frame is not None and not _is_ours(frame):
        bottom, frame = frame, frame.f_back
    return bottom


def _user_traceback(tb: TracebackType | None) -> TracebackType | None:
    while tb is not None and tb.tb_next is not None and _is_ours(tb.tb_frame):
        tb = tb.tb_next
    return tb


def _last_frame(tb: TracebackType | None) -> FrameType | None:
    while tb is not None and tb.tb_next is not None:
        tb = tb.tb_next
    return tb.tb_frame if tb is not None else None


def _breakpointhook(*args: Any, **kwargs: Any) -> None:
    hook = os.environ.get("PYTHONBREAKPOINT")
    if hook == "0":
        return
    RemotePdb().set_trace(sys._getframe().f_back)


def _set_trace(*, header: str | None = None) -> None:
    debugger = RemotePdb()
    if header is not None:
        debugger.message(header)
    debugger.set_trace(sys._getframe().f_back)


def post_mortem(tb: TracebackType | None) -> None:
    """Keep the rank in pdb at the failing frame until the user lets it go."""
    debugger = RemotePdb(reason="post-mortem")
    debugger.reset()
    debugger.interaction(None, _user_traceback(tb))


def _serve_dap(msg: dict[str, Any]) -> None:
    """Connect debugpy out to the agent (never listen: a port here would be open to every local user)."""
    global _dap_connecting
    if not _dap_connecting:
        try:
            os.environ.setdefault("PYDEVD_DISABLE_FILE_VALIDATION", "1")  # no frozen-modules nag in the rank's output
            import debugpy  # noqa: F401
        except Exception as e:  # noqa: BLE001 - reported to the user who asked
            _send({"type": "dap_error", "error": f"{type(e).__name__}: {e}"})
            return
        _dap_connecting = True
        threading.Thread(target=_connect_dap, args=(int(msg["port"]),), name="monarch-dap", daemon=True).start()
    _send({"type": "dap_ready", "cwd": os.getcwd()})
    if msg.get("handoff"):
        _lines.put(_DAP_HANDOFF + "\n")


def _connect_dap(port: int) -> None:
    import debugpy

    try:
        # Not into the rank's subprocesses (DataLoader workers...): they would dial a port that is closed by then.
        debugpy.configure(subProcess=False)
        debugpy.connect(("127.0.0.1", port))  # the agent's same-user-only listener; returns once the IDE is configured
    except Exception as e:  # noqa: BLE001 - reported to the user who asked
        global _dap_failed
        _dap_failed = True
        _send({"type": "dap_error", "error": f"{type(e).__name__}: {e}"})
    finally:
        _dap_configured.set()


def _service() -> None:
    assert _chan is not None
    while True:
        try:
            data = _chan.recv(1 << 16)
        except OSError:
            data = b""
        if not data:  # the agent is gone: unblock a waiting pdb (it reads EOF and quits)
            _lines.put(None)
            return
        msg = json.loads(data)
        if msg["type"] == "input":
            _lines.put(msg["line"])
        elif msg["type"] == "dap":
            _serve_dap(msg)


def say_exiting(status: int, kept: bool = False) -> None:
    """Tell the agent this rank exits with ``status`` now (its output closed already), so it need
    not wait for the kernel to tear the process down (see ``RankHost.exiting``). Never waits: a
    thread of the script's still sending (it is a daemon, about to die) just means the agent
    learns the status from ``waitpid`` instead."""
    _send({"type": "exiting", "status": status, "kept": kept}, wait=False)


def uninstall() -> None:
    """A kept rank between runs: its channel goes with the run (the next run brings its own)."""
    global _chan
    chan, _chan = _chan, None
    if chan is not None:
        try:
            chan.shutdown(socket.SHUT_RDWR)  # (wakes the service thread's recv: it ends)
        except OSError:
            pass
        chan.close()


def installed() -> bool:
    """Whether this rank's breakpoints go to its agent (warm ranks import this module anyway)."""
    return _chan is not None


def install(fd: int) -> None:
    """Route this rank's breakpoints to the agent over ``fd`` (one end of a socketpair)."""
    global _chan
    _chan = socket.socket(fileno=fd)
    os.set_inheritable(fd, False)  # the user's subprocesses must not hold the session open
    sys.breakpointhook = _breakpointhook
    pdb.set_trace = _set_trace
    threading.Thread(target=_service, name="monarch-debug", daemon=True).start()
