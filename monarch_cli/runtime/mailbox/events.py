"""Routing a mailbox's events to the runs that asked for them (runs in the client).

Agents send a run's events (its ranks' output and exits, debugger and telemetry traffic) to
the process that started the run; one process may drive several runs at once (threads, a run
and a debugger). Each run opens a :class:`Subscription` for its ``run_id`` and the event types
it handles, and closes it when done; an event is delivered by ``(kind, run_id)``, to the
subscriptions for exactly that run, else to those for every run (``run_id`` None: the
debugger, which follows whichever run is paused). An event nobody subscribed to is dropped
and counted (a late output line of a run that has ended, say).

Handlers run on whichever thread reads the mailbox (its I/O thread or a waiter), one event
at a time: they must be quick and must not wait for another reply. A subscription whose
handlers may block (a run's, which print to a console the user may have paused) asks for a
thread of its own (``thread=``): its events are then handed over in order and handled there,
so the I/O thread, which also sends and reads the agents' heartbeats, never waits on them.
"""

from __future__ import annotations

import queue
import threading
import traceback
from collections.abc import Callable, Mapping
from typing import Any

#: ``handler(event, body frames)``
Handler = Callable[[Any, list[Any]], None]
_Key = tuple[str, str | None]


class EventRouter:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        # Replaced, never changed in place: the reader looks up without the lock.
        self._routes: dict[_Key, tuple[Handler, ...]] = {}
        #: Events that reached no subscription, by kind.
        self.dropped: dict[str, int] = {}

    def subscribe(
        self, run_id: str | None, handlers: Mapping[type[Any], Handler], thread: str | None = None
    ) -> Subscription:
        """Deliver ``run_id``'s events of these types (every run's, with None) until closed; with
        ``thread``, on a thread of that name, in the order they arrived."""
        sub = Subscription(self, run_id, {cls.KIND: h for cls, h in handlers.items()}, thread)
        with self._lock:
            routes = dict(self._routes)
            for kind, handler in sub.handlers.items():
                routes[(kind, run_id)] = routes.get((kind, run_id), ()) + (handler,)
            self._routes = routes
        return sub

    def _unsubscribe(self, sub: Subscription) -> None:
        with self._lock:
            routes = dict(self._routes)
            for kind, handler in sub.handlers.items():
                left = tuple(h for h in routes.get((kind, sub.run_id), ()) if h is not handler)
                if left:
                    routes[(kind, sub.run_id)] = left
                else:
                    routes.pop((kind, sub.run_id), None)
            self._routes = routes

    def deliver(self, event: Any, body: list[Any]) -> None:
        kind = event.KIND
        routes = self._routes
        handlers = routes.get((kind, getattr(event, "run_id", None))) or routes.get((kind, None))
        if not handlers:
            self.dropped[kind] = self.dropped.get(kind, 0) + 1
            return
        for handler in handlers:
            handler(event, body)


_END = object()  # (the last item of a subscription's queue)


def _queueing(q: queue.SimpleQueue[Any], handler: Handler) -> Handler:
    return lambda event, body: q.put((handler, event, body))


class Subscription:
    """One run's (or one debugger's) share of a mailbox's events; a context manager."""

    def __init__(
        self, router: EventRouter, run_id: str | None, handlers: dict[str, Handler], thread: str | None = None
    ) -> None:
        self._router = router
        self.run_id = run_id
        self._closed = False
        self._queue: queue.SimpleQueue[Any] | None = None
        self._thread: threading.Thread | None = None
        if thread is not None:
            q = self._queue = queue.SimpleQueue()
            # Registered handlers only queue: what they were given runs on the subscription's thread.
            handlers = {kind: _queueing(q, h) for kind, h in handlers.items()}
            self._thread = threading.Thread(target=self._serve, name=thread, daemon=True)
            self._thread.start()
        self.handlers = handlers

    def call_soon(self, fn: Callable[..., None], *args: Any) -> None:
        """Run ``fn(*args)`` where this subscription's handlers run, after the events already
        received (a lost host's ranks end after the output that came from them first)."""
        if self._queue is not None:
            self._queue.put((fn, *args))
        else:
            fn(*args)

    def close(self) -> None:
        """No more events; a thread of its own finishes what it was given first."""
        if not self._closed:
            self._closed = True
            self._router._unsubscribe(self)
            if self._queue is not None and self._thread is not None:
                self._queue.put(_END)
                if self._thread is not threading.current_thread():
                    self._thread.join()

    def _serve(self) -> None:
        q = self._queue
        assert q is not None
        while True:
            item = q.get()
            if item is _END:
                return
            fn, *args = item
            try:
                fn(*args)
            except Exception:  # noqa: BLE001 - one failed handler must not end the run's events
                traceback.print_exc()

    def __enter__(self) -> Subscription:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()
