"""A warm rank's exit is reported when the rank says it ends (its output closed), before the
kernel has torn the process down: what a user sees must be what a plain interpreter gives,
however the script ends, and no output may be lost or arrive after the exit.
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from monarch_cli.jobs import Job

from ..conftest import write_script
from .conftest import spmd

pytestmark = pytest.mark.slow

ENDINGS = """
import os, sys
rank = int(os.environ["RANK"])
sys.stdout.write("".join("line %d of rank %d\\n" % (i, rank) for i in range(20000)))  # ~0.4 MB, unflushed
print("last words of rank", rank)
if rank == 0:
    pass                      # falls off the end: 0
elif rank == 1:
    sys.exit(300)             # as python: 300 & 0xFF
elif rank == 2:
    raise RuntimeError("boom")  # traceback, 1
else:
    sys.stdout.flush()
    os._exit(7)               # past every exit step of ours: the status comes from waitpid
"""


def _plain_status(script: Path, rank: int) -> int:
    env = {"RANK": str(rank), "PATH": "/usr/bin:/bin"}
    return subprocess.run([sys.executable, str(script)], env=env, capture_output=True, timeout=60).returncode


@pytest.mark.parametrize("cold", [False, True], ids=["warm", "cold"])
def test_every_way_a_script_ends_gives_the_status_python_gives_and_all_of_its_output(
    job: Job, tmp_path: Path, cold: bool
) -> None:
    script = write_script(tmp_path, "endings.py", ENDINGS)
    for _ in range(2):  # the second warm run starts from spares
        run = spmd(job, script, cold=cold)
        got = {e.rank: e.exitcode for e in run.result.ranks}
        assert got == {r: _plain_status(script, r) for r in range(4)} == {0: 0, 1: 44, 2: 1, 3: 7}, got
        assert all(e.signal is None for e in run.result.ranks)
        for r in range(4):
            log = run.log(r)
            assert (
                len(re.findall(rb"^line \d+ of rank \d+$", log, re.M)) == 20000
                and f"last words of rank {r}\n".encode() in log
            ), r
            assert (b"RuntimeError: boom" in log) == (r == 2)
