"""Fail-slow: a node that drags the job is named, and where the job asks, drained and moved
out (issue 47).

The watchdog (detection.py) calls `check` at every sweep; slowness.py decides which node is
slow from the ranks' heartbeats: found slow, then held over a window of the job's steps that
the job's step rate shows. For a slow node, once per job:
* `node.slow`, with its ratio and what was measured;
* HPCT_FAILSLOW=report (the default): the event only. Nothing a controller can measure tells a
  node that computes slower from a rank the script gives more to do before its step's last
  collective (rank 0 evaluating or logging at the top of its step); draining a node is the
  site's to decide, and a drained node makes the next job wait for nodes it did not ask about;
* HPCT_FAILSLOW=move: the node is drained in Slurm with a reason that says what was measured
  ("hpct: fail-slow: own time 0.15 s/step, 1.50 x the other nodes' 0.1 s, held 50 steps (job
  0.155 s/step)"), so the site sees it in `sinfo -R`, and its ranks move onto a ready warm
  spare by the planned move (lifecycle.py): a step boundary, nothing recomputed. Without a
  ready spare (or while another round runs) the node trains on, drained, and moves once a
  spare is ready: asked again at every sweep. A moved node never comes back into this job
  (lifecycle._release), and `spares check` leaves a node drained for slowness to the admin
  (spares/pool.py): a probe that it runs `true` says nothing about its speed.
A node found slow that does not hold is `node.slow_dismissed`; a figure that cannot be a
measurement is `node.slow_figure_refused` (each once per node and generation).
Nothing is judged while a round runs or a fault waits: the ranks then start new windows, and
whatever was found slow starts its hold again.
"""
from __future__ import annotations

import asyncio
import os
import time
from typing import Any, Protocol

from .. import config as C
from ..errors import HpctError, describe
from ..events import Ev
from ..fault_count import CountingLog
from ..slurm.client import SlurmClient
from .connections import Conn
from .lifecycle import REASON_TAG, Lifecycle
from .policy import World
from .slowness import Confirmed, Figure, Hold, drain_reason, find_slow, screen

MEASURED = ("own time per step: the step's time up to its last collective less the time "
            "waited inside the job's collectives, plus the next batch's fetch, each rank's "
            "median over its window; a node: its slowest rank; the job: the other nodes' "
            "median; held over a window of the job's steps, whose wall time per step shows it")


class Host(Protocol):
    """What FailSlow uses of the controller (controller.Controller)."""

    slurm: SlurmClient
    events: CountingLog
    world: World
    lifecycle: Lifecycle
    recovering: bool
    pending_faults: dict[str, str]
    finished: asyncio.Event

    def _live(self, node: str) -> list[Conn]: ...


class FailSlow:
    def __init__(self, ctl: Host, environ: Any = None):
        environ = os.environ if environ is None else environ
        self.ctl = ctl
        self.mode: str = C.read(environ, C.FAILSLOW)
        self.ratio: float = C.read(environ, C.SLOW_RATIO)
        self.window: int = C.read(environ, C.SLOW_WINDOW)
        self.said: set[str] = set()  # nodes named slow (once each)
        self.hold = Hold(self.window)
        # the generation judged, since when (the controller's clock), and the nodes whose
        # dismissal or refused figure it has said
        self.generation, self.generation_since = -1, 0.0
        self.told: set[tuple[str, str]] = set()
        # slow nodes whose move has not started (a round ran, no spare was ready): asked
        # again at every sweep, whether or not Slurm took the drain
        self.moving: dict[str, str] = {}
        self.tasks: list[asyncio.Task] = []

    def check(self, now: float | None = None) -> None:
        c = self.ctl
        now = time.monotonic() if now is None else now
        for node, why in list(self.moving.items()):
            if node not in c.world.members or node in c.lifecycle.requested or \
                    c.lifecycle.request_move(node, why):
                del self.moving[node]
        if c.world.generation != self.generation:
            self.generation, self.generation_since = c.world.generation, now
            self.told.clear()
            self.hold.clear()
        if self.mode == "off" or c.recovering or c.pending_faults or c.finished.is_set():
            self.hold.clear()
            return
        current = [x for n in c.world.members for x in c._live(n)
                   if x.generation == c.world.generation]
        steps = [x.step for x in current if x.step >= 0]
        if not steps:
            return
        figures, refused = screen([Figure(x.node, x.own_s, x.own_n) for x in current],
                                  self.window, now - self.generation_since)
        for r in refused:
            if self._once(r.node, "refused"):
                c.events.emit(Ev.NODE_SLOW_FIGURE_REFUSED, node=r.node, own_s=r.own_s,
                              samples=r.samples, why=r.why, generation=self.generation)
        found = [s for s in find_slow(figures, self.ratio, self.window)
                 if s.node not in self.said]
        confirmed, dismissed = self.hold.sweep(found, min(steps), now)
        for d in dismissed:
            if self._once(d.slow.node, "dismissed"):
                c.events.emit(Ev.NODE_SLOW_DISMISSED, node=d.slow.node,
                              ratio=round(d.slow.ratio, 3), node_s=round(d.slow.node_s, 6),
                              job_s=round(d.slow.job_s, 6), held_steps=d.held_steps,
                              why=d.why, generation=self.generation)
        for v in confirmed:
            self.said.add(v.slow.node)
            step = max((x.step for x in current if x.node == v.slow.node), default=-1)
            self._act(v, step)

    def _once(self, node: str, what: str) -> bool:
        """Whether `what` is yet to be said of `node` in this generation (then it is)."""
        if (node, what) in self.told:
            return False
        self.told.add((node, what))
        return True

    def _act(self, v: Confirmed, step: int) -> None:
        c, s = self.ctl, v.slow
        if self.mode == "report":
            action = "reported only (HPCT_FAILSLOW=report)"
        elif c.lifecycle._ready_spares():  # what request_move itself asks
            action = "drained; moving its ranks onto a warm spare"
        else:
            action = "drained; no warm spare ready: it trains on until one is"
        c.events.emit(Ev.NODE_SLOW, node=s.node, ratio=round(s.ratio, 3),
                      node_s=round(s.node_s, 6), job_s=round(s.job_s, 6), window=s.window,
                      held_steps=v.held_steps, job_step_s=round(v.job_step_s, 6),
                      threshold=self.ratio, step=step, generation=c.world.generation,
                      action=action, measured=MEASURED)
        if self.mode == "move":
            self.tasks.append(asyncio.ensure_future(self._drain_and_move(v)))

    async def _drain_and_move(self, v: Confirmed) -> None:
        c, node = self.ctl, v.slow.node
        why = drain_reason(v)
        try:
            await asyncio.to_thread(c.slurm.update_node, node, "DRAIN", f"{REASON_TAG} {why}")
        except HpctError as exc:
            # the move goes on: the site then reads why in the events and the job's comment
            c.events.emit(Ev.SLURM_ERROR, node=node, error=describe(exc))
        # at once where a spare is ready; else at a later sweep (check)
        if not c.lifecycle.request_move(node, why) and node not in c.lifecycle.requested:
            self.moving[node] = why
