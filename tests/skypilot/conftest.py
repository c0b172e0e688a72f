"""Nodes for the skypilot stand-in: network namespaces ``msky-h1``, ``msky-h2`` on bridge
``msky-br0``, made by tests/netns.py.

The client's side of the bridge is ``10.215.0.1``; node i is ``10.215.0.(10+i)``. Needs root.
(tests/ssh uses ``mssh-*`` on 10.214.0.0/24; the two never meet.)
"""

from __future__ import annotations

import os
from typing import Iterator, List, Tuple

import pytest

from ..netns import add_hosts, remove_hosts

SUBNET = "10.215.0"
N_NODES = 2


def _teardown() -> None:
    remove_hosts("msky", N_NODES)


@pytest.fixture(scope="session")
def sky_nodes() -> Iterator[List[Tuple[str, str]]]:
    """``[(namespace, address)]`` of the nodes."""
    if os.geteuid() != 0:
        pytest.fail("the skypilot stand-in needs root (network and mount namespaces)")
    _teardown()
    try:
        yield add_hosts("msky", SUBNET, N_NODES)
    finally:
        _teardown()
