"""The Kubernetes API clients of the kubernetes backend, made once per process, and its errors in one line.

The ``kubernetes`` package is an optional extra: imported only inside these functions.
"""

from __future__ import annotations

import json
import os
import threading
from pathlib import Path
from typing import Any

from ...errors import SchedulerError

INSTALL_HINT = "the kubernetes scheduler needs the kubernetes client: pip install 'kubernetes>=30,<38'"


def client_modules() -> Any:
    try:
        import kubernetes  # noqa: F401 - the optional extra
    except ImportError:
        raise SchedulerError(INSTALL_HINT) from None
    return kubernetes


_API_CACHE: dict[tuple[Any, ...], tuple[Any, Any]] = {}
_API_LOCK = threading.Lock()


def apis(data: dict[str, Any]) -> tuple[Any, Any]:
    """CoreV1Api and BatchV1Api for the plan's kubeconfig and context (in-cluster config when inside a pod);
    made once per process (a command probes, lists and forwards with the same ones)."""
    client_modules()
    incluster = (
        not data.get("kubeconfig") and not data.get("context") and bool(os.environ.get("KUBERNETES_SERVICE_HOST"))
    )
    key = (data.get("kubeconfig"), data.get("context"), incluster, os.environ.get("KUBECONFIG"))
    with _API_LOCK:
        if key not in _API_CACHE:
            _API_CACHE[key] = _load_apis(data, incluster)
        return _API_CACHE[key]


def _load_apis(data: dict[str, Any], incluster: bool) -> tuple[Any, Any]:
    from kubernetes import client, config

    if data.get("kubeconfig") and not Path(data["kubeconfig"]).expanduser().is_file():
        raise SchedulerError(f"--kubeconfig {data['kubeconfig']} does not exist")
    try:
        if incluster:
            config.load_incluster_config()
            api = client.ApiClient()
        else:
            api = config.new_client_from_config(config_file=data.get("kubeconfig"), context=data.get("context"))
    except Exception as e:  # noqa: BLE001 - ConfigException, YAML errors, a bad file: the user's to fix
        where = data.get("kubeconfig") or os.environ.get("KUBECONFIG") or "~/.kube/config"
        first = " ".join(str(e).split())[:300] or type(e).__name__
        raise SchedulerError(f"cannot load the Kubernetes configuration ({where}): {first}") from None
    return client.CoreV1Api(api), client.BatchV1Api(api)


def api_error(e: Exception, what: str) -> SchedulerError:
    """One line from an ApiException (its Status message) or a connection failure."""
    body = getattr(e, "body", None)
    message = ""
    if body:
        try:
            message = json.loads(body).get("message", "")
        except (ValueError, AttributeError):
            message = str(body)[:200]
    status = getattr(e, "status", None)
    if status is None:
        return SchedulerError(f"{what}: cannot reach the Kubernetes API ({type(e).__name__}: {str(e)[:200]})")
    return SchedulerError(f"{what}: {message or getattr(e, 'reason', '')} (HTTP {status})")


__all__ = ["INSTALL_HINT", "apis", "api_error", "client_modules"]
