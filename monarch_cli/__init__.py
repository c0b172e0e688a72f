"""monarch-cli: reserve hosts once, run torchrun-style SPMD jobs on them many times.

The actor runtime is importable from here, so a single controller script can drive a
whole reservation::

    from monarch_cli import Actor, endpoint, this_host
"""

from typing import Any

from .config import configure
from .runtime import __all__ as _RUNTIME  # the runtime package itself loads lazily
from .runtime import bundle_site as _bundle_site
from .version import __version__ as __version__

_bundle_site.add_dependencies()  # on a host that got our code from the client: its wheels, after site-packages

__all__: list[str] = ["configure", *_RUNTIME]


def __getattr__(name: str) -> Any:
    """Import the runtime on first use, so `monarch --help` does not pay for it."""
    if name in _RUNTIME:
        from . import runtime

        return getattr(runtime, name)
    raise AttributeError(f"module 'monarch_cli' has no attribute {name!r}")
