"""Fail-slow: which node drags the job (issue 47). Pure: no I/O; failslow.py acts on it.

Every rank's heartbeat carries its own time per step, a median over its last `window` steps
(recovery/own_time.py): the step's wall time less the time it waited on its peers, which in a
synchronous job is what a slow node has more of and its peers do not. A node's figure is its
slowest rank's (one throttled GPU drags the node's whole share). A node is slow when its figure
is above `ratio` x the median of the *other* nodes' figures: with itself left out, a job of two
nodes still has a reference, and one slow node never raises its own bar.

What does not count as slow, on purpose:
* a job-wide slowdown (a bigger batch, an I/O stall all nodes share, a checkpoint): every
  node's figure grows together and no ratio moves;
* one slow step, or a few: a median over `window` steps moves only when more than half of
  them are slow, which also makes "stays above for a window" the rule;
* a node whose ranks have not all filled a window in this generation (each rank starts a
  new window at a generation: a replacement, a survivor that took over more work);
* a difference below MIN_EXCESS_S per step: on a step of a few milliseconds a ratio is noise.
"""
from __future__ import annotations

import math
import statistics
from dataclasses import dataclass
from typing import Iterable

# Below this many seconds of own time per step more than the others', no node is slow.
MIN_EXCESS_S = 0.001


@dataclass(frozen=True)
class Figure:
    """One rank's report: its node, its median own time over its window, the window's fill."""

    node: str
    own_s: float
    samples: int


@dataclass(frozen=True)
class Slow:
    node: str
    ratio: float     # its figure / the other nodes' median
    node_s: float    # its figure: its slowest rank's median own time per step
    job_s: float     # the other nodes' median figure
    window: int


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
    """The slow nodes, slowest first (see the module docstring)."""
    per_node = node_figures(figures, window)
    if len(per_node) < 2:
        return []
    out = []
    for node, own in per_node.items():
        ref = statistics.median(v for n, v in per_node.items() if n != node)
        if own > ratio * ref and own - ref >= MIN_EXCESS_S:
            out.append(Slow(node, own / ref if ref > 0 else math.inf, own, ref, window))
    return sorted(out, key=lambda s: -s.ratio)


def drain_reason(s: Slow) -> str:
    """The node's Slurm drain reason: what an admin reads in `sinfo -R`."""
    return f"fail-slow: {s.ratio:.2f} x job median over {s.window} steps"
