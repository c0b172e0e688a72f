"""torch is optional: the runtime imports and works on a machine where `import torch` fails."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from ..conftest import REPO

PROGRAM = """
import sys
import numpy as np
from monarch_cli import Actor, endpoint, this_host

class Doubler(Actor):
    @endpoint
    def double(self, x):
        try:
            import torch  # noqa: F401
            has_torch = True
        except ImportError:
            has_torch = False
        return has_torch, x * 2

actors = this_host().spawn_procs(per_host={"gpus": 2}).spawn("doubler", Doubler)
print(sorted(actors.double.call(np.arange(3)).get(timeout=60).values(), key=str))
print("controller has torch:", "torch" in sys.modules)
"""


def test_the_runtime_works_where_torch_cannot_be_imported(tmp_path: Path) -> None:
    shadow = tmp_path / "no_torch" / "torch"
    shadow.mkdir(parents=True)
    (shadow / "__init__.py").write_text("raise ImportError('No module named torch (hidden by the test)')\n")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(shadow.parent), str(REPO)])}
    done = subprocess.run(
        [sys.executable, "-c", PROGRAM], capture_output=True, text=True, env=env, cwd=tmp_path, timeout=120
    )
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert lines[0] == "[(False, array([0, 2, 4])), (False, array([0, 2, 4]))]", done.stdout
    assert lines[1] == "controller has torch: False"
