"""A proc: the process that hosts actors and runs their endpoints.

The proc's main thread runs an asyncio loop that reads the inbox socket directly, so a
synchronous endpoint runs with no thread hand-off at all. Messages to one actor are
handled one at a time, in order; an ``async`` endpoint holds its actor's later messages
until it returns, while other actors of the proc keep running.
"""

from __future__ import annotations

import asyncio
import collections
import inspect
import os
import sys
import threading
import traceback
from typing import Any, cast

import cloudpickle
import zmq

from ...config import configure
from .. import protocol
from ..errors import Failure
from ..mailbox import future
from ..mailbox.io_thread import EVENTS, POLLIN
from ..mailbox.mailbox import Mailbox
from ..transport import wire
from ..transport.keys import Keys
from . import actor
from .actor import Context, _enter, _leave
from .shape import Point

_DRAIN_BATCH = 256


class _Slot:
    """One actor in this proc and the messages waiting for it."""

    __slots__ = ("instance", "ctx", "name", "queue", "busy", "methods")

    def __init__(self, instance: Any, ctx: Context, name: str) -> None:
        self.instance = instance
        self.ctx = ctx
        self.name = name
        self.queue: collections.deque[tuple[Any, ...]] = collections.deque()
        self.busy = False
        self.methods: dict[str, tuple[Any, bool]] = {}


class ProcServer:
    def __init__(self, mailbox: Mailbox, boot: dict[str, Any]) -> None:
        self.mb = mailbox
        self.boot = boot
        self.inbox, self.inbox_addr = mailbox.transport.bind_router()
        self.loop = asyncio.new_event_loop()
        self.slots: dict[str, _Slot] = {}
        mailbox.supervisor = self._schedule_supervise

    def run(self) -> int:
        asyncio.set_event_loop(self.loop)
        self.loop.add_reader(self.inbox.fileno(), self._drain)
        self.mb.reply(self.boot["owner"], self.boot["ready_call_id"], True, (self.inbox_addr, os.getpid()))
        self.loop.call_soon(self._drain)
        self.loop.run_forever()
        self.inbox.close(linger=0)
        self.mb.close()
        return 0

    # ---------------------------------------------------------------- dispatch
    def _drain(self) -> None:
        inbox = self.inbox
        for _ in range(_DRAIN_BATCH):
            # cheaper than ending on zmq.Again; pyzmq types every option's value as int | bytes: EVENTS is an int
            if not cast(int, inbox.getsockopt(EVENTS)) & POLLIN:
                return
            frames = wire.recv_frames(inbox)
            try:
                self._dispatch(frames)
            except Exception:  # noqa: BLE001 - a malformed message must not kill the proc
                traceback.print_exc()
        self.loop.call_soon(self._drain)  # more may be queued; the fd will not fire again

    def _dispatch(self, frames: list[zmq.Frame]) -> None:
        head, body = wire.parse(frames[1:])
        try:
            msg = protocol.decode(head)
        except (KeyError, TypeError):
            self._refuse(head)
            return
        kind = msg.KIND
        if kind == "call":
            slot = self.slots.get(msg.key)
            if slot is None:
                self._no_actor(msg)
            elif slot.busy or slot.queue:
                slot.queue.append((msg, body))
            else:
                self._run_call(slot, msg, body)
        elif kind == "spawn":
            try:
                cls, args, kwargs = wire.loads(body)
                self.spawn_local(msg.key, msg.name, msg.point, cls, args, kwargs)
            except BaseException as e:  # noqa: BLE001
                self._reply_error(msg.reply_to, msg.cid, f"constructing actor {msg.name!r} at {msg.point} failed", e)
            else:
                self.mb.reply(msg.reply_to, msg.cid, True, None)
        elif kind == "stop_actor":
            slot = self.slots.get(msg.key)
            if slot is not None and (slot.busy or slot.queue):
                slot.queue.append((msg, body))
            else:
                self._stop_actor(msg)
        elif kind == "stop":
            self.mb.reply(msg.reply_to, msg.cid, True, None)
            self.loop.call_soon(self.loop.stop)
        elif kind == "ping":
            self.mb.reply(msg.reply_to, msg.cid, True, os.getpid())
        else:
            self._refuse(head)

    def _refuse(self, head: tuple[Any, ...]) -> None:
        why = protocol.not_understood(head, f"proc {self.boot['proc_id']}")
        answer = protocol.answer_to(head)
        if answer is not None:
            self.mb.reply(answer[1], answer[0], False, (why, "", None))
        else:
            print(f"monarch: {why}", file=sys.stderr, flush=True)

    def as_mesh(self) -> Any:
        """This proc as a one-proc mesh (the meshes build on this module's layer, so imported here late)."""
        from .mesh import this_proc

        return this_proc()

    def spawn_local(self, key: str, name: str, point: Point, cls: type[object], args: Any, kwargs: Any) -> None:
        ctx = Context(actor=None, actor_name=name, point=point, proc_id=self.boot["proc_id"], _key=key)
        token = _enter(ctx)
        try:
            instance: Any = cls.__new__(cls)  # an actor of any class, made in two steps: its context comes first
            ctx.actor = instance
            instance.__init__(*args, **kwargs)
        finally:
            _leave(token)
        self.slots[key] = _Slot(instance, ctx, name)

    def _no_actor(self, call: protocol.Call) -> None:
        msg = f"no actor {call.key.split('#')[0]!r} on proc {self.boot['proc_id']} (it was stopped or never spawned)"
        if call.cid is None:
            self.mb.send(call.reply_to, protocol.EndpointError(msg))
        else:
            self.mb.reply(call.reply_to, call.cid, False, (msg, "", None))

    def _stop_actor(self, msg: protocol.StopActor) -> None:
        self.slots.pop(msg.key, None)
        self.mb.reply(msg.reply_to, msg.cid, True, None)

    def _method(self, slot: _Slot, name: str) -> tuple[Any, bool]:
        entry = slot.methods.get(name)
        if entry is None:
            fn = getattr(slot.instance, name, None)
            if fn is None or not getattr(fn, "_monarch_endpoint", False):
                raise AttributeError(f"{type(slot.instance).__name__} has no endpoint {name!r}")
            entry = slot.methods[name] = (fn, inspect.iscoroutinefunction(fn))
        return entry

    def _run_call(self, slot: _Slot, call: protocol.Call, body: list[Any]) -> None:
        cid, reply_to, method = call.cid, call.reply_to, call.method
        token = _enter(slot.ctx)
        try:
            fn, is_async = self._method(slot, method)
            args, kwargs = wire.loads(body)
            if is_async:
                slot.busy = True
                task = self.loop.create_task(fn(*args, **kwargs))
                task.add_done_callback(lambda t: self._async_done(slot, cid, reply_to, method, t))
                return
            result = fn(*args, **kwargs)
        except BaseException as e:  # noqa: BLE001 - every failure goes back to the caller
            self._endpoint_failed(slot, cid, reply_to, method, e)
        else:
            if cid is not None:
                self.mb.reply(reply_to, cid, True, result)
        finally:
            _leave(token)

    def _async_done(self, slot: _Slot, cid: int | None, reply_to: str, method: str, task: asyncio.Task[Any]) -> None:
        slot.busy = False
        if task.cancelled():
            self._endpoint_failed(slot, cid, reply_to, method, asyncio.CancelledError())
        elif (exc := task.exception()) is not None:
            self._endpoint_failed(slot, cid, reply_to, method, exc)
        elif cid is not None:
            self.mb.reply(reply_to, cid, True, task.result())
        while slot.queue and not slot.busy:
            msg, body = slot.queue.popleft()
            if msg.KIND == "stop_actor":
                self._stop_actor(msg)
            else:
                self._run_call(slot, msg, body)

    def _endpoint_failed(self, slot: _Slot, cid: int | None, reply_to: str, method: str, e: BaseException) -> None:
        where = f"{slot.name}.{method} at {slot.ctx.point} on proc {self.boot['proc_id']} ({self.boot['host']})"
        if cid is None:
            print(f"monarch: broadcast to {where} raised:", file=sys.stderr)
            traceback.print_exception(type(e), e, e.__traceback__)
            self.mb.send(reply_to, protocol.EndpointError(f"broadcast to {where} raised {type(e).__name__}: {e}"))
        else:
            self._reply_error(reply_to, cid, f"{where} raised", e)

    def _reply_error(self, reply_to: str, cid: int, what: str, e: BaseException) -> None:
        tb = "".join(traceback.format_exception(type(e), e, e.__traceback__))
        try:
            cloudpickle.dumps(e)
            exc: BaseException | None = e
        except Exception:  # noqa: BLE001
            exc = None
        self.mb.reply(reply_to, cid, False, (f"{what} {type(e).__name__}: {e}", tb, exc))

    # -------------------------------------------------------------- supervision
    def _schedule_supervise(self, failure: Failure, owner_key: str) -> None:
        self.loop.call_soon_threadsafe(self._supervise, failure, owner_key)

    def _supervise(self, failure: Failure, owner_key: str) -> None:
        slot = self.slots.get(owner_key)
        handler = getattr(slot.instance, "__supervise__", None) if slot else None
        if handler is None:
            self.mb.unhandled_failure(failure)
            return
        token = _enter(slot.ctx)  # type: ignore[union-attr]
        try:
            handled = handler(failure)
        except BaseException:  # noqa: BLE001
            traceback.print_exc()
            handled = False
        finally:
            _leave(token)
        if inspect.isawaitable(handled):
            task = asyncio.ensure_future(handled, loop=self.loop)
            task.add_done_callback(
                lambda t: (
                    None
                    if (not t.cancelled() and not t.exception() and t.result())
                    else self.mb.unhandled_failure(failure)
                )
            )
        elif not handled:
            self.mb.unhandled_failure(failure)


def _adopt_import_context(ctx: dict[str, Any]) -> None:
    """Import what the spawner imports: its sys.path entries (those that exist here) and cwd."""
    cwd = ctx.get("cwd")
    if cwd and os.path.isdir(cwd):
        os.chdir(cwd)
    ours = [p for p in sys.path if p not in ctx.get("sys_path", [])]
    sys.path[:] = [p for p in ctx.get("sys_path", []) if os.path.exists(p)] + ours


def main(boot: dict[str, Any]) -> int:
    """Run a proc until it is told to stop (called in the child forked by the zygote)."""
    boot["pid"] = os.getpid()
    actor._boot = boot
    from ..title import set_title

    set_title(f"monarch proc {boot['proc_id']}")
    configure(**boot["settings"])
    _adopt_import_context(boot.get("import") or {})
    mb = Mailbox(Keys.decode(boot["keys"]), owner=boot["owner"], proc_id=boot["proc_id"])
    if boot.get("relay"):  # the owner cannot be reached from here: through our agent, on its link
        mb.relay_through(boot["owner"], boot["agent"])
    Mailbox.install(mb)
    server = actor._server = ProcServer(mb, boot)
    future._endpoint_thread = threading.main_thread()
    return server.run()
