"""The kubernetes backend: ``scheduler`` (the client side: an Indexed Job of host agents), ``manifests`` (the
objects it creates, as data), ``pods`` (watching them), ``api`` (the optional ``kubernetes`` client library),
``port_forward`` (reaching an agent through the API server)."""

from .scheduler import INSTALL_HINT, KubernetesScheduler

__all__ = ["KubernetesScheduler", "INSTALL_HINT"]
