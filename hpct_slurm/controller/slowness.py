"""Fail-slow: which node drags the job (issue 47). Pure: no I/O; failslow.py acts on it.

Every rank's heartbeat carries its own time per step, a median over its last `window` steps
(recovery/own_time.py): the step's time up to its last collective less the time it waited on
its peers, which in a synchronous job is what a slow node has more of and its peers do not. A
node's figure is its slowest rank's (one throttled GPU drags the node's whole share). A node is
found slow when its figure is above `ratio` x the median of the *other* nodes' figures: with
itself left out, a job of two nodes still has a reference, and one slow node never raises its
own bar.

What does not count as slow, on purpose:
* a job-wide slowdown (a bigger batch, an I/O stall all nodes share, a checkpoint): every
  node's figure grows together and no ratio moves;
* one slow step, or a few: a median over `window` steps moves only when more than half of
  them are slow;
* a node whose ranks have not all filled a window in this generation (each rank starts a
  new window at a generation: a replacement, a survivor that took over more work);
* a difference below MIN_EXCESS_S per step: on a step of a few milliseconds a ratio is noise;
* a figure that cannot be a measurement (`screen`): not finite, or more own time than the
  generation has lasted. An authenticated rank can still send any number: one that reported
  1e308 s read as "inf x job median" and drained its node. Its node is not judged;
* a reference of zero: the other nodes measured nothing to compare with.

Found slow is not yet slow (`Hold`): on a machine whose cores are shared (a loaded local
cluster), healthy nodes read 1.24 x and 1.25 x for a while and then fell back. A node is slow
once it has been found slow at every sweep over `window` more of the job's steps (its figure is
then a median of steps all taken since it was first found), and the job's own step rate over
those steps shows it: a node that drags the job makes every step longer by its excess, so the
job's wall time per step, from the steps the ranks report and the controller's clock, must
exceed the other nodes' figure by at least SHOWN of the excess the node's figure claims.
"""
from __future__ import annotations

import math
import statistics
from dataclasses import dataclass
from typing import Iterable

# Below this many seconds of own time per step more than the others', no node is slow.
MIN_EXCESS_S = 0.001
# The share of a slow node's excess own time per step that the job's step time must show.
# The job's step time is measured from step numbers the ranks report at most every
# heartbeat, so over one window it can read a little short; a node that really drags the job
# shows all of its excess there (its peers wait for it), a figure the job does not feel
# shows none.
SHOWN = 0.5


@dataclass(frozen=True)
class Figure:
    """One rank's report: its node, its median own time over its window, the window's fill."""

    node: str
    own_s: float
    samples: int


@dataclass(frozen=True)
class Refused:
    """A figure `screen` would not judge, and why."""

    node: str
    own_s: float
    samples: int
    why: str


@dataclass(frozen=True)
class Slow:
    node: str
    ratio: float     # its figure / the other nodes' median
    node_s: float    # its figure: its slowest rank's median own time per step
    job_s: float     # the other nodes' median figure
    window: int


@dataclass(frozen=True)
class Confirmed:
    """A node found slow at every sweep over `held_steps` of the job's steps, which took
    `job_step_s` each."""

    slow: Slow       # its figures at the end of the hold
    held_steps: int
    job_step_s: float


@dataclass(frozen=True)
class Dismissed:
    """A node found slow that was not confirmed: `why`."""

    slow: Slow       # its figures when it was last found slow
    held_steps: int
    why: str


def implausible(f: Figure, elapsed_s: float) -> str | None:
    """Why `f` cannot be a rank's measurement in a generation `elapsed_s` seconds old; None
    where it can be."""
    if not math.isfinite(f.own_s):
        return "not a finite number"
    # an upper median over n samples: n - n // 2 of them are at least as long
    at_least = f.samples - f.samples // 2
    if f.own_s * at_least > elapsed_s:
        return (f"{at_least} of its {f.samples} steps would have taken {f.own_s:.3g} s or "
                f"more each: longer than the {elapsed_s:.1f} s since the generation began")
    return None


def screen(figures: Iterable[Figure], window: int,
           elapsed_s: float) -> tuple[list[Figure], list[Refused]]:
    """The figures worth judging, and those refused as implausible. A figure without a full
    window (or -1: nothing measured yet) is neither: it is not a measurement yet. A node with
    a refused figure is not judged at all: its slowest rank is not known."""
    full, refused = [], []
    for f in figures:
        if f.samples < window or (math.isfinite(f.own_s) and f.own_s < 0):
            continue
        why = implausible(f, elapsed_s)
        if why is None:
            full.append(f)
        else:
            refused.append(Refused(f.node, f.own_s, f.samples, why))
    bad = {r.node for r in refused}
    return [f for f in full if f.node not in bad], refused


def node_figures(figures: Iterable[Figure], window: int) -> dict[str, float]:
    """node -> its slowest rank's median, for nodes whose every reporting rank has a full
    window; a rank with no measurement (or a value that is not one) leaves its node out."""
    by_node: dict[str, list[Figure]] = {}
    for f in figures:
        by_node.setdefault(f.node, []).append(f)
    out: dict[str, float] = {}
    for node, fs in by_node.items():
        if all(f.samples >= window and math.isfinite(f.own_s) and f.own_s >= 0 for f in fs):
            out[node] = max(f.own_s for f in fs)
    return out


def find_slow(figures: Iterable[Figure], ratio: float, window: int) -> list[Slow]:
    """The nodes found slow, slowest first (see the module docstring)."""
    per_node = node_figures(figures, window)
    if len(per_node) < 2:
        return []
    out = []
    for node, own in per_node.items():
        ref = statistics.median(v for n, v in per_node.items() if n != node)
        if ref > 0 and own > ratio * ref and own - ref >= MIN_EXCESS_S:
            out.append(Slow(node, own / ref, own, ref, window))
    return sorted(out, key=lambda s: -s.ratio)


@dataclass
class _Suspect:
    since_step: int
    since_s: float
    last: Slow


class Hold:
    """The nodes found slow, until each has held for `window` of the job's steps and the job's
    step rate shows it (the module docstring). `sweep` is told, at every judgement, what was
    found slow, the job's step and the time; `clear` when the windows restart (a new
    generation, a round)."""

    def __init__(self, window: int):
        self.window = window
        self._suspects: dict[str, _Suspect] = {}

    def clear(self) -> None:
        self._suspects.clear()

    def sweep(self, found: Iterable[Slow], step: int,
              now: float) -> tuple[list[Confirmed], list[Dismissed]]:
        found = {s.node: s for s in found}
        confirmed, dismissed = [], []
        for node in [n for n in self._suspects if n not in found]:
            sus = self._suspects.pop(node)
            dismissed.append(Dismissed(sus.last, step - sus.since_step,
                                       f"it was no longer found slow before it had held for "
                                       f"{self.window} steps"))
        for node, s in found.items():
            sus = self._suspects.setdefault(node, _Suspect(step, now, s))
            sus.last = s
            held = step - sus.since_step
            if held < self.window:
                continue
            del self._suspects[node]
            job_step_s = (now - sus.since_s) / held
            if job_step_s - s.job_s >= SHOWN * (s.node_s - s.job_s):
                confirmed.append(Confirmed(s, held, job_step_s))
            else:
                dismissed.append(Dismissed(s, held, f"the job's step rate does not show it: "
                                                    f"{job_step_s:.3g} s per step over "
                                                    f"{held} steps, for a node whose own time "
                                                    f"is {s.node_s:.3g} s"))
        return confirmed, dismissed


def drain_reason(c: Confirmed) -> str:
    """The node's Slurm drain reason: what an admin reads in `sinfo -R`. Finite by
    construction: `screen` refuses a figure that is not, and a zero reference is never
    judged."""
    s = c.slow
    return (f"fail-slow: own time {s.node_s:.3g} s/step, {s.ratio:.2f} x the other nodes' "
            f"{s.job_s:.3g} s, held {c.held_steps} steps (job {c.job_step_s:.3g} s/step)")
