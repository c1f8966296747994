"""Fail-slow: a node that drags the job is named, drained and moved out (issue 47).

The watchdog (detection.py) calls `check` at every sweep; slowness.py decides which node is
slow from the ranks' heartbeats. For a slow node, once per job:
* `node.slow`, with its ratio and what was measured;
* HPCT_FAILSLOW=move (the default): the node is drained in Slurm with a reason that says why
  ("hpct: fail-slow: 1.31 x job median over 50 steps"), so the site sees it in `sinfo -R`, and
  its ranks move onto a ready warm spare by the planned move (lifecycle.py): a step boundary,
  nothing recomputed. Without a ready spare (or while another round runs) the node trains on,
  drained, and moves once a spare is ready: asked again at every sweep. A moved
  node never comes back into this job (lifecycle._release), and `spares check` leaves a node
  drained for slowness to the admin (spares/pool.py): a probe that it runs `true` says
  nothing about its speed;
* HPCT_FAILSLOW=report: the event only.
Nothing is judged while a round runs or a fault waits: the ranks then start new windows.
"""
from __future__ import annotations

import asyncio
import os
from typing import Any, Protocol

from .. import config as C
from ..errors import HpctError, describe
from ..events import Ev
from ..fault_count import CountingLog
from ..slurm.client import SlurmClient
from .connections import Conn
from .lifecycle import REASON_TAG, Lifecycle
from .policy import World
from .slowness import Figure, Slow, drain_reason, find_slow

MEASURED = ("own time per step: the step's wall time less the time waited inside the job's "
            "collectives, each rank's median over its window; a node: its slowest rank; "
            "the job: the other nodes' median")


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
        # slow nodes whose move has not started (a round ran, no spare was ready): asked
        # again at every sweep, whether or not Slurm took the drain
        self.moving: dict[str, str] = {}
        self.tasks: list[asyncio.Task] = []

    def check(self) -> None:
        c = self.ctl
        for node, why in list(self.moving.items()):
            if node not in c.world.members or node in c.lifecycle.requested or \
                    c.lifecycle.request_move(node, why):
                del self.moving[node]
        if self.mode == "off" or c.recovering or c.pending_faults or c.finished.is_set():
            return
        current = [x for n in c.world.members for x in c._live(n)
                   if x.generation == c.world.generation]
        figures = [Figure(x.node, x.own_s, x.own_n) for x in current]
        for s in find_slow(figures, self.ratio, self.window):
            if s.node not in self.said:
                self.said.add(s.node)
                step = max((x.step for x in current if x.node == s.node), default=-1)
                self._act(s, step)

    def _act(self, s: Slow, step: int) -> None:
        c = self.ctl
        if self.mode == "report":
            action = "reported only (HPCT_FAILSLOW=report)"
        elif c.lifecycle._ready_spares():  # what request_move itself asks
            action = "drained; moving its ranks onto a warm spare"
        else:
            action = "drained; no warm spare ready: it trains on until one is"
        c.events.emit(Ev.NODE_SLOW, node=s.node, ratio=round(s.ratio, 3),
                      node_s=round(s.node_s, 6), job_s=round(s.job_s, 6), window=s.window,
                      threshold=self.ratio, step=step, generation=c.world.generation,
                      action=action, measured=MEASURED)
        if self.mode == "move":
            self.tasks.append(asyncio.ensure_future(self._drain_and_move(s)))

    async def _drain_and_move(self, s: Slow) -> None:
        c = self.ctl
        why = drain_reason(s)
        try:
            await asyncio.to_thread(c.slurm.update_node, s.node, "DRAIN", f"{REASON_TAG} {why}")
        except HpctError as exc:
            # the move goes on: the site then reads why in the events and the job's comment
            c.events.emit(Ev.SLURM_ERROR, node=s.node, error=describe(exc))
        # at once where a spare is ready; else at a later sweep (check)
        if not c.lifecycle.request_move(s.node, why) and s.node not in c.lifecycle.requested:
            self.moving[s.node] = why
