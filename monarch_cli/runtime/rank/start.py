"""Turns a process into one rank of an SPMD run, as ``python train.py`` under torchrun would be.

Two ways in, one behaviour:

* warm: a child forked from a zygote that has already imported torch calls
  :func:`become_rank`; environment, cwd, ``sys.argv``, ``sys.path[0]``, ``__main__``,
  stdio and thread settings are reset to what a fresh interpreter would have;
* cold: a fresh interpreter runs ``python -m monarch_cli.runtime.rank.start`` with the rank
  spec in ``$MONARCH_RANK_SPEC`` (removed before user code runs).

Rank 0 may be handed an already-listening socket for the rendezvous store, so the master
port is never chosen by binding, closing and hoping (torchrun's agent-store contract).
"""

from __future__ import annotations

import functools
import io
import json
import os
import runpy
import signal
import sys
import time
from typing import TYPE_CHECKING, Any

from ...config import RANK_SPEC_ENV
from ...shutdown import run_exit_steps
from ..title import rank_title, set_title

if TYPE_CHECKING:
    from ..protocol import RankSpec

SPEC_ENV = RANK_SPEC_ENV
_store: Any = None  # keeps the rendezvous store alive for the whole run


def _stdio_codec(env: dict[str, str]) -> tuple[str, str]:
    """The encoding and error handler interpreter start-up picks for stdin/stdout (PEP 538/540)."""
    import codecs
    import locale

    try:
        locale.setlocale(locale.LC_CTYPE, "")  # start-up reads LC_CTYPE from the rank's environment
    except locale.Error:
        pass
    name = locale.setlocale(locale.LC_CTYPE)
    legacy = name in ("C", "POSIX")
    encoding = "utf-8" if sys.flags.utf8_mode or legacy else locale.getpreferredencoding(False)
    if codecs.lookup(encoding).name == "utf-8":
        encoding = "utf-8"
    lenient = sys.flags.utf8_mode or legacy or name in ("C.UTF-8", "C.utf8", "UTF-8")
    errors = "surrogateescape" if lenient else "strict"
    forced_encoding, _, forced_errors = env.get("PYTHONIOENCODING", "").partition(":")
    return forced_encoding or encoding, forced_errors or errors


def _reset_stdio(unbuffered: bool, env: dict[str, str]) -> None:
    """Recreate sys.stdin/out/err on fds 0/1/2 the way interpreter start-up does."""
    encoding, errors = _stdio_codec(env)

    def make(fd: int, name: str, errors: str) -> io.TextIOWrapper:
        write = fd != 0
        raw = io.FileIO(fd, "wb" if write else "rb", closefd=False)
        raw.name = name
        buf: Any = raw if unbuffered and write else io.BufferedWriter(raw) if write else io.BufferedReader(raw)
        line_buffering = not unbuffered and (raw.isatty() or fd == 2)
        return io.TextIOWrapper(
            buf, encoding=encoding, errors=errors, newline="\n", line_buffering=line_buffering, write_through=unbuffered
        )

    # typeshed declares sys.__stdin__ and the others Final (the streams the interpreter started
    # with); this stands in for that start-up in a forked child, so it sets them as start-up does
    sys.stdin = sys.__stdin__ = make(0, "<stdin>", errors)  # type: ignore[misc]
    sys.stdout = sys.__stdout__ = make(1, "<stdout>", errors)  # type: ignore[misc]
    sys.stderr = sys.__stderr__ = make(2, "<stderr>", "backslashreplace")  # type: ignore[misc]


def _host_store(listen_fd: int, env: dict[str, str]) -> None:
    """Serve the rendezvous store on the socket the agent already bound (rank 0 only), once the
    script imports ``torch.distributed``: a script that never does never loads torch for it
    (the other ranks' connections wait in the socket's backlog until then)."""
    from .import_watch import after_import

    after_import("torch.distributed", lambda: _start_store(listen_fd, env))


def _start_store(listen_fd: int, env: dict[str, str]) -> None:
    global _store
    try:
        from datetime import timedelta

        from torch.distributed import TCPStore
    except Exception:  # noqa: BLE001 - a torch without distributed: the port was only reserved, free it
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


def _apply_threads(env: dict[str, str]) -> None:
    """A warm zygote imported torch before OMP_NUM_THREADS was set; apply it now."""
    torch = sys.modules.get("torch")
    value = env.get("OMP_NUM_THREADS")
    if torch is not None and value and value.isdigit() and int(value) > 0:
        torch.set_num_threads(int(value))


def _finish(code: int) -> int:
    """What interpreter shutdown does: join threads, run atexit, flush (a kept rank: for what its
    run made, :class:`.keep.KeptRun`)."""
    kept = sys.modules.get("monarch_cli.runtime.rank.keep")
    if kept is not None and kept.current is not None:
        kept.current.finish()
    else:
        run_exit_steps()
    return code


def _exit_code(e: SystemExit) -> int:
    if e.code is None:
        return 0
    if isinstance(e.code, int):
        return e.code & 0xFF
    print(e.code, file=sys.stderr)
    return 1


def _run_script(path: str) -> None:
    """What ``python path`` does: run the file as a ``__main__`` module that stays in sys.modules
    (so atexit handlers and threads still find it).

    ``__file__`` and the code's file name are absolute, as python >= 3.9 makes them.
    """
    import builtins
    import types
    import zipfile
    from importlib.machinery import SourceFileLoader

    if os.path.isdir(path) or zipfile.is_zipfile(path):  # a directory or zip with __main__.py
        runpy.run_path(path, run_name="__main__")
        return
    path = os.path.abspath(path)
    with io.open_code(path) as f:
        source = f.read()
    kept = sys.modules.get("monarch_cli.runtime.rank.keep")
    if kept is not None and kept.current is not None:
        code = kept.cached_compile(path, source)  # the same code objects while the file is unchanged
    else:
        code = compile(source, path, "exec", dont_inherit=True)
    main = types.ModuleType("__main__")
    main.__dict__.update(
        __file__=path, __cached__=None, __builtins__=builtins, __loader__=SourceFileLoader("__main__", path)
    )
    if kept is not None and kept.current is not None:
        kept.carry_compiled("__main__", path, main.__dict__)  # what torch.compile left in the last run's
    sys.modules["__main__"] = main
    exec(code, main.__dict__)


def _run_module(name: str) -> None:
    """What ``python -m name`` does, in a fresh ``__main__`` module that stays in sys.modules."""
    import builtins
    import types

    main = types.ModuleType("__main__")
    main.__builtins__ = builtins  # type: ignore[attr-defined]
    sys.modules["__main__"] = main
    runpy._run_module_as_main(name, alter_argv=True)  # type: ignore[attr-defined]


def _print_traceback() -> None:
    """The uncaught exception's traceback from the user's first frame on, as python prints it."""
    import traceback

    etype, value, tb = sys.exc_info()
    ours = {_run_script.__code__.co_filename, runpy.__file__, "<frozen runpy>"}
    while tb is not None and tb.tb_frame.f_code.co_filename in ours:
        tb = tb.tb_next  # none left: a syntax error in the script, printed without a stack
    traceback.print_exception(etype, value, tb)


def run_program(spec: RankSpec) -> int:
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
            if not os.path.exists(path):
                print(
                    f"{sys.executable}: can't open file {os.path.abspath(path)!r}: [Errno 2] No such file or directory",
                    file=sys.stderr,
                )
                return _finish(2)
            _run_script(path)
        elif mode == "module":
            sys.argv = [program[0], *program[1:]]
            sys.path[0] = os.getcwd()
            _run_module(program[0])
        else:
            raise ValueError(f"unknown mode {mode!r}")
    except SystemExit as e:
        return _finish(_exit_code(e))
    except KeyboardInterrupt:
        _print_traceback()
        _finish(0)
        _die_of_sigint()
        return 128 + signal.SIGINT
    except BaseException:  # noqa: BLE001 - the interpreter's own behaviour: traceback, status 1
        _print_traceback()
        rank_debug = sys.modules.get("monarch_cli.runtime.rank.debug")
        if spec.get("post_mortem") and rank_debug is not None and rank_debug.installed():
            sys.stderr.flush()
            rank_debug.post_mortem(sys.exc_info()[2])
        return _finish(1)
    return _finish(0)


def _die_of_sigint() -> None:
    """What python does after an uncaught KeyboardInterrupt (3.8+): end by SIGINT itself, so the
    rank is reported as killed by SIGINT, as under torchrun or in a shell, not as exit 130."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})
    os.kill(os.getpid(), signal.SIGINT)


def become_rank(spec: RankSpec, extra: dict[str, int]) -> int:
    """Warm path: reset this forked child to a fresh interpreter's state, then run.

    ``extra`` holds inherited fds by role: ``listen`` (rank 0's store socket), ``debug``.
    """
    from . import cuda_ready, fresh, preload

    conflict = preload.env_conflict(spec["env"])
    if conflict is not None:  # a fresh interpreter is the only way to give the rank what it asks for
        os.write(2, f"monarch: rank {spec['rank']} starts cold: {conflict}\n".encode())
        exec_cold(spec, extra)
    _leave_warm_finalizers()
    listen_fd = extra.get("listen")
    if os.getsid(0) != os.getpid():  # (a kept rank leads its session already)
        os.setsid()  # own process group: signals reach the rank and its children together
    env: dict[str, str] = spec["env"]
    os.environ.clear()
    os.environ.update(env)
    preload.apply_environment()
    _apply_start_up_env(env)
    os.chdir(spec["cwd"])
    _default_signals()
    signal.signal(signal.SIGINT, signal.default_int_handler)
    old_streams = (sys.stdout, sys.stderr)
    _reset_stdio(bool(env.get("PYTHONUNBUFFERED")) or "-u" in spec.get("python_args", ()), env)
    _apply_threads(env)
    fresh.reset(old_streams)  # seeds, loggers, frameworks' import-time state (docs/spmd.md)
    if spec["mode"] == "no_python":
        _exec(spec, extra)
    set_title(rank_title(spec["rank"], spec["mode"], spec["program"]))
    _install_telemetry(spec)
    _install_debugger(extra.get("debug"))
    _settle_gloo_teardown()
    if listen_fd is not None:
        _host_store(listen_fd, env)
    cuda_ready.start(spec)
    if spec.get("keep"):
        from . import keep

        keep.current = keep.KeptRun(spec)
    code = run_program(spec)
    preload.report_imports(spec)  # after interpreter-shutdown work: it is not the user's time
    return code


def keep_for_next(spec: RankSpec) -> bool:
    """At a kept rank's end, before it is reported: whether it can be kept for the next run;
    False, with one line on its stderr saying why, if its run left what cannot be reset."""
    from . import keep

    run = keep.current
    if run is None:
        return False
    try:
        why = run.check()
    except Exception as e:  # noqa: BLE001 - whatever broke, a fresh process is the safe answer
        why = f"checking it failed ({type(e).__name__}: {e})"
    if why is not None:
        keep.current = None
        print(f"monarch: rank {spec['rank']} is not kept for the next run: {why}", file=sys.stderr, flush=True)
        return False
    return True


def reset_kept() -> bool:
    """After a kept rank's end was reported: put the process back (its process group destroyed,
    its workspace modules dropped...); False if that failed (it then exits: the next run forks)."""
    from . import keep

    run, keep.current = keep.current, None
    try:
        return run is not None and run.reset() is None
    except Exception:  # noqa: BLE001 - a fresh process is the safe answer
        return False


def _apply_start_up_env(env: dict[str, str]) -> None:
    """What a fresh interpreter would have taken from these variables at start-up, set now
    (agent_ranks._SET_IN_A_WARM_RANK: they do not make a run cold)."""
    sys.dont_write_bytecode = bool(env.get("PYTHONDONTWRITEBYTECODE"))
    sys.pycache_prefix = env.get("PYTHONPYCACHEPREFIX") or None
    try:
        sys.set_int_max_str_digits(int(env.get("PYTHONINTMAXSTRDIGITS") or 4300))
    except (ValueError, AttributeError):
        pass
    import faulthandler

    if env.get("PYTHONFAULTHANDLER"):
        faulthandler.enable()
    elif faulthandler.is_enabled():
        faulthandler.disable()


def _leave_warm_finalizers() -> None:
    """torch.library's exit-time finalizers (one per operator library the warm process
    registered, ~130) only undo registrations in a process about to end: ~30 ms at each
    rank's exit here. A warm rank leaves them to the warm process; its own run at exit."""
    import weakref

    for finalizer, info in list(getattr(weakref.finalize, "_registry", {}).items()):
        if getattr(info.func, "__module__", None) == "torch.library" and info.func.__name__ == "_del_library":
            finalizer.atexit = False


#: How long ``destroy_process_group`` lets the group's worker threads settle (warm ranks).
GLOO_SETTLE_S = 0.005


def _settle_gloo_teardown() -> None:
    """Give the process group's worker threads a moment before a warm rank destroys it.

    A gloo worker frees each finished collective's tensors just after the caller has been
    told it is done. If the caller is quick enough to drop its last reference to those
    tensors and then free the group (DDP's reducer, when ``main()`` returns), the worker needs
    the GIL that the group's destructor holds while it joins the worker: a deadlock in torch
    (pytorch/pytorch#56297). A cold rank is rarely quick enough (its first
    ``destroy_process_group()`` still imports modules); a warm rank that holds what the script
    imported hit it in about 1 run of 3 (tests/jobs/test_warm_preload.py). 5 ms of sleep
    before the group is destroyed lets the workers finish first: 0 hangs in the same trials.
    """
    dist = sys.modules.get("torch.distributed")
    original = getattr(dist, "destroy_process_group", None)
    if original is None or getattr(original, "_monarch_settles", False):
        return

    @functools.wraps(original)
    def destroy_process_group(*args: Any, **kwargs: Any) -> Any:
        time.sleep(GLOO_SETTLE_S)
        return original(*args, **kwargs)

    destroy_process_group._monarch_settles = True  # type: ignore[attr-defined]
    dist.destroy_process_group = destroy_process_group  # type: ignore[union-attr]


def _install_telemetry(spec: RankSpec) -> None:
    if spec.get("telemetry"):
        from . import telemetry as rank_telemetry

        rank_telemetry.install(spec)


def _install_debugger(fd: int | None) -> None:
    if fd is not None:
        from . import debug as rank_debug

        rank_debug.install(fd)


def cold_command(spec: RankSpec) -> list[str]:
    """The command line of a cold rank (the spec travels in the environment)."""
    if spec["mode"] == "no_python":
        return list(spec["program"])
    return [sys.executable, *spec.get("python_args", []), "-m", "monarch_cli.runtime.rank.start"]


def _default_signals() -> None:
    """Dispositions as a fresh process from a terminal has them: an ignored signal is inherited
    across fork and exec. The agent ignores SIGUSR1/2 (Slurm signals every step); one served
    from a background job or under nohup inherited SIGINT/SIGQUIT/SIGHUP ignored (a cold rank
    would then shrug off Ctrl-C's SIGINT)."""
    for sig in (signal.SIGTERM, signal.SIGUSR1, signal.SIGUSR2, signal.SIGHUP, signal.SIGINT, signal.SIGQUIT):
        signal.signal(sig, signal.SIG_DFL)


def exec_cold(spec: RankSpec, extra: dict[str, int]) -> None:
    """Cold path, in a forked child: replace this process with a fresh interpreter."""
    os.setsid()
    _default_signals()
    os.chdir(spec["cwd"])
    env = dict(spec["env"])
    if spec["mode"] == "no_python":  # Python ignores these (a Python rank ignores them again itself);
        for sig in (signal.SIGPIPE, signal.SIGXFSZ):  # a program expects them as subprocess restores them
            signal.signal(sig, signal.SIG_DFL)
        _exec(spec, extra)
    for fd in extra.values():
        os.set_inheritable(fd, True)
    env[SPEC_ENV] = json.dumps({**spec, "extra_fds": extra})
    os.execve(sys.executable, cold_command(spec), env)


def _exec(spec: RankSpec, extra: dict[str, int]) -> None:
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
    set_title(rank_title(spec["rank"], spec["mode"], spec["program"]))
    _apply_threads(spec["env"])
    _install_telemetry(spec)
    _install_debugger(extra.get("debug"))
    if listen_fd is not None:
        _host_store(listen_fd, spec["env"])
    return run_program(spec)


if __name__ == "__main__":
    code = main()
    sys.stdout.flush()
    os._exit(code)
