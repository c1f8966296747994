"""A rank's own time per step, what fail-slow detection compares between nodes (issue 47).

In a synchronous job every rank's step takes as long as the slowest rank's: the others wait
for it inside the step's collectives. What differs is the time a rank spends on its own work:
loading its data, its forward and backward, its optimizer update. So a rank measures, for each
step, the step's wall time (from the end of the step before to the end of this one) less the
time it waited inside the job's collectives (`waiting`, entered by the gradient reduction: the
fixed-order DDP hook and `job.allreduce_gradients`). Under DDP that is exactly the time before it
first waits on its peers plus its update: a node that computes or loads 1.3 x slower shows
1.3 x here, while its peers show their own pace (their wait grew instead).

It keeps the last `window` of them and their upper median (`median_high`: a sample, never the
mean of the two middle ones, so a node found slow reads its slowdown, not half of it; one slow
step moves no median), which its heartbeat carries (client.py); the controller compares nodes (controller/slowness.py). A
generation's first step is not measured (it begins with the formation and the restore), and a
new generation starts a new window: a survivor that took over a lost rank's data shards does
more work per step, and the controller compares only full windows. A rank that computes several
data shards per step reports its time per shard.

On a GPU (an NCCL job) the host's clock says nothing: the host enqueues a collective and goes
on, and waits later wherever it syncs, for its own kernels and its peers' alike. There
`DeviceOwnTime` times the same intervals on the GPU: CUDA events recorded on the current stream
at each step's end and around each wait (the compute stream idles from the event before a
collective to the one after it, which completes once the collective has), read once the
step's last event has happened, a step or two later.

Pure apart from the clock the caller passes in (or the events it records); the training thread
writes, the heartbeat thread reads `figure` (one tuple, replaced whole).
"""
from __future__ import annotations

import collections
import statistics
from typing import Any, Callable

# Steps whose events the GPU has not reached yet, at most: a host further ahead than this is
# not measured for the steps it dropped (a median over a window does not need every step).
PENDING_MAX = 16


class OwnTime:
    def __init__(self, window: int):
        self.window = window
        self._samples: collections.deque[float] = collections.deque(maxlen=window)
        self._generation = -1
        self._last_end: float | None = None
        self._waited = 0.0
        self._depth = 0
        self._since: Any = None  # the outermost open wait's start (a time, or an event)
        # (median own seconds over the window, samples in it); (-1.0, 0): nothing measured yet
        self.figure: tuple[float, int] = (-1.0, 0)
        # A job whose ranks differ in work by design (pipeline stages) measures nothing: its
        # figure stays (-1.0, 0) and the controller never judges it
        self.off = False

    # Waits nest (a hook's reduction inside job.allreduce_gradients): the outermost counts.
    def wait_begins(self, now: float) -> None:
        if self._depth == 0:
            self._since = self._stamp(now)
        self._depth += 1

    def wait_ends(self, now: float) -> None:
        if self._depth == 0:
            return  # a wait that began before the generation's window: nothing to subtract
        self._depth -= 1
        if self._depth == 0:
            self._waited_for(self._since, self._stamp(now))

    def _stamp(self, now: float) -> Any:
        """A point in time: the host clock's reading here, a recorded event on a GPU."""
        return now

    def _waited_for(self, began: Any, ended: Any) -> None:
        self._waited += ended - began

    def step_ends(self, generation: int, now: float, shards: int = 1) -> None:
        """A step of `generation` completed at `now`, with `shards` data shards computed."""
        if generation != self._generation:
            self._restart(generation)
        elif self._last_end is not None:
            self._add(max(0.0, now - self._last_end - self._waited) / max(1, shards))
        self._last_end, self._waited, self._depth = now, 0.0, 0

    def _restart(self, generation: int) -> None:
        self._generation = generation
        self._samples.clear()
        self.figure = (-1.0, 0)

    def _add(self, own: float) -> None:
        if self.off:
            return
        self._samples.append(own)
        self.figure = (statistics.median_high(self._samples), len(self._samples))


class DeviceOwnTime(OwnTime):
    """The same figure for a rank on a GPU, from CUDA events (see the module docstring).
    `event`: makes a timing event (torch.cuda.Event(enable_timing=True)): recorded on the
    current stream by `record()`, `query()` once the GPU reached it, `elapsed_time(other)` in
    milliseconds."""

    def __init__(self, window: int, event: Callable[[], Any] | None = None):
        super().__init__(window)
        if event is None:
            import torch

            def event() -> Any:
                return torch.cuda.Event(enable_timing=True)
        self._event = event
        self._waits: list[tuple[Any, Any]] = []     # this step's (before, after) wait events
        self._end: Any = None                       # the step before's end event
        self._pending: collections.deque[tuple[Any, Any, list, int]] = collections.deque()

    def _stamp(self, now: float) -> Any:
        e = self._event()
        e.record()
        return e

    def _waited_for(self, began: Any, ended: Any) -> None:
        self._waits.append((began, ended))  # read once the GPU has passed them

    def step_ends(self, generation: int, now: float, shards: int = 1) -> None:
        end = self._stamp(now)
        if generation != self._generation:
            self._restart(generation)
            self._pending.clear()
        elif self._end is not None:
            if len(self._pending) >= PENDING_MAX:
                self._pending.popleft()
            self._pending.append((self._end, end, self._waits, shards))
        self._end, self._waits, self._depth = end, [], 0
        while self._pending and self._pending[0][1].query():
            start, stop, waits, n = self._pending.popleft()
            ms = start.elapsed_time(stop) - sum(b.elapsed_time(a) for b, a in waits)
            self._add(max(0.0, ms / 1000.0) / max(1, n))
