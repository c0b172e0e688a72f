"""Every message between the runtime's processes, defined once (this package).

Here: the registry and the conventions. The messages: :mod:`.to_agent` (client → agent
requests), :mod:`.from_agent` (what agents send clients, and ``result``), :mod:`.procs`
(client ↔ proc), :mod:`.zygote` (agent ↔ zygote), :mod:`.records` (the per-rank spec, a
proc's boot record and the rank's debugger channel).

A message is a :class:`typing.NamedTuple` whose class carries its ``KIND``. On the wire it
travels as a plain tuple ``(KIND, *fields)`` (:func:`header`): a plain tuple pickles to a
few bytes more than its fields, while a NamedTuple would pickle its class by reference and
cost a global lookup on every receipt. The receiver rebuilds the typed message with
:func:`decode` (one tuple allocation) and reads fields by name. A message's large
payload (rank output, a pickled request body) travels as the body frames beside the header
(see :mod:`..transport.wire`), never in it.

Conventions, which the agent relies on to answer a message it does not know:

* a **request** has ``cid`` and ``reply_to`` as its first two fields, and is answered with
  one :class:`Result` (``cid`` 0: no answer is awaited);
* an **event** is sent unasked; events of one run carry its ``run_id``, by which the client
  routes them to that run's subscription (:mod:`..mailbox.events`).

The zygote's socketpair carries the same header tuples, pickled whole. The rank's debugger
channel carries JSON objects (``{"type": ...}``); they are typed here as :class:`TypedDict`.
The per-rank spec and a proc's boot record are dicts (the zygote adds to them) typed the
same way.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

__all__ = [
    "MESSAGES",
    "ROUTES",
    "header",
    "kind_of",
    "decode",
    "answer_to",
    "not_understood",
    "CLIENT_AGENT",
    "AGENT_CLIENT",
    "CLIENT_PROC",
    "PROC_AGENT",
    "PROC_CLIENT",
    "AGENT_ZYGOTE",
    "ZYGOTE_AGENT",
    "ANY",
]

M = TypeVar("M", bound=type[Any])

#: Every message class by its kind (what :func:`decode` looks up).
MESSAGES: dict[str, type[Any]] = {}
#: Which process sends each kind to which (the table in docs/architecture.md follows it).
ROUTES: dict[str, str] = {}
_SIZES: dict[str, tuple[type[Any], int]] = {}  # kind -> (class, header length)
_tuple_new = tuple.__new__


def _message(kind: str, route: str) -> Callable[[M], M]:
    def register(cls: M) -> M:
        if kind in MESSAGES:
            raise RuntimeError(f"message kind {kind!r} is defined twice")
        cls.KIND = kind
        MESSAGES[kind] = cls
        ROUTES[kind] = route
        _SIZES[kind] = (cls, 1 + len(cls._fields))
        return cls

    return register


def kind_of(cls: type[Any]) -> str:
    """A message class's ``KIND``: :func:`_message` sets it, where a type checker cannot see it (a
    NamedTuple's class body declares only its fields)."""
    kind: str = cls.KIND
    return kind


def header(msg: Any) -> tuple[Any, ...]:
    """The plain tuple a message travels as: ``(KIND, *fields)``."""
    return (msg.KIND, *msg)


def decode(head: tuple[Any, ...]) -> Any:
    """The typed message of a received header; ``KeyError`` for a kind this side does not know,
    ``TypeError`` for a known kind with the wrong number of fields."""
    cls, size = _SIZES[head[0]]
    if len(head) != size:
        raise TypeError(f"a {head[0]!r} message has {size - 1} fields, not {len(head) - 1}")
    return _tuple_new(cls, head[1:])  # what ``cls._make`` does, without its Python frame


def answer_to(head: tuple[Any, ...]) -> tuple[int, str] | None:
    """``(cid, reply_to)`` of a header of any kind, known or not, that asks for an answer (by
    the convention above); None when it asks for none. Lets a receiver refuse a kind it does
    not know (a newer sender) with an error instead of leaving the sender to time out."""
    if len(head) >= 3 and type(head[1]) is int and head[1] > 0 and isinstance(head[2], str):
        return head[1], head[2]
    return None


def not_understood(head: tuple[Any, ...], who: str) -> str:
    """The error for a message ``who`` cannot read: an unknown kind, or a known one with other fields."""
    kind = head[0] if head else None
    if kind not in MESSAGES:
        return f"{who} does not understand {kind!r} messages (is it older than this client? start it again)"
    return (
        f"{who} cannot read a {kind!r} message of {len(head) - 1} fields (it expects "
        f"{', '.join(MESSAGES[kind]._fields) or 'none'}; are both sides the same version?)"
    )


CLIENT_AGENT = "client → agent"
AGENT_CLIENT = "agent → client"
CLIENT_PROC = "client → proc"
PROC_CLIENT = "proc → owner"
PROC_AGENT = "proc → agent"
AGENT_ZYGOTE = "agent → zygote"
ZYGOTE_AGENT = "zygote → agent"
ANY = "any → requester"
