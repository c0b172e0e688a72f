"""Ctrl-C at a `monarch debug` prompt: the guard against SIGINTs that readline never notices."""

from __future__ import annotations

import sys
import textwrap
from pathlib import Path

import pexpect
import pytest

# A SIGINT handled on another thread sets Python's "signal pending" flag while the main thread is
# already waiting in readline's select(); it is the same state as a Ctrl-C pressed just before
# input() starts waiting (a rank's answer still printing), only reproducible every time.
CHILD = textwrap.dedent("""\
    import contextlib, signal, sys, threading, time
    import readline
    from monarch_cli.cli.interrupts import reliable_ctrl_c

    def interrupt_from_another_thread():
        time.sleep(0.3)
        signal.pthread_kill(threading.get_ident(), signal.SIGINT)

    guard = reliable_ctrl_c() if sys.argv[1] == "guarded" else contextlib.nullcontext()
    with guard:
        threading.Thread(target=interrupt_from_another_thread, daemon=True).start()
        try:
            input("first> ")
        except KeyboardInterrupt:
            print("interrupted")
        print("got", input("second> "))
    print("restored", signal.getsignal(signal.SIGINT) is signal.default_int_handler, signal.set_wakeup_fd(-1))
""")


def _spawn(tmp_path: Path, mode: str) -> pexpect.spawn:
    script = tmp_path / "child.py"
    script.write_text(CHILD)
    return pexpect.spawn(sys.executable, [str(script), mode], encoding="utf-8", timeout=10)


def test_ctrl_c_reaches_a_prompt_even_when_readline_misses_it(tmp_path: Path) -> None:
    child = _spawn(tmp_path, "guarded")
    child.expect_exact("interrupted")
    # Exactly one KeyboardInterrupt: the next prompt takes input normally.
    child.expect_exact("second> ")
    child.sendline("hello")
    child.expect_exact("got hello")
    child.expect_exact("restored True -1")
    child.expect(pexpect.EOF)


def test_without_the_guard_that_ctrl_c_is_lost(tmp_path: Path) -> None:
    """The condition the guard exists for is real: plain input() sits there (CPython 3.10-3.13).

    If a future CPython checks pending signals before select(), this fails and the guard can go.
    """
    child = _spawn(tmp_path, "plain")
    with pytest.raises(pexpect.TIMEOUT):
        child.expect_exact("interrupted", timeout=2)
    child.sendline("")  # the next key press is what finally delivers it
    child.expect_exact("interrupted")
    child.terminate(force=True)
