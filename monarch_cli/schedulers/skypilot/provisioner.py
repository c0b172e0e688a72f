"""What the skypilot backend needs from SkyPilot (:class:`Provisioner`), and what it gets back.

Both the backend (:mod:`.scheduler`) and SkyPilot's SDK adaptor (:mod:`.sdk`) import these, and the adaptor
imports nothing of the backend: the backend picks the adaptor, or a stand-in named by :data:`PROVISIONER_ENV`.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Protocol

from ...config import EnvSettings
from ..base import Progress
from .ssh_access import SshAccess

#: ``module:attr`` of a provisioner factory to use instead of SkyPilot (the test seam).
PROVISIONER_ENV = EnvSettings.skypilot_provisioner.var
INSTALL_HINT = "pip install 'skypilot>=0.10'"


@dataclasses.dataclass
class Cluster:
    """What a launch tells the client about the nodes (from SkyPilot's cluster handle)."""

    #: The addresses the client uses, node rank order (the handle's external IPs).
    ips: list[str]
    #: The addresses the nodes have among themselves (``SKYPILOT_NODE_IPS``; the agents listen there).
    internal_ips: list[str] = dataclasses.field(default_factory=list)
    #: SSH access to the head, when SkyPilot gives it (None: the agents can be reached only directly).
    ssh: SshAccess | None = None


@dataclasses.dataclass
class ClusterStatus:
    """An existing cluster as SkyPilot reports it: enough to tell whether it can serve a task."""

    state: str
    nodes: int
    accelerators: str | None = None  # "A100:8"
    cloud: str | None = None  # "aws"


class Provisioner(Protocol):
    """What the backend needs from SkyPilot; tests replace it through :data:`PROVISIONER_ENV`."""

    def launch(self, cluster: str, task: dict[str, Any], secrets: dict[str, str], progress: Progress) -> Cluster:
        """Launch ``cluster`` with ``task`` (on an existing cluster: run it there); where its nodes are."""

    def existing(self, cluster: str) -> ClusterStatus | None:
        """``cluster`` as it is now, or None when there is none; changes nothing."""

    def state(self, cluster: str) -> tuple[str, str]:
        """``("UP" | "INIT" | "STOPPED" | "GONE", reason)`` without changing anything."""

    def down(self, cluster: str) -> None:
        """Tear ``cluster`` down; nothing of it may be left."""

    def keep(self, cluster: str, idle_minutes: int, down: bool) -> None:
        """End the task's job (the agents) and leave ``cluster`` up, to stop (or go down) after ``idle_minutes``."""


__all__ = ["INSTALL_HINT", "PROVISIONER_ENV", "Cluster", "ClusterStatus", "Provisioner"]
