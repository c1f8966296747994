"""Test fault injection: a second fault landed in a named phase of a recovery, not raced for.

`HPCT_FAULT_TAKER_DIES_AT=PHASE` (set by tests and `bench stress`, never by users): the first
process that takes over a lost rank's position (a spare adopting a rank after a fault) kills
itself (SIGKILL: no goodbye, its shard server and sockets die with it, as on a crashed node)
when it reaches PHASE of its adoption:

- `assigned`: right after it took the assignment, before anything else;
- `store`: its node's shard server of the new generation is up, the group not yet formed;
- `connect`: inside the formation, once this process has read every member's address (gloo's
  exchange through the store), while the pairs connect: the window where survivors once sat
  5 x the init timeout (issue 30);
- `pull`: while it pulls its state from the survivors (the striped prefetch under way);
- `first_step`: the group formed and the state restored, at its first step.

One taker dies per job: the first to claim `<run dir>/fault-taker-died` (O_EXCL); the spare
that takes over after it goes through. The same mechanism serves the flaky-race tests turned
deterministic and the stress bench's sweep over phases.
"""
from __future__ import annotations

import os
import signal
import threading
import time
from pathlib import Path
from typing import Any

import torch

from ..config import TAKER_PHASES as PHASES
from ..events import Ev, EventLog

__all__ = ["PHASES", "TakerFault", "flip_one_bit"]
# `connect`: the others finish reading this node's shard before it dies (their reads take
# milliseconds), so the formation fails in the pair connects, not at the store: those that
# wait for its connect give up after 5 x a pair's timeout (pg.init), the worst of the phases.
CONNECT_GRACE_S = 0.5
# `pull`: the prefetch's connections are open and its first stripes under way
PULL_GRACE_S = 0.05


class TakerFault:
    def __init__(self, phase: str | None, run_dir: Path, events: EventLog):
        self.phase = phase or None
        self.run_dir, self.events = Path(run_dir), events
        self.armed = False  # this process is a taker in the adoption under way

    def arm(self, newcomer: bool, generation: int) -> None:
        """At an adoption: armed for a process that takes over a position after a fault."""
        self.armed = self.phase is not None and newcomer and generation > 0

    def at(self, phase: str, rank: int) -> None:
        """Die here if this is the phase, this process a taker, and no taker died yet."""
        if not (self.armed and phase == self.phase):
            return
        self.armed = False
        try:
            fd = os.open(self.run_dir / "fault-taker-died", os.O_CREAT | os.O_EXCL | os.O_WRONLY,
                         0o600)
        except FileExistsError:
            return  # a taker died already: this one takes over for good
        os.close(fd)
        self.events.emit(Ev.FAULT_INJECTED, rank=rank, phase=phase, pid=os.getpid())
        if phase == "pull":
            # from a thread: the prefetch goes on meanwhile, as on a node that dies mid-pull
            threading.Thread(target=_die_after, args=(PULL_GRACE_S,), daemon=True).start()
        else:
            # `connect`: this thread stops where it would start connecting its pairs, while
            # its shard server and gloo's listener still answer the others, who have read its
            # address and connect to it or wait for it to connect; then it dies
            _die_after(CONNECT_GRACE_S if phase == "connect" else 0.0)


def _die_after(seconds: float) -> None:
    if seconds:
        time.sleep(seconds)
    os.kill(os.getpid(), signal.SIGKILL)


def flip_one_bit(state: Any, events: EventLog, rank: int, step: int) -> None:
    """`HPCT_FAULT_FLIP_RANK`/`_STEP`: silent data corruption, between two steps: one bit of
    the first shared parameter of this rank flips in place, and nothing else happens (what
    the replicas' cross-check must find: crosscheck.py)."""
    _, tensors = state.plan(("shared",), rng=False)
    t = next(t for t in tensors if t.is_floating_point() and t.numel())
    with torch.no_grad():
        t.view(-1)[:1].view(torch.int16 if t.element_size() == 2 else torch.int32)[0] ^= 1 << 9
    events.emit(Ev.FAULT_INJECTED, rank=rank, phase="bit_flip", step=step, pid=os.getpid())
