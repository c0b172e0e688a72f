"""A reservation served from a background job (or under nohup) inherits SIGINT and SIGQUIT
ignored; its ranks, warm or cold, must still start with the dispositions of a fresh process, or
the SIGINT a Ctrl-C forwards does nothing to them."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

CLIENT = """
import signal, sys
for sig in (signal.SIGINT, signal.SIGQUIT):  # as in `monarch serve ... &` from a script
    signal.signal(sig, signal.SIG_IGN)
from monarch_cli.jobs import serve
job = serve(None, hosts=1, state=sys.argv[1], preload="")
try:
    for cold in (True, False):
        job.run_spmd(["torchrun", "--nproc-per-node=1", sys.argv[2]], cold=cold)
finally:
    job.stop()
"""

RANK = """
import signal
print("SIGINT", signal.getsignal(signal.SIGINT) is signal.default_int_handler,
      "SIGQUIT", signal.getsignal(signal.SIGQUIT) == signal.SIG_DFL, flush=True)
"""


def test_ranks_of_a_reservation_served_with_sigint_ignored_get_the_default_dispositions(tmp_path: Path) -> None:
    script = tmp_path / "dispositions.py"
    script.write_text(RANK)
    done = subprocess.run(
        [sys.executable, "-c", CLIENT, str(tmp_path / ".monarch" / "job_state.pkl"), str(script)],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=240,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    assert done.returncode == 0, done.stderr[-2000:]
    said = [line.split("] ", 1)[-1] for line in done.stdout.splitlines() if "SIGINT" in line]
    assert said == ["SIGINT True SIGQUIT True"] * 2, done.stdout  # cold, then warm
