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

import os
import sys
from typing import Any

#: Found once in the warm process (:func:`prepare`), so that a rank does not go through every
#: logger (a forked rank that touches an object copies the page it lives on).
_stream_handlers: list[Any] | None = None
#: What transformers configured its logger from, in the warm process.
_HF_LOGGING_ENV = ("TRANSFORMERS_VERBOSITY", "CI")
_hf_logging_env: dict[str, str | None] = {}


def prepare() -> None:
    """In the warm process, once before its first fork (it runs no user code, so what it holds
    then is what every rank starts with)."""
    global _stream_handlers, _hf_logging_env
    _stream_handlers = _handlers_on((sys.stdout, sys.stderr))
    _hf_logging_env = {k: os.environ.get(k) for k in _HF_LOGGING_ENV}


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


def _handlers_on(streams: tuple[Any, ...]) -> list[Any]:
    """The ``logging.StreamHandler``s of every logger that write to one of ``streams``."""
    logging = sys.modules.get("logging")
    if logging is None:
        return []
    ids = {id(s) for s in streams}
    loggers = [
        logging.getLogger(),
        *(v for v in logging.Logger.manager.loggerDict.values() if isinstance(v, logging.Logger)),
    ]
    return [
        handler
        for logger in loggers
        for handler in logger.handlers
        if isinstance(handler, logging.StreamHandler) and id(getattr(handler, "stream", None)) in ids
    ]


def _repoint_log_handlers(old_streams: tuple[Any, ...]) -> None:
    """``logging.StreamHandler()``s made at import hold the warm process's stdio objects: point
    them at the rank's (as one made in a fresh interpreter would be), and a ``flush`` bound to
    the old stream too (transformers binds ``sys.stderr.flush``)."""
    handlers = _stream_handlers if _stream_handlers is not None else _handlers_on(old_streams)
    new = {id(old): cur for old, cur in zip(old_streams, (sys.stdout, sys.stderr))}
    for handler in handlers:
        stream = getattr(handler, "stream", None)
        if id(stream) in new:
            handler.stream = new[id(stream)]
        flush = vars(handler).get("flush")
        if id(getattr(flush, "__self__", None)) in new:
            handler.flush = new[id(flush.__self__)].flush  # type: ignore[union-attr]


def _transformers_logging() -> None:
    """transformers sets its library logger's level from ``TRANSFORMERS_VERBOSITY`` (and whether
    it propagates from ``CI``) the first time a module asks for a logger (at import): configure
    it again if the rank's say otherwise (its handler's stream is repointed above)."""
    hf_logging = sys.modules.get("transformers.utils.logging")
    if hf_logging is None or getattr(hf_logging, "_default_handler", None) is None:
        return
    if _hf_logging_env and all(os.environ.get(k) == v for k, v in _hf_logging_env.items()):
        return  # configured as a fresh interpreter would (saves clearing every logger's cache)
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
