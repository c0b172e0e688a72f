"""Before a reservation's first multi-host run: can every host reach rank 0's rendezvous port?

Rank 0's host holds the run's TCPStore port (its agent binds and listens on it before any rank
starts). A host that cannot open a TCP connection there (a firewall between hosts, a
``--master-addr`` the others cannot route to) otherwise shows as gloo's "Connection refused" or
a rendezvous timeout tens of seconds later, blamed on a rank. Each other host's agent opens one
connection to that port and says how it failed; the first failure becomes one line naming both
hosts, the address and the port.
"""

from __future__ import annotations

from collections.abc import Sequence

from ..runtime import protocol
from ..runtime.mailbox.mailbox import Mailbox
from ..schedulers.base import HostRecord

__all__ = ["unreachable_rendezvous"]

PROBE_TIMEOUT_S = 3.0


def unreachable_rendezvous(
    mb: Mailbox, hosts: Sequence[HostRecord], nodes: Sequence[int], address: str, port: int
) -> str | None:
    """One line on the first of ``nodes`` (host indexes, not 0) that cannot connect to
    ``address:port``, or None when all can. An agent that does not answer is not judged here:
    the run's own liveness checks name it."""
    target = f"tcp://[{address}]:{port}" if ":" in address else f"tcp://{address}:{port}"
    asked = []
    for n in nodes:

        def probe(cid: int) -> protocol.ProbePeers:
            return protocol.ProbePeers(cid, mb.address, [target], PROBE_TIMEOUT_S)

        asked.append((n, mb.request(hosts[n].agent, probe)))
    failed: list[tuple[int, str]] = []
    for n, fut in asked:
        try:
            why = str(dict(fut.get(timeout=PROBE_TIMEOUT_S + 15)).get(target, ""))
        except Exception:  # noqa: BLE001 - not answering is the heartbeat's to report
            continue
        if why:
            failed.append((n, why))
    if not failed:
        return None
    n, why = failed[0]
    more = f" (and {len(failed) - 1} more host(s))" if len(failed) > 1 else ""
    return (
        f"host {hosts[n].name} cannot reach {hosts[0].name}'s rendezvous port {address}:{port}: {why}{more}; "
        "open TCP between the hosts on the agents' port range, or pass --master-addr an address they share"
    )
