"""A warm rank's fresh world: undo what the warm process's imports left that a new interpreter
would not have.

A warm rank is a fork of a process that imported torch and whatever earlier runs taught it
(transformers, Lightning, Accelerate...). The process never runs user code, so nothing a
script creates (a process group, Accelerate's ``PartialState``, a CUDA context) exists in it;
but some libraries decide things *at import*, from the environment and the streams of that
moment. Each reset here is listed in docs/spmd.md with the test that proves it
(tests/jobs/test_frameworks.py); each touches only modules already loaded, so it costs
nothing for a script that does not use them.
"""

from __future__ import annotations

import sys
from typing import Any


def reset(old_streams: tuple[Any, ...]) -> None:
    """In a forked rank, after its environment and stdio were set (``old_streams``: the warm
    process's ``sys.stdout``/``sys.stderr`` objects, now replaced)."""
    _reseed()
    _repoint_log_handlers(old_streams)
    _transformers_logging()
    _lightning_rank()
    _accelerate_state()
    _cuda_caches()


def _reseed() -> None:
    """A fresh interpreter seeds ``random`` (and numpy's global generator, torch's default one)
    from the OS; every fork would otherwise share the warm process's sequence, run after run."""
    for name in ("random", "numpy.random"):  # (neither is imported here if the warm process has not)
        module = sys.modules.get(name)
        if module is not None:
            try:
                module.seed()
            except Exception:  # noqa: BLE001 - a numpy without the legacy global state
                pass
    torch = sys.modules.get("torch")
    if torch is not None and hasattr(torch, "default_generator"):
        torch.default_generator.seed()


def _repoint_log_handlers(old_streams: tuple[Any, ...]) -> None:
    """``logging.StreamHandler()``s made at import hold the warm process's stdio objects: point
    them at the rank's (as one made in a fresh interpreter would be)."""
    logging = sys.modules.get("logging")
    if logging is None:
        return
    new = {id(old): cur for old, cur in zip(old_streams, (sys.stdout, sys.stderr))}
    loggers = [
        logging.getLogger(),
        *(v for v in logging.Logger.manager.loggerDict.values() if isinstance(v, logging.Logger)),
    ]
    for logger in loggers:
        for handler in logger.handlers:
            stream = getattr(handler, "stream", None)
            if isinstance(handler, logging.StreamHandler) and id(stream) in new:
                handler.stream = new[id(stream)]


def _transformers_logging() -> None:
    """transformers sets its library logger's level from ``TRANSFORMERS_VERBOSITY`` and binds its
    handler to ``sys.stderr`` the first time a module asks for a logger (at import)."""
    hf_logging = sys.modules.get("transformers.utils.logging")
    if hf_logging is None or getattr(hf_logging, "_default_handler", None) is None:
        return
    try:
        hf_logging._reset_library_root_logger()
        hf_logging._configure_library_root_logger()
    except Exception:  # noqa: BLE001 - another transformers version: leave it as it is
        pass


def _lightning_rank() -> None:
    """Lightning sets ``rank_zero_only.rank`` from RANK/LOCAL_RANK when imported: in the warm
    process there is none, so every rank would think it is rank 0 until a Trainer sets it."""
    rank_zero = sys.modules.get("lightning.fabric.utilities.rank_zero") or sys.modules.get(
        "lightning_fabric.utilities.rank_zero"
    )
    if rank_zero is None:
        return
    rank = rank_zero._get_rank() or 0
    for name in (
        "lightning_utilities.core.rank_zero",
        "lightning.fabric.utilities.rank_zero",
        "lightning_fabric.utilities.rank_zero",
        "lightning.pytorch.utilities.rank_zero",
        "pytorch_lightning.utilities.rank_zero",
    ):
        module = sys.modules.get(name)
        function = getattr(module, "rank_zero_only", None)
        if function is not None:
            function.rank = rank


def _accelerate_state() -> None:
    """Accelerate's ``PartialState``/``AcceleratorState`` are process-wide singletons: a rank must
    start without one (the warm process never makes one; this makes sure)."""
    state = sys.modules.get("accelerate.state")
    if state is None:
        return
    for cls in ("AcceleratorState", "PartialState", "GradientState"):
        clear = getattr(getattr(getattr(state, cls, None), "_shared_state", None), "clear", None)
        if clear is not None:
            clear()


def _cuda_caches() -> None:
    """torch caches the device count the first time it is asked (``CUDA_VISIBLE_DEVICES`` of that
    moment); a rank's may differ. The warm process never initialises CUDA (checked at warm-up)."""
    cuda: Any = sys.modules.get("torch.cuda")
    if cuda is None:
        return
    if getattr(cuda, "_cached_device_count", None) is not None:
        cuda._cached_device_count = None
    for name in ("_device_count_nvml", "_device_count_amdsmi", "_raw_device_count_nvml"):
        clear = getattr(getattr(cuda, name, None), "cache_clear", None)
        if clear is not None:
            clear()
