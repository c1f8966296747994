"""Detection: how the controller learns that a node is lost, and the one door a fault goes
through (`_fault`) to start a recovery round.

Faults come from everywhere: a dropped connection (connections.py), a step that exits or
srun's "Node failure on" line (steps.py), a rank's own report or failed health check (its
heartbeat), and from here: the watchdog (silence, no progress, a rank's own report after its
grace) and Slurm's view of the nodes (DOWN, NOT_RESPONDING), polled off the loop.
"""
from __future__ import annotations

import asyncio
import time

from ..errors import HpctError
from ..events import Ev, RankState, Role
from ..fault_count import IN_PROCESS, CountingLog
from ..slurm.client import SlurmClient
from .connections import Conn
from .failslow import FailSlow
from .lifecycle import Lifecycle
from .options import Options
from .pacing import Pacing
from .policy import World

# IN_PROCESS (fault_count.py, which counts such reports): a rank that caught a failure itself
# (an exception in its step, a failed restore) and is ready for the next generation, while
# nothing else is known to be lost: its process is healthy, so it restarts in place with
# everyone else instead of being replaced.
# How long a rank's own report waits for a harder cause (a peer's lost connection usually
# arrives within milliseconds of the collective error that made the rank report).
IN_PROCESS_GRACE_S = 0.5


class Detection:
    """The controller's fault detection (a piece of Controller, controller.py)."""

    # The controller's state this piece reads and writes (Controller.__init__ sets it up).
    o: Options
    slurm: SlurmClient
    events: CountingLog
    world: World
    pacing: Pacing
    conns: dict[tuple[str, int], Conn]
    dead_nodes: set[str]
    pending_faults: dict[str, str]  # node -> why, for the next recovery round
    fault_event: asyncio.Event  # wakes the round loop (recovery_round.py)
    recovering: bool
    finished: asyncio.Event
    script_error: str | None  # a rank said the script raised (connections.py): no more faults
    lifecycle: Lifecycle  # planned moves and growing back, from the same Slurm poll
    failslow: FailSlow  # a node that drags the job (failslow.py), judged at every sweep

    def _fault(self, node: str, reason: str) -> None:
        # once the job's end is written its ranks leave: their exits are no fault
        if self.finished.is_set() or self.events.faults.ended or node in self.pending_faults \
                or node in self.dead_nodes or self.script_error is not None:
            return
        if node not in self.world.members and node not in self.world.spares:
            # a node leaving in a planned move is no member any more, but its loss is seen
            self.lifecycle.leaving_lost(node, reason)
            return
        self.pending_faults[node] = reason
        self.events.emit(Ev.FAULT_DETECTED, node=node, reason=reason,
                         generation=self.world.generation,
                         role=Role.SPARE if node in self.world.spares else Role.ACTIVE)
        self.fault_event.set()

    async def _watchdog(self) -> None:
        while True:
            await asyncio.sleep(self.pacing.sweep_s)
            # records held while out of descriptors (events.py) are written once they are back
            self.events.flush()
            now = time.monotonic()
            reported = []
            for c in list(self.conns.values()):
                if c.gone or c.state == RankState.DONE:
                    continue
                if now - c.last_seen > self.pacing.silence_timeout_s:
                    self._fault(c.node, f"no heartbeat for {now - c.last_seen:.1f} s")
                elif c.state == RankState.RUNNING and not self.recovering \
                        and not self.pending_faults \
                        and now - c.progress_at > self.o.progress_timeout_s:
                    # (while a fault is handled nobody progresses: survivors are tearing down)
                    self._fault(c.node, f"no progress for {now - c.progress_at:.0f} s "
                                        f"(stuck after step {c.step})")
                elif c.reported_at is not None and now - c.reported_at > IN_PROCESS_GRACE_S:
                    reported.append(c)
            # The first rank to report is the one that failed; the others' collectives failed
            # because it left (and all of them restart in place anyway).
            if reported and not self.recovering and not self.pending_faults:
                first = min(reported, key=lambda c: c.reported_at or now)
                if first.state == RankState.READY and first.generation == self.world.generation:
                    self._fault(first.node, IN_PROCESS)
            for c in reported:
                c.reported_at = None
            self.failslow.check()

    async def _poll_slurm(self) -> None:
        """Slurm's view, throttled: a node it marks DOWN or NOT_RESPONDING (its slurmd silent
        for SlurmdTimeout) is lost, even while our own connections to it still look fine (a
        dead slurmd, a half-open link): its steps can no longer be managed, so move off it."""
        while True:
            await asyncio.sleep(self.o.node_poll_s)
            try:
                nodes = await asyncio.to_thread(self.slurm.nodes)
            except HpctError as exc:
                self.events.emit(Ev.SLURM_ERROR, error=exc.message)
                continue
            for n in nodes:
                if n.lost and (n.name in self.world.members or n.name in self.world.spares):
                    self._fault(n.name, "slurm: node down" if n.state == "DOWN"
                                else "slurm: node not responding")
            self.lifecycle.on_nodes(nodes)  # a drained member moves; a shrunk job grows back
