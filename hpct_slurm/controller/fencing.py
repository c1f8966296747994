"""Fencing: making sure nothing of a lost node can rejoin the job.

A dead or unreachable node (its slurmd does not answer, or srun said "Node failure on") goes
DOWN in Slurm, and the admin's policy for it runs afterwards (lifecycle.after_down); a live
node that Slurm took out (DOWN, drained, not responding) is never used again; a live node
whose process failed or hung has its step cancelled and becomes a warm spare again.
"""
from __future__ import annotations

import asyncio
import socket

from ..errors import HpctError
from ..events import Ev, EventLog
from ..slurm.client import SlurmClient, SlurmCommandError
from .lifecycle import Lifecycle
from .options import Options


def slurmd_reachable(slurm: SlurmClient, node: str, port: int = 6818) -> bool:
    """Whether the node's slurmd accepts a TCP connection within a second: tells a crashed or
    partitioned node from a live node whose training process failed, long before Slurm's own
    SlurmdTimeout marks it not responding."""
    try:
        addr = slurm.show_node(node).addr or node
        with socket.create_connection((addr, port), timeout=1.0):
            return True
    except (OSError, HpctError):
        return False


# A cancelled step's end is asked about this often at first, then less (doubling to the max).
STEP_POLL_S = 0.2
STEP_POLL_MAX_S = 2.0


class Fencing:
    """The controller's fencing of lost nodes (a piece of Controller, controller.py)."""

    # The controller's state this piece reads and writes (Controller.__init__ sets it up).
    o: Options
    slurm: SlurmClient
    events: EventLog
    steps: dict[str, asyncio.subprocess.Process]
    dead_nodes: set[str]
    expected_exits: set[int]
    lifecycle: Lifecycle  # the admin's policy for a node fenced DOWN
    fencing: dict[str, "asyncio.Future[None]"]  # live nodes whose step cancel is under way
    pool_nodes: set[str]  # nodes lent by the pool
    finished: asyncio.Event
    # What it uses of the other pieces: _live (connections.py), _cancel_steps_on (steps.py),
    # _replenish (spares.py).

    async def _fence(self, node: str, reason: str) -> None:
        """Make sure nothing of the lost node can rejoin: a dead or unreachable node goes DOWN
        in Slurm; a live node with a failed or hung process has its step cancelled."""
        for c in self._live(node):
            c.gone = True
            c.writer.close()
        alive = await asyncio.to_thread(self._slurmd_reachable, node)
        usable = alive and await asyncio.to_thread(self._usable_in_slurm, node)
        loop = asyncio.get_running_loop()
        if alive and not usable:
            # an admin (or Slurm) took the node out: its steps are gone, never reuse it
            self.dead_nodes.add(node)
            self.events.emit(Ev.FAULT_FENCED, node=node, how="node unavailable in slurm",
                             reason=reason)
            return
        if alive and not reason.startswith("srun: node failure"):
            if node in self.steps:
                self.expected_exits.add(self.steps[node].pid)
            # The round goes on while the cancel completes: the node's connections are cut
            # above and anything it still sends carries a dead generation, so it can change
            # nothing; but scancel of a step whose slurmstepd is stopped (SIGSTOP) waits out
            # slurmd's MessageTimeout (10 s), which the whole round used to wait for.
            self.fencing[node] = asyncio.ensure_future(self._cancel_then_spare(node))
            self.events.emit(Ev.FAULT_FENCED, node=node, how="step cancelled", reason=reason)
            return
        self.dead_nodes.add(node)
        try:
            await loop.run_in_executor(None, lambda: self.slurm.update_node(
                node, "DOWN", f"hpct: {reason} (job {self.o.job_id})"))
        except SlurmCommandError as exc:
            self.events.emit(Ev.SLURM_ERROR, node=node, error=exc.message)
        self.events.emit(Ev.FAULT_FENCED, node=node, how="node down", reason=reason)
        # the admin's policy (leave or reboot), off the recovery's path
        asyncio.ensure_future(self.lifecycle.after_down(node, reason))

    async def _cancel_then_spare(self, node: str) -> None:
        """Cancel a fenced live node's step; once it is gone, the healthy node becomes a warm
        spare again (never before: a new step beside the stopped one would be refused). The
        node stays in `fencing` until then: a round short of spares waits for it (arrivals.py).
        scancel returns before a step whose slurmstepd is stopped has gone (it waits out
        MessageTimeout, then gives up), so the node's steps are asked about until none is left."""
        loop = asyncio.get_running_loop()
        try:
            await loop.run_in_executor(None, self._cancel_steps_on, node)
            if node in self.pool_nodes:
                return  # its companion job is cancelled: the pool lends another (spares.py)
            pause, said = STEP_POLL_S, False
            while not self.finished.is_set():
                left = await loop.run_in_executor(None, self._steps_left_on, node)
                if not left:
                    self._replenish(node)
                    return
                if not said:
                    said = True
                    self.events.emit(Ev.FAULT_STEP_LINGERS, node=node, steps=left)
                await asyncio.sleep(pause)
                pause = min(pause * 2, STEP_POLL_MAX_S)
        finally:
            self.fencing.pop(node, None)

    def _steps_left_on(self, node: str) -> list[str]:
        """What of this job still runs on `node` (off the loop): its numbered Slurm steps, and
        the srun of its step that this controller started (it ends with the step)."""
        left = [f"srun pid {p.pid}" for p in [self.steps.get(node)]
                if p is not None and p.returncode is None]
        try:
            steps = self.slurm.job_steps(self.o.job_id)
        except HpctError:
            return left or ["unknown: squeue failed"]
        return left + [s.step for s in steps if s.nodelist == [node] and s.numbered]

    def _usable_in_slurm(self, node: str) -> bool:
        try:
            info = self.slurm.show_node(node)
        except HpctError:
            return False
        return info.state != "DOWN" and not ({"DRAIN", "NOT_RESPONDING"} & set(info.flags))

    def _slurmd_reachable(self, node: str) -> bool:
        return slurmd_reachable(self.slurm, node, self.o.slurmd_port)
