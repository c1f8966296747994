"""A rank's own time per step, what fail-slow detection compares between nodes (issue 47).

In a synchronous job every rank's step takes as long as the slowest rank's: the others wait
for it inside the step's collectives. What differs is the time a rank spends on its own work:
loading its data, its forward and backward. So a rank measures, for each step, the time from
the end of the step before to the end of the step's last wait inside the job's collectives
(`waiting`, entered by the gradient reduction: the fixed-order DDP hook and
`job.allreduce_gradients`), less the time it waited in them, plus the time it took to fetch its
next batch where the loop fetches it after that (`fetched`: `job.steps` takes the next batch
before it ends a step). Under DDP that is its data loading, forward and backward: a node that
computes or loads 1.3 x slower shows 1.3 x here, while its peers show their own pace (their
wait grew instead).

What a rank does after its step's last collective is left out on purpose: that is where a
script puts what only some ranks do (rank 0's evaluation, logging, a checkpoint write), which
every other rank then waits for at the next collective just as for a slow node. The node is
not slow; moved, the work would follow the rank onto the spare. The optimizer update, left out
with it, is the same work on every rank. A step with no wait the rank sees (a script that
reduces its own gradients) counts whole, as its peers' steps then do too.

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
step's last event has happened, a step or two later. A batch's fetch is the host's work and
is timed on its clock.

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
        self._last_wait: float | None = None  # when this step's last wait ended (host clock)
        self._fetch = 0.0  # seconds fetching batches since then: own time, after the waits
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
            self._last_wait, self._fetch = now, 0.0  # a fetch before it is inside the count

    def fetched(self, seconds: float) -> None:
        """The loop took `seconds` to fetch a batch (its data loading: own time wherever it
        falls in the step)."""
        self._fetch += seconds

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
            if self._last_wait is None:  # no wait seen: the whole step
                own = now - self._last_end
            else:
                own = self._last_wait - self._last_end - self._waited + self._fetch
            self._add(max(0.0, own) / max(1, shards))
        self._last_end = now
        self._next_step()

    def _next_step(self) -> None:
        self._waited, self._depth, self._last_wait, self._fetch = 0.0, 0, None, 0.0

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
        # (the step before's end, this step's end, its waits, its shards, its seconds fetched
        # after its last wait)
        self._pending: collections.deque[tuple[Any, Any, list, int, float]] = \
            collections.deque()

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
            fetch = self._fetch if self._waits else 0.0
            self._pending.append((self._end, end, self._waits, shards, fetch))
        self._end, self._waits = end, []
        self._next_step()
        while self._pending and self._pending[0][1].query():
            start, stop, waits, n, fetch = self._pending.popleft()
            if waits:  # up to its last wait's end, less the waits (see OwnTime.step_ends)
                ms = start.elapsed_time(waits[-1][1]) - \
                    sum(b.elapsed_time(a) for b, a in waits)
            else:
                ms = start.elapsed_time(stop)
            self._add(max(0.0, ms / 1000.0 + fetch) / max(1, n))
