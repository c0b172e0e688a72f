"""The skypilot backend: ``scheduler`` (the client side: a SkyPilot task of host agents), ``provisioner`` (what it
needs from SkyPilot, and the test seam), ``sdk`` (SkyPilot's SDK as that provisioner: the only place SkyPilot is
imported), ``ssh_access`` (SSH to the head node and tunnels to the agents)."""

from .provisioner import PROVISIONER_ENV, Cluster, ClusterStatus, Provisioner
from .scheduler import DEFAULT_AGENT_PORT, KEYS_SECRET, SkyPilotScheduler, parse_minutes, provisioner, to_yaml

__all__ = [
    "SkyPilotScheduler",
    "Provisioner",
    "Cluster",
    "ClusterStatus",
    "provisioner",
    "parse_minutes",
    "to_yaml",
    "KEYS_SECRET",
    "PROVISIONER_ENV",
    "DEFAULT_AGENT_PORT",
]
