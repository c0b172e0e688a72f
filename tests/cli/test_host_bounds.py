"""`--hosts` has a bound per backend: a typo'd count is one line, not a list built until memory runs out."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from monarch_cli.jobs import JobError, dryrun
from monarch_cli.schedulers import get_scheduler


@pytest.mark.parametrize("dry", [True, False])
def test_serve_refuses_a_huge_host_count_in_one_line(tmp_path: Path, dry: bool) -> None:
    args = ["serve", "--hosts", "99999999999", *(["--dry-run"] if dry else []), "--state", str(tmp_path / "s.pkl")]
    done = subprocess.run(
        [sys.executable, "-m", "monarch_cli", *args], capture_output=True, text=True, timeout=60, cwd=tmp_path,
        env={**os.environ},
    )  # fmt: skip
    assert done.returncode != 0 and done.stdout == ""
    local_max = max(128, 16 * (os.cpu_count() or 1))
    assert done.stderr.strip().splitlines() == [
        f"monarch: error: --hosts 99999999999 is more than the local scheduler takes (at most {local_max})"
    ]
    assert not (tmp_path / "s.pkl").exists()


def test_each_backend_has_its_own_bound() -> None:
    assert get_scheduler("local").max_hosts() == max(128, 16 * (os.cpu_count() or 1))
    assert get_scheduler("slurm").max_hosts() >= 10_000
    with pytest.raises(JobError, match="at most 65536"):
        dryrun(None, "slurm", hosts=70_000)
    assert dryrun(None, "local", hosts=4) is not None
