"""What a node relay (relay.py) forwards to the controller, and when. Pure: no I/O, the caller
passes the time.

A relay turns its node's ranks' messages into few Batch frames. Two kinds of message:

* urgent ones, which the controller acts on: a Register, a Holdings report, a heartbeat that
  says ready, unhealthy or done (first time in its generation), the first StepDone of a
  generation (which ends a recovery round), a Goodbye, a rank's connection ending (Left).
  They go out as soon as every live local rank has sent one that settles it (a Holdings is
  always followed by its ready heartbeat, so it does not), or WINDOW_S after the first, whichever
  comes first: after a STOP the node's 8 ready reports leave as one frame, and a single
  rank's report waits at most WINDOW_S;
* routine ones, which only keep the controller's view fresh: the other heartbeats (running,
  collective, forming: a rank toggles between them at every allreduce) and the paced StepDone
  reports. A rank's newest routine message of a type replaces its older one, and they go out
  once per tick (the heartbeat interval), with any urgent ones before that.

The controller sees only what the ranks said: a rank that goes silent is not spoken for, so
its own silence timeout still finds it.
"""
from __future__ import annotations

from typing import Any

from .. import protocol as P
from ..events import RankState

# The longest an urgent message waits for its node's other ranks (a round's phases are
# budgeted in tenths of a second; survivors' ready reports spread over ~0.1 s).
WINDOW_S = 0.05
URGENT_STATES = frozenset({RankState.READY, RankState.UNHEALTHY, RankState.DONE})


class Coalescer:
    def __init__(self, tick_s: float, window_s: float = WINDOW_S):
        self.tick_s, self.window_s = tick_s, window_s
        self.live: set[int] = set()  # local ranks registered and not left
        self.items: list[tuple[int, Any, bool]] = []  # (local rank, message, routine)
        self.urgent_since: float | None = None
        self.settled: set[int] = set()  # ranks with a settling message since urgent_since
        self.last_flush = float("-inf")
        # per rank: the (generation, state) of its last urgent heartbeat passed on, and the
        # generation of its last StepDone passed on
        self.said: dict[int, tuple[int, str]] = {}
        self.reported: dict[int, int] = {}

    def add(self, local_rank: int, msg: Any, now: float) -> None:
        """Take one message from a local rank (a `P.Left` when its connection ended)."""
        routine, settles = self._kind(local_rank, msg)
        if isinstance(msg, P.Register):
            self.live.add(local_rank)
        elif isinstance(msg, P.Left):
            self.live.discard(local_rank)
            self.said.pop(local_rank, None)
            self.reported.pop(local_rank, None)
        if routine:
            self.items = [it for it in self.items
                          if not (it[2] and it[0] == local_rank and type(it[1]) is type(msg))]
        elif self.urgent_since is None:
            self.urgent_since = now
        if settles:
            self.settled.add(local_rank)
        self.items.append((local_rank, msg, routine))

    def _kind(self, lr: int, msg: Any) -> tuple[bool, bool]:
        """(routine, settles) for one message."""
        if isinstance(msg, P.Heartbeat):
            said = (msg.generation, msg.state)
            if msg.state in URGENT_STATES and self.said.get(lr) != said:
                self.said[lr] = said
                return False, True
            return True, False
        if isinstance(msg, P.StepDone):
            if self.reported.get(lr) != msg.generation:
                self.reported[lr] = msg.generation
                return False, True
            return True, False
        if isinstance(msg, P.Holdings):
            return False, False
        return False, True

    def wait_s(self, now: float) -> float | None:
        """Seconds until something is due (0: now), None while nothing is buffered."""
        if self.urgent_since is not None:
            if self.live <= self.settled:
                return 0.0
            return max(0.0, self.urgent_since + self.window_s - now)
        if self.items:
            return max(0.0, self.last_flush + self.tick_s - now)
        return None

    def due(self, now: float) -> bool:
        left = self.wait_s(now)
        return left is not None and left <= 0.0

    def take(self, now: float) -> list[tuple[int, Any]]:
        """Everything buffered, in arrival order, for one flush."""
        out = [(lr, msg) for lr, msg, _ in self.items]
        self.items, self.urgent_since, self.settled = [], None, set()
        self.last_flush = now
        return out
