"""What an accept loop does when `accept` fails: pause, say so once, and go on.

Every server of a job accepts in a loop: a rank's transfer server (recovery/transfer.py), a
rendezvous store shard (rendezvous/shard_server.py), the node relay (relay/node.py) and the
controller (controller/accepting.py). `accept` fails when the process or the system is out of
descriptors (EMFILE/ENFILE: another user's crowd of connections, or the training's own
files) or memory, or when a connection died in the backlog; the listener itself is fine.
Ending the loop would leave the server unreachable for good, and retrying at once spins (the
listener stays readable): wait, doubling up to `max_s`, and accept again; a freed descriptor
may cut the wait short (the caller's business).

Saying so: at most one record per `every_s` however often accepting fails, with how many
failures it covers. Writing that record may itself need a descriptor: the event log holds it
(events.EventLog), and `accepted` writes what it held once accepting works again.
"""
from __future__ import annotations

import errno
import time
from typing import Any, Callable

from .events import EventLog

BACKOFF_FIRST_S = 0.01
BACKOFF_MAX_S = 1.0
NOTE_EVERY_S = 30.0


def describe(exc: OSError) -> str:
    return f"{exc.strerror or exc} (errno {exc.errno})"


class AcceptPause:
    """One accept loop's pause state. `note(**fields)` records the failure (the server's own
    `*.accept_failed` event); `events`: the log to flush when accepting works again."""

    def __init__(self, note: Callable[..., Any], events: EventLog | None = None,
                 max_s: float = BACKOFF_MAX_S, every_s: float = NOTE_EVERY_S,
                 clock: Callable[[], float] = time.monotonic):
        self._note, self._events = note, events
        self.max_s, self.every_s, self._clock = max_s, every_s, clock
        self.backoff = 0.0
        self.failures = 0  # since the last note
        self._noted: float | None = None
        self.paused = False

    def failed(self, exc: OSError) -> float:
        """Accepting failed with `exc`: the seconds to wait before accepting again."""
        self.paused = True
        self.failures += 1
        now = self._clock()
        # a connection that died in the backlog is the peer's doing: not worth a record
        if exc.errno != errno.ECONNABORTED and (self._noted is None
                                                or now - self._noted >= self.every_s):
            self._noted = now
            failures, self.failures = self.failures, 0
            self._note(error=f"{describe(exc)}; pausing accepts, retrying",
                       failures=failures)
        self.backoff = min(self.max_s, self.backoff * 2 or BACKOFF_FIRST_S)
        return self.backoff

    def accepted(self) -> None:
        """Accepting works (again): the next failure waits the shortest time, and what the
        event log held while out of descriptors is written now."""
        self.backoff = 0.0
        # Paused until what was held is written: the accept that ended the pause took the one
        # descriptor just freed, so the file may not open yet; every later accept tries again.
        if self.paused:
            self.paused = self._events is not None and not self._events.flush()
