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
        spare again (never before: a new step beside the stopped one would be refused)."""
        loop = asyncio.get_running_loop()
        try:
            await loop.run_in_executor(None, self._cancel_steps_on, node)
        finally:
            self.fencing.pop(node, None)
        loop.call_later(1.0, self._replenish, node)

    def _usable_in_slurm(self, node: str) -> bool:
        try:
            info = self.slurm.show_node(node)
        except HpctError:
            return False
        return info.state != "DOWN" and not ({"DRAIN", "NOT_RESPONDING"} & set(info.flags))

    def _slurmd_reachable(self, node: str) -> bool:
        return slurmd_reachable(self.slurm, node, self.o.slurmd_port)
