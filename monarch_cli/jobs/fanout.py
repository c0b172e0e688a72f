"""One question to every host of a reservation: straight to each (a star), or through relays.

A fresh command that asks thousands of hosts the same thing (``status``'s ping, ``stack``)
spent most of its time on one CURVE handshake per host, on one ZeroMQ thread, and held a
connection per host. From ``settings().relay_from_hosts`` hosts it links ~√N of them instead
(the *relays*, every k-th host) and asks each relay for itself and, in one
:class:`~..runtime.protocol.FanOut`, for the k-1 hosts after it; the relays keep their own
connections to those hosts from one command to the next (``runtime/agent/relay.py``). A relay
that does not answer in time has its hosts asked directly, so one dead host costs its group
a second round, not an answer; so is a host its relay passed the question to and did not hear
from (a partition between the two: the client may still reach it).

A run, whose requests differ from host to host, links the relays too and reaches every other
host through its relay's connection (:func:`link_through_relays`): the relay forwards the
host's messages both ways, so the client holds ~√N connections, not N.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Collection, Sequence
from typing import Any

from ..config import settings
from ..runtime import protocol
from ..runtime.errors import ActorError, remote_error
from ..runtime.mailbox.future import Future
from ..runtime.mailbox.mailbox import Mailbox
from ..runtime.transport import wire


class NoAnswer(Exception):
    """The host did not answer in time (its relay passed the question on; no answer came)."""


def relay_groups(n: int) -> list[tuple[int, list[int]]]:
    """``(relay, the hosts it asks)`` by index: ⌈√n⌉ hosts a group, the first of each relaying."""
    k = math.isqrt(max(n - 1, 0)) + 1
    return [(i, list(range(i + 1, min(i + k, n)))) for i in range(0, n, k)]


def relayed(n: int) -> bool:
    """Whether a question to ``n`` hosts goes through relays."""
    return n >= max(2, settings().relay_from_hosts)


def relay_addresses(addresses: Sequence[str]) -> list[str]:
    """The relays among ``addresses``: all a command that only asks questions links to."""
    return [addresses[i] for i, _ in relay_groups(len(addresses))]


def link_through_relays(mb: Mailbox, addresses: Sequence[str], dead: Collection[str]) -> None:
    """Link the relays, and every other host through its group's relay (its link forwarded
    both ways: ``runtime/agent/forwarding.py``), for a command that sends each host its own
    requests (a run). A relay known dead has its hosts linked directly. Every host's route is
    set here, whatever the mailbox held: a long-lived process's earlier reservation may have
    routed the same address through a relay that is gone."""
    for relay, members in relay_groups(len(addresses)):
        via = addresses[relay]
        mb.link_directly(via)
        for i in members:
            if via in dead:
                mb.link_directly(addresses[i])
            else:
                mb.link(addresses[i], via=via)


def link_for_requests(mb: Mailbox, addresses: Sequence[str], relayed: bool, dead: Collection[str] = ()) -> None:
    """Link every host for requests that differ from host to host: through its group's relay
    where the hosts are ``relayed`` (:func:`link_through_relays`), else each directly (not
    through a relay an earlier set in this process routed the address by)."""
    if relayed:
        link_through_relays(mb, addresses, dead)
        return
    for address in addresses:
        mb.link_directly(address)


def ask_each(
    mb: Mailbox,
    addresses: Sequence[str | None],
    make: Callable[[int], Any],
    timeout: float,
    through_relays: bool,
    body: Sequence[Any] = (),
    retry_directly: bool = False,
    directly: set[int] | None = None,
) -> list[tuple[bool, Any]]:
    """``make(cid)``'s answer from each host, in order: ``(True, value)``, or ``(False, the
    exception)`` (:class:`NoAnswer` for silence). A None address is not asked (a host known
    dead): ``(False, NoAnswer)``. Waits at most ``timeout`` per round (two where a relay fails).

    ``through_relays``: each relay asks its hosts (a question: ``fan_out``), except those in
    ``directly`` (indices), asked straight. ``retry_directly``: a host that did not answer
    through its relay (a run's link, or a question the relay passed on) is linked directly and
    asked again, and added to ``directly``: a relay that cannot reach one of its hosts (its host's
    network half gone, a partition between them) must not cost that host's answer, nor the
    command, which would say a host the client reaches is gone."""
    directly = set() if directly is None else directly
    out: list[tuple[bool, Any]] = [(False, NoAnswer("not asked"))] * len(addresses)
    if not through_relays:
        futures = {i: mb.request(a, make, body) for i, a in enumerate(addresses) if a is not None}
        _collect(futures, time.monotonic() + timeout, out)
        again = [i for i, a in enumerate(addresses) if a is not None and not out[i][0]] if retry_directly else []
        for i in again:
            mb.link_directly(str(addresses[i]))
            directly.add(i)
        if again:
            _collect({i: mb.request(str(addresses[i]), make, body) for i in again}, time.monotonic() + timeout, out)
        return out
    direct: dict[int, Future[Any]] = {}
    groups: list[tuple[list[int], Future[Any]]] = []
    retry: list[int] = []
    inner = protocol.header(make(0))  # the relay puts its own call id and address
    for relay, members in relay_groups(len(addresses)):
        at = addresses[relay]
        if at is None:  # no relay there: its hosts are asked directly
            retry.extend(members)
            continue
        direct[relay] = mb.request(at, make, body)
        for i in members:
            if i in directly and addresses[i] is not None:  # its relay could not reach it before
                direct[i] = mb.request(str(addresses[i]), make, body)
        asked = [i for i in members if addresses[i] is not None and i not in directly]
        if asked:
            groups.append(
                (asked, mb.request(at, _fan_out(mb, [str(addresses[i]) for i in asked], timeout, inner), body))
            )
    deadline = time.monotonic() + timeout + 1.0  # the relays' own wait is ``timeout``
    _collect(direct, deadline, out)
    for asked, fan in groups:
        try:
            answers = fan.get(timeout=max(0.0, deadline - time.monotonic()))
        except Exception:  # noqa: BLE001 - the relay is gone or slow: ask its hosts directly
            retry.extend(asked)
            continue
        for i, answer in zip(asked, answers):
            out[i] = (False, NoAnswer("no answer")) if answer is None else _decode(*answer)
            if answer is None and retry_directly:
                retry.append(i)
    retry = [i for i in retry if addresses[i] is not None]
    if retry:
        for i in retry:
            mb.link_directly(str(addresses[i]))
            directly.add(i)  # (its relay gone, or not reaching it: the next question goes straight)
        _collect({i: mb.request(str(addresses[i]), make, body) for i in retry}, time.monotonic() + timeout, out)
    return out


def _fan_out(mb: Mailbox, targets: list[str], timeout: float, inner: tuple[Any, ...]) -> Callable[[int], Any]:
    return lambda cid: protocol.FanOut(cid, mb.address, targets, timeout, inner)


def _collect(futures: dict[int, Future[Any]], deadline: float, out: list[tuple[bool, Any]]) -> None:
    for i, fut in futures.items():
        try:
            out[i] = (True, fut.get(timeout=max(0.0, deadline - time.monotonic())))
        except Exception as e:  # noqa: BLE001 - each host's failure is its own answer
            out[i] = (False, e)


def _decode(ok: bool, frames: list[bytes]) -> tuple[bool, Any]:
    """A target's answer as its relay passed it on: plain data only (the relay or the target may
    be hostile; docs/runtime.md, "Security")."""
    try:
        value = wire.loads(frames, plain=True, lenient=not ok)
    except Exception as e:  # noqa: BLE001
        return False, ActorError(f"could not decode the answer: {type(e).__name__}: {e}")
    return (True, value) if ok else (False, remote_error(value))
