"""Warm spares: what the controller does to keep a node ready to take a lost one's place.

At the start it says loudly when the allocation gave fewer spares than asked for (and refuses
to start, if told to); a node whose step was cancelled while the node stayed healthy becomes a
spare again (`_replenish`); once the allocation's own spares are used up, it borrows one from
the cluster's spare pool (a companion job in the pool reservation, `_maybe_borrow`), admits
the pool node when its ranks register (`_join_node`) and cancels the companions at the end.
"""
from __future__ import annotations

import asyncio
import contextlib
from pathlib import Path

from .. import config as C
from .. import protocol as P
from ..errors import HpctError, describe
from ..events import Ev, EventLog, Role
from ..rundir import write_private
from ..slurm.client import SlurmClient, SlurmCommandError
from .connections import Conn
from .options import Options
from .policy import World


class Spares:
    """The controller's warm spares (a piece of Controller, controller.py)."""

    # The controller's state this piece reads and writes (Controller.__init__ sets it up).
    o: Options
    slurm: SlurmClient
    run_dir: Path
    events: EventLog
    world: World
    conns: dict[tuple[str, int], Conn]
    dead_nodes: set[str]
    borrowed: list[int]  # companion jobs submitted into the spare pool
    pool_nodes: set[str]  # nodes lent by the pool (their companion job is what to cancel)
    finished: asyncio.Event
    # What it uses of the other pieces: _launch and _step_env (steps.py).

    def _spares_short(self) -> bool:
        """Say it loudly when the allocation gave fewer warm spares than asked for; True when
        the job must not start (--on-few-spares refuse, first start)."""
        want, got = self.o.want_spares, len(self.world.spares)
        if want is None or got >= want:
            return False
        refuse = self.o.on_few_spares == "refuse" and self.o.restart_count == 0
        self.events.emit(Ev.CONTROLLER_SPARES_SHORT, wanted=want, got=got,
                         action="refuse" if refuse else "warn",
                         nodes=len(self.o.nodes), restart_count=self.o.restart_count)
        if refuse:
            self.events.emit(Ev.JOB_FAILED, cause="config",
                             reason=f"asked for {want} warm spare(s), the allocation gave {got}")
        return refuse

    def _replenish(self, node: str) -> None:
        if self.finished.is_set() or node in self.world.spares or node in self.dead_nodes:
            return  # (a node fenced for good, or moved off, is never a spare again)
        for key in [k for k, c in self.conns.items() if k[0] == node and c.gone]:
            del self.conns[key]
        self.world.spares.append(node)
        self._launch(node, Role.SPARE)

    def _join_node(self, node: str, role: str) -> None:
        """Refuse a node that is not the job's, unless it is a spare lent by the pool."""
        if node not in self.world.members and node not in self.world.spares:
            if role != Role.SPARE or not self.borrowed or node in self.dead_nodes:
                raise P.ProtocolError(f"node {node} is not part of this job")
            self.pool_nodes.add(node)
            self.world.spares.append(node)
            self.events.emit(Ev.POOL_SPARE_JOINED, node=node)

    def _maybe_borrow(self) -> None:
        """Keep one warm spare from the cluster pool once the allocation's own are used up:
        a companion job in the pool reservation whose processes register as spares here."""
        if self.finished.is_set() or self.world.spares or \
                len(self.borrowed) >= self.o.pool_spares:
            return
        # Written afresh each time: a file already there is never trusted, nor followed.
        script = write_private(self.run_dir / "companion.sbatch",
                               b'#!/bin/bash\n# a warm spare lent by the hpct spare pool\n'
                               b'exec srun -N1 -n"$HPCT_TASKS_PER_NODE" --kill-on-bad-exit=0 '
                               b'-u "$@"\n')
        env = self._step_env("spare")
        env.update({C.JOB_ID: str(self.o.job_id),
                    C.TASKS_PER_NODE: str(self.o.tasks_per_node)})
        options = [f"--reservation={self.o.pool_reservation}", "-N1", "--exclusive",
                   f"--ntasks-per-node={self.o.tasks_per_node}",
                   f"--job-name=hpct-spare-{self.o.job_id}",
                   f"--output={self.run_dir / 'logs' / 'companion-%j.out'}"]
        try:
            job = self.slurm.sbatch(script, options=options, script_args=self.o.command,
                                    env=env)
        except HpctError as exc:
            self.events.emit(Ev.POOL_BORROW_FAILED, error=describe(exc))
            return
        self.borrowed.append(job)
        self.events.emit(Ev.POOL_BORROW, companion_job=job,
                         reservation=self.o.pool_reservation)

    async def _release_borrowed(self) -> None:
        """Cancel the companion jobs (at the end, or before a requeue): the pool's nodes go
        back to the pool. Once each."""
        jobs, self.borrowed[:] = list(self.borrowed), []
        for job in jobs:
            with contextlib.suppress(SlurmCommandError):
                await asyncio.to_thread(self.slurm.cancel, job)
