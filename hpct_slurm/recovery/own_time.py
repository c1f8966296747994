"""A rank's own time per step, what fail-slow detection compares between nodes (issue 47).

In a synchronous job every rank's step takes as long as the slowest rank's: the others wait
for it inside the step's collectives. What differs is the time a rank spends on its own work:
loading its data, its forward and backward, its optimizer update. So a rank measures, for each
step, the step's wall time (from the end of the step before to the end of this one) less the
time it waited inside the job's collectives (`waiting`, entered by the gradient reduction: the
fixed-order DDP hook and `job.allreduce_gradients`). Under DDP that is exactly the time before it
first waits on its peers plus its update: a node that computes or loads 1.3 x slower shows
1.3 x here, while its peers show their own pace (their wait grew instead).

It keeps the last `window` of them and the median (one slow step moves no median), which its
heartbeat carries (client.py); the controller compares nodes (controller/slowness.py). A
generation's first step is not measured (it begins with the formation and the restore), and a
new generation starts a new window: a survivor that took over a lost rank's data shards does
more work per step, and the controller compares only full windows. A rank that computes several
data shards per step reports its time per shard.

Pure apart from the clock the caller passes in; the training thread writes, the heartbeat thread
reads `figure` (one tuple, replaced whole).
"""
from __future__ import annotations

import collections
import statistics


class OwnTime:
    def __init__(self, window: int):
        self.window = window
        self._samples: collections.deque[float] = collections.deque(maxlen=window)
        self._generation = -1
        self._last_end: float | None = None
        self._waited = 0.0
        self._depth = 0
        self._since = 0.0
        # (median own seconds over the window, samples in it); (-1.0, 0): nothing measured yet
        self.figure: tuple[float, int] = (-1.0, 0)

    def wait_begins(self, now: float) -> None:
        if self._depth == 0:
            self._since = now
        self._depth += 1

    def wait_ends(self, now: float) -> None:
        if self._depth == 0:
            return  # a wait that began before the generation's window: nothing to subtract
        self._depth -= 1
        if self._depth == 0:
            self._waited += now - self._since

    def step_ends(self, generation: int, now: float, shards: int = 1) -> None:
        """A step of `generation` completed at `now`, with `shards` data shards computed."""
        if generation != self._generation:
            self._generation = generation
            self._samples.clear()
            self.figure = (-1.0, 0)
        elif self._last_end is not None:
            own = max(0.0, now - self._last_end - self._waited) / max(1, shards)
            self._samples.append(own)
            self.figure = (statistics.median(self._samples), len(self._samples))
        self._last_end, self._waited, self._depth = now, 0.0, 0
