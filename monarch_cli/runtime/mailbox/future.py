"""Futures returned by every adverb: ``.get(timeout=)`` from threads, ``await`` from coroutines."""

from __future__ import annotations

import concurrent.futures
import threading
import time
from collections.abc import Callable, Generator
from typing import Any, Generic, TypeVar

from ...config import settings
from ..errors import CallTimeout, MonarchError

T = TypeVar("T")
_DEFAULT: Any = object()
#: The thread that runs a proc's endpoints, set by :func:`..actor.proc.main`; None outside procs.
_endpoint_thread: threading.Thread | None = None


def on_loop_thread() -> bool:
    """True in a proc's main thread, where endpoints run (and must not block on their own proc)."""
    return _endpoint_thread is not None and threading.current_thread() is _endpoint_thread


class Future(concurrent.futures.Future, Generic[T]):
    #: The mailbox whose replies resolve this future; a waiter reads them itself.
    _mailbox: Any = None
    #: Set when an actor calls an actor of its own proc: blocking on it would deadlock.
    _same_proc: bool = False

    def get(self, timeout: float | None = _DEFAULT) -> T:
        """Block until resolved; raises the remote failure, or :class:`CallTimeout`."""
        if timeout is _DEFAULT:
            timeout = settings().call_timeout
        try:
            return self.result(timeout)
        except concurrent.futures.TimeoutError:
            raise CallTimeout(f"no result within {timeout} s") from None

    def result(self, timeout: float | None = None) -> T:
        mb = self._mailbox
        if self._same_proc and not self.done():
            if on_loop_thread():
                raise MonarchError(
                    "an endpoint cannot block on a call to an actor in its own proc (it would wait "
                    "forever behind itself): make the endpoint `async def` and `await` the call"
                )
        if mb is not None and not self.done():
            deadline = None if timeout is None else time.monotonic() + timeout
            # Read replies ourselves when no other thread is; otherwise wait briefly and retry.
            while not self.done():
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    raise concurrent.futures.TimeoutError()
                if not mb.pump(self, left):
                    self._wait(0.005 if left is None else min(0.005, left))
        return super().result(timeout)

    def _wait(self, seconds: float) -> None:
        with self._condition:
            if not self.done():
                self._condition.wait(seconds)

    def __await__(self) -> Generator[Any, None, T]:
        import asyncio

        return asyncio.wrap_future(self).__await__()

    def then(self, fn: Callable[[Any], Any]) -> Future[Any]:
        """A future of ``fn(result)``; failures pass through unchanged."""
        out: Future[Any] = Future()
        out._mailbox = self._mailbox

        def _done(f: concurrent.futures.Future) -> None:
            exc = f.exception()
            if exc is not None:
                out.set_exception(exc)
                return
            try:
                out.set_result(fn(f.result()))
            except BaseException as e:  # noqa: BLE001 - handed to the waiter
                out.set_exception(e)

        self.add_done_callback(_done)
        return out


def gather(futures: list[Future[Any]]) -> Future[list[Any]]:
    """One future for all of ``futures``: their results in order, or the first failure."""
    out: Future[list[Any]] = Future()
    n = len(futures)
    out._mailbox = futures[0]._mailbox if futures else None
    if n == 0:
        out.set_result([])
        return out
    results: list[Any] = [None] * n
    state = {"left": n, "failed": False}
    lock = threading.Lock()

    def _make(i: int) -> Callable[[concurrent.futures.Future], None]:
        def _done(f: concurrent.futures.Future) -> None:
            exc = f.exception()
            with lock:
                if state["failed"]:
                    return
                if exc is not None:
                    state["failed"] = True
                else:
                    results[i] = f.result()
                    state["left"] -= 1
                    if state["left"]:
                        return
            if exc is not None:
                out.set_exception(exc)
            else:
                out.set_result(results)

        return _done

    for i, f in enumerate(futures):
        f.add_done_callback(_make(i))
    return out
