"""The ssh backend: ``scheduler`` (the client side: one detached agent per host reached with paramiko) and
``forward`` (a loopback port tunnelled to an agent over the SSH connection, for ``--tunnel``; the skypilot
backend's tunnels use it too)."""

from .scheduler import SshScheduler, SshTarget, connect, host_names, resolve

__all__ = ["SshScheduler", "SshTarget", "connect", "resolve", "host_names"]
