"""Turns a process into one rank of an SPMD run, as ``python train.py`` under torchrun would be.

Two ways in, one behaviour:

* warm: a child forked from a zygote that has already imported torch calls
  :func:`become_rank`; environment, cwd, ``sys.argv``, ``sys.path[0]``, ``__main__``,
  stdio and thread settings are reset to what a fresh interpreter would have;
* cold: a fresh interpreter runs ``python -m monarch_cli.runtime.launcher`` with the rank
  spec in ``$MONARCH_RANK_SPEC`` (removed before user code runs).

Rank 0 may be handed an already-listening socket for the rendezvous store, so the master
port is never chosen by binding, closing and hoping (torchrun's agent-store contract).
"""

from __future__ import annotations

import atexit
import io
import json
import os
import runpy
import signal
import sys
import threading
from typing import Any, Dict, List, Optional

SPEC_ENV = "MONARCH_RANK_SPEC"
_store: Any = None  # keeps the rendezvous store alive for the whole run


def _reset_stdio(unbuffered: bool) -> None:
    """Recreate sys.stdin/out/err on fds 0/1/2 the way interpreter start-up does."""

    def make(fd: int, errors: str, line_buffering: bool) -> io.TextIOWrapper:
        raw = io.FileIO(fd, "w", closefd=False)
        if unbuffered:
            return io.TextIOWrapper(raw, encoding="utf-8", errors=errors, write_through=True)
        return io.TextIOWrapper(io.BufferedWriter(raw), encoding="utf-8", errors=errors, line_buffering=line_buffering)

    sys.stdout = sys.__stdout__ = make(1, "strict", os.isatty(1))
    sys.stderr = sys.__stderr__ = make(2, "backslashreplace", True)
    sys.stdin = sys.__stdin__ = io.TextIOWrapper(io.BufferedReader(io.FileIO(0, "r", closefd=False)), encoding="utf-8")


def _host_store(listen_fd: int, env: Dict[str, str]) -> None:
    """Serve the rendezvous store on the socket the agent already bound (rank 0 only)."""
    global _store
    try:
        from datetime import timedelta

        from torch.distributed import TCPStore
    except Exception:  # noqa: BLE001 - no torch: the port was only reserved, free it
        os.close(listen_fd)
        return
    _store = TCPStore(
        env["MASTER_ADDR"],
        int(env["MASTER_PORT"]),
        world_size=int(env["WORLD_SIZE"]),
        is_master=True,
        timeout=timedelta(seconds=900),
        wait_for_workers=False,
        multi_tenant=True,
        master_listen_fd=listen_fd,
        use_libuv=True,
    )


def _apply_threads(env: Dict[str, str]) -> None:
    """A warm zygote imported torch before OMP_NUM_THREADS was set; apply it now."""
    torch = sys.modules.get("torch")
    value = env.get("OMP_NUM_THREADS")
    if torch is not None and value and value.isdigit() and int(value) > 0:
        torch.set_num_threads(int(value))


def _finish(code: int) -> "int":
    """What interpreter shutdown does: join threads, run atexit, flush."""
    try:
        threading._shutdown()  # type: ignore[attr-defined]
    except Exception:  # noqa: BLE001
        pass
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:  # noqa: BLE001
            pass
    return code


def _exit_code(e: SystemExit) -> int:
    if e.code is None:
        return 0
    if isinstance(e.code, int):
        return e.code & 0xFF
    print(e.code, file=sys.stderr)
    return 1


def run_program(spec: Dict[str, Any]) -> int:
    """Run the user's program in this (already prepared) process; returns its exit status.

    With ``post_mortem``, an uncaught exception leaves the rank in pdb at the failing frame
    (reachable with ``monarch debug``) before it exits.
    """
    mode, program = spec["mode"], list(spec["program"])
    try:
        if mode == "script":
            path = program[0]
            sys.argv = program
            sys.path[0] = os.path.dirname(os.path.abspath(path))
            runpy.run_path(path, run_name="__main__")
        elif mode == "module":
            sys.argv = [program[0], *program[1:]]
            sys.path[0] = os.getcwd()
            runpy.run_module(program[0], run_name="__main__", alter_sys=True)
        else:
            raise ValueError(f"unknown mode {mode!r}")
    except SystemExit as e:
        return _finish(_exit_code(e))
    except KeyboardInterrupt:
        import traceback

        traceback.print_exc()
        return _finish(128 + signal.SIGINT)
    except BaseException:  # noqa: BLE001 - the interpreter's own behaviour: traceback, status 1
        import traceback

        traceback.print_exc()
        if spec.get("post_mortem") and "monarch_cli.runtime.debugger" in sys.modules:
            from . import debugger

            sys.stderr.flush()
            debugger.post_mortem(sys.exc_info()[2])
        return _finish(1)
    return _finish(0)


def become_rank(spec: Dict[str, Any], extra: Dict[str, int]) -> int:
    """Warm path: reset this forked child to a fresh interpreter's state, then run.

    ``extra`` holds inherited fds by role: ``listen`` (rank 0's store socket), ``debug``.
    """
    listen_fd = extra.get("listen")
    os.setsid()  # own process group: signals reach the rank and its children together
    env: Dict[str, str] = spec["env"]
    os.environ.clear()
    os.environ.update(env)
    os.chdir(spec["cwd"])
    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    _reset_stdio(unbuffered=bool(env.get("PYTHONUNBUFFERED")))
    _apply_threads(env)
    if spec["mode"] == "no_python":
        _exec(spec, extra)
    _install_debugger(extra.get("debug"))
    if listen_fd is not None:
        _host_store(listen_fd, env)
    return run_program(spec)


def _install_debugger(fd: Optional[int]) -> None:
    if fd is not None:
        from . import debugger

        debugger.install(fd)


def cold_command(spec: Dict[str, Any]) -> List[str]:
    """The command line of a cold rank (the spec travels in the environment)."""
    if spec["mode"] == "no_python":
        return list(spec["program"])
    return [sys.executable, *spec.get("python_args", []), "-m", "monarch_cli.runtime.launcher"]


def exec_cold(spec: Dict[str, Any], extra: Dict[str, int]) -> None:
    """Cold path, in a forked child: replace this process with a fresh interpreter."""
    os.setsid()
    os.chdir(spec["cwd"])
    env = dict(spec["env"])
    if spec["mode"] == "no_python":
        _exec(spec, extra)
    for fd in extra.values():
        os.set_inheritable(fd, True)
    env[SPEC_ENV] = json.dumps({**spec, "extra_fds": extra})
    os.execve(sys.executable, cold_command(spec), env)


def _exec(spec: Dict[str, Any], extra: Dict[str, int]) -> None:
    for fd in extra.values():
        os.close(fd)
    program = spec["program"]
    try:
        os.execvpe(program[0], program, spec["env"])
    except OSError as e:
        print(f"monarch: cannot execute {program[0]}: {e.strerror}", file=sys.stderr, flush=True)
        os._exit(127)


def main() -> int:
    spec = json.loads(os.environ.pop(SPEC_ENV))
    extra = spec.pop("extra_fds", {})
    listen_fd = extra.get("listen")
    _apply_threads(spec["env"])
    _install_debugger(extra.get("debug"))
    if listen_fd is not None:
        _host_store(listen_fd, spec["env"])
    return run_program(spec)


if __name__ == "__main__":
    code = main()
    sys.stdout.flush()
    os._exit(code)
