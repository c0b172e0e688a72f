"""The kubernetes tests' stock image: an interpreter with torch and nothing of ours."""

from __future__ import annotations

import subprocess

import pytest

from .kubelet import stock_python


@pytest.fixture(scope="session")
def stock(tmp_path_factory: pytest.TempPathFactory) -> str:
    """The pods' ``python3``, as a stock PyTorch image's: what runs of ours is what the client shipped."""
    python = stock_python(tmp_path_factory.mktemp("stock") / "venv")
    missing = subprocess.run([python, "-c", "import zmq"], capture_output=True, text=True, cwd="/")
    assert "No module named 'zmq'" in missing.stderr  # the pods' interpreter lacks our packages
    return python
