"""Spares on their way: whether a round waits for one before it gives up (issue 45).

A round short of ready spares used to decide at once: a second fault while a pool spare was
being borrowed requeued 1.6 s after the borrow, 0.9 s before the spare joined; a rank process
that died on a healthy node requeued 2 ms after its fence, though the node came back as a
spare moments later. A spare that is known to be coming is now waited for, within a bound
(HPCT_SPARE_WAIT_S), before the round decides: a replacement costs seconds, a requeue a
restart from the last persisted snapshot.

What counts as coming (`Arrivals`): a spare step launched whose ranks have not all registered;
a healthy node fenced alive whose cancelled step is not gone yet (it comes back as a spare once
it is: fencing.py); a companion job borrowed from the pool whose node has not joined. Pure:
the controller gathers the facts (recovery_round.py) and polls `should_wait`.
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Arrivals:
    """The spares on their way now."""

    registering: tuple[str, ...] = ()  # spare steps launched, not every rank registered
    returning: tuple[str, ...] = ()    # healthy nodes fenced alive: spares once their step is gone
    borrowed: int = 0                  # pool companions whose node has not joined yet

    @property
    def count(self) -> int:
        return len(self.registering) + len(self.returning) + self.borrowed

    def fields(self) -> dict:
        """As an event's fields."""
        return {"registering": list(self.registering), "returning": list(self.returning),
                "borrowed": self.borrowed}


def arrivals(spares: list[str], ready: list[str], unusable: set[str] | frozenset[str],
             fencing: list[str], borrowed: int, joined: int) -> Arrivals:
    """What is on its way. `spares`: the job's spares now (ready or not); `ready`: those whose
    every rank registered; `unusable`: nodes that will never be a spare (fenced dead, or with
    a fault pending); `fencing`: nodes fenced alive whose step cancel is under way;
    `borrowed` / `joined`: companion jobs submitted into the pool / pool nodes that joined."""
    return Arrivals(
        registering=tuple(s for s in spares if s not in ready and s not in unusable),
        returning=tuple(n for n in fencing if n not in spares and n not in unusable),
        borrowed=max(0, borrowed - joined))


def should_wait(lost: int, ready: int, coming: Arrivals, waited_s: float,
                bound_s: float) -> bool:
    """Whether the round waits (and asks again) rather than decide now: it is short of ready
    spares, enough are on their way to cover the shortfall, and it has not waited `bound_s`
    yet. Waiting when too few are coming would only delay the same escalation (or shrink)."""
    short = lost - ready
    return short > 0 and coming.count >= short and waited_s < bound_s
