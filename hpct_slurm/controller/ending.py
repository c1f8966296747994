"""How the job's run ends, and the exit code that tells Slurm what happened.

Three ways: every rank of the current generation said done (`_maybe_finish`); SIGTERM (a time
limit, scancel: `_terminate`); or an escalation (`_escalate`): the infrastructure failed beyond
what the spares absorb (requeue, or fail with --on-no-spare fail), or the training script
itself fails (never requeued: it would only fail again). Every way says goodbye to every rank.
"""
from __future__ import annotations

import asyncio
import contextlib
import time

from .. import protocol as P
from ..errors import HpctError
from ..events import Ev, EventLog, RankState
from ..slurm.client import REQUEUE_BEGIN_S, SlurmClient, SlurmCommandError, sigterm_ignored
from .connections import Conn
from .lifecycle import Lifecycle
from .options import Options
from .policy import RecoveryRecord, World

# How long an escalation before the first step waits for more nodes failing the same way.
START_FAILURE_GRACE_S = 3.0
# The controller's exit codes, which are the job's (the batch script execs it), so that
# Slurm's requeue logic (slurm.conf RequeueExit) hears the truth:
EXIT_OK = 0
EXIT_FAILED = 1        # the script's own error, or a refusal: the same run would fail again
EXIT_RETRY = 75        # EX_TEMPFAIL: the infrastructure failed beyond what the spares absorb
                       # and the job was requeued; a run on other nodes can succeed
EXIT_TERMINATED = 143  # SIGTERM (a time limit, scancel): the persister finished first


class ScriptError(HpctError):
    """The training script itself fails (the same way wherever it runs): not requeued."""


class Ending:
    """The end of the controller's run (a piece of Controller, controller.py)."""

    # The controller's state this piece reads and writes (Controller.__init__ sets it up).
    o: Options
    slurm: SlurmClient
    events: EventLog
    world: World
    conns: dict[tuple[str, int], Conn]
    lifecycle: Lifecycle  # the job's Slurm comment says how it ended
    trained: bool  # some rank completed a step: failures since are not start-up's
    recovering: bool
    recovery: RecoveryRecord | None  # a round whose first step the run may end before
    finished: asyncio.Event  # set last: Controller.run returns exit_code
    exit_code: int
    done_sent: bool
    said_done: set[int]  # this generation's connections that said done (ids)
    # What it uses of the other pieces: _live and _send (connections.py), _release_borrowed
    # (spares.py).

    async def _escalate(self, why: str, script: bool = False) -> None:
        """End the job's run here. An infrastructure failure (nodes lost beyond the spares,
        no consistent state in memory) requeues, per --on-no-spare; the script's own error
        never does: it would only fail again."""
        if not script and not self.trained:
            # Before any step, one node's failure may be the first sight of the script's own
            # error on every node (their steps exit within moments of each other): give the
            # others' exits time to arrive, so that _start_failure can call it the script's.
            await asyncio.sleep(START_FAILURE_GRACE_S)
        if self.finished.is_set():
            return
        requeue = not script and self.o.on_no_spare == "requeue"
        if self.recovery is not None:
            # a round the run ends before its first step: its faults are in the record too
            self.lifecycle.count(self.recovery, self.recovery.done_fields(time.time()))
            self.recovery = None
        # A requeue makes Slurm signal every process of the job, this one and the scontrol
        # commands it starts included: what follows it runs with SIGTERM ignored (bounded:
        # Slurm's KillWait ends it anyway), and the run ends on its own right after.
        with sigterm_ignored() if requeue else contextlib.nullcontext():
            # The job's Slurm record says it too: requeued (the infrastructure) or not (a
            # bug). Written beside the requeue, never in its way.
            self.lifecycle.record(
                f"failed, not requeued: the script's own error: {why[:80]}" if script else
                f"requeued: infrastructure: {why[:80]}" if requeue else
                f"failed: infrastructure: {why[:80]}")
            if script:
                self.events.emit(Ev.JOB_FAILED, cause="script", reason=why)
            elif requeue:
                self.events.emit(Ev.ESCALATE_REQUEUE, cause="infrastructure", reason=why)
                # the pool's nodes this job holds go back first: the requeued job must never
                # wait on a node its own companion job still holds (Slurm may kill this
                # process at KillWait after the requeue, before the run's own release)
                await self._release_borrowed()
                await self._requeue()
            else:
                self.events.emit(Ev.ESCALATE_FAIL, cause="infrastructure", reason=why)
            # only a requeued infrastructure failure says "retry": a script's error would fail
            # again, and --on-no-spare fail is the user's choice not to retry
            self.exit_code = EXIT_RETRY if requeue else EXIT_FAILED
            await self._goodbye_all(f"job escalated: {why}")
            await self.lifecycle.settle()  # bounded: COMMENT_WAIT_S
        self.finished.set()

    async def _requeue(self) -> None:
        """`scontrol requeue`, and the requeued job eligible REQUEUE_BEGIN_S later instead of
        after Slurm's hold of about two minutes (SlurmClient.requeue)."""
        def refused(exc: SlurmCommandError) -> None:  # a try Slurm refused for now
            self.events.emit(Ev.SLURM_ERROR, error=exc.message, again=True)

        def requeued() -> None:  # the outcome, before anything KillWait may cut short
            self.events.emit(Ev.ESCALATE_REQUEUED, job_id=self.o.job_id,
                             restart_count=self.o.restart_count + 1)

        try:
            # slurmctld may hold the StartTime update 5 s for the job's DB index, and Slurm
            # kills this process KillWait after the requeue: the requeue's record is written
            # as soon as it is done, not after the update (issue 45)
            late = await asyncio.to_thread(self.slurm.requeue, self.o.job_id, REQUEUE_BEGIN_S,
                                           refused, requeued)
        except SlurmCommandError as exc:
            self.events.emit(Ev.SLURM_ERROR, error=exc.message)
            return
        if late is not None:
            self.events.emit(Ev.SLURM_ERROR, error=late, begin="Slurm's hold")
        else:
            self.events.emit(Ev.ESCALATE_ELIGIBLE, begin_in_s=REQUEUE_BEGIN_S)

    async def _terminate(self, why: str) -> None:
        if self.finished.is_set():
            return
        self.events.emit(Ev.CONTROLLER_TERMINATED, signal=why)
        self.exit_code = EXIT_TERMINATED
        await self._goodbye_all(f"terminated: {why}")
        self.finished.set()

    def _maybe_finish(self, conn: Conn) -> None:
        if conn.generation == self.world.generation:
            self.said_done.add(id(conn))
        if self.recovering or len(self.said_done) < self.world.world_size:
            return
        actives = [c for n in self.world.members for c in self._live(n)]
        if len(actives) != self.world.world_size:
            return
        if all(c.state == RankState.DONE for c in actives) and not self.done_sent:
            self.done_sent = True
            self.events.emit(Ev.JOB_DONE, generation=self.world.generation,
                             lost=self.world.lost)
            asyncio.create_task(self._finish())

    async def _finish(self) -> None:
        await self._goodbye_all("done")
        self.finished.set()

    async def _goodbye_all(self, reason: str) -> None:
        for c in list(self.conns.values()):
            await self._send(c, P.Goodbye(reason))
