"""An agent's lease: on hosts that cannot see the client's state file (ssh), a new agent lives
only ``--lease`` seconds unless a client holding the reservation's keys asks it something.

``serve`` saves the reservation and then asks every agent (a ping): from then on the agent lives
as long as the reservation, for later commands from any client process. A ``serve`` killed
before it saved the reservation leaves agents nobody can ever reach (their keys died with it),
holding the host's GPUs in their warm processes; such an agent ends itself, and its directory,
when the lease runs out. Nothing else sends an agent a request before ``serve`` saves (discovery
is through the address file, the hosts' reachability check is a bare TCP connect), so the first
request is the client's confirmation; only holders of the keys get past CURVE.
"""

from __future__ import annotations

import os
import shutil
import sys
import time

from ...config import env


class Lease:
    """Running out ``seconds`` after the agent started, unless :meth:`confirm`\\ ed first."""

    def __init__(self, seconds: float | None = None) -> None:
        self.seconds = seconds
        self.deadline = None if seconds is None else time.monotonic() + seconds
        self.ran_out = False

    def confirm(self) -> None:
        """A client holding the keys asked something: the reservation was saved."""
        if self.deadline is not None:
            self.deadline = None
            print(
                "monarch agent: a client confirmed this reservation; it lives until stopped",
                file=sys.stderr,
                flush=True,
            )

    def check(self) -> bool:
        """True once the lease has run out unconfirmed (said once, in the agent's log)."""
        if self.deadline is None or time.monotonic() < self.deadline:
            return False
        if not self.ran_out:
            self.ran_out = True
            print(
                f"monarch agent: no client confirmed this reservation within its {self.seconds:g} s lease "
                "(the serve that started it ended before saving it); exiting",
                file=sys.stderr,
                flush=True,
            )
        return True


def remove_own_directory(reservation: str) -> None:
    """Remove the reservation's directory on this host (``$MONARCH_REMOTE_DIR/<reservation>``,
    the agent's working directory, with its keys): after an unconfirmed lease nobody will."""
    root = env.remote_dir
    here = os.path.realpath(os.getcwd())
    if not root or not reservation or os.path.basename(here) != reservation:
        return
    if os.path.dirname(here) == os.path.realpath(os.path.expanduser(root)):
        shutil.rmtree(here, ignore_errors=True)


__all__ = ["Lease", "remove_own_directory"]
