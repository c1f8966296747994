"""This rank's side of a recovery round: a fault, then the next assignment.

`RankRound` is a piece of `Job` (job.py). A failed step or formation (`_FAULTS`) ends in
`_recover`: the pending snapshot captured, the broken group released and torn down in the
background, a health check, and the controller told what this rank holds and that it is ready.
The next `Assign` is adopted in `_adopt`: the group formed again (a newcomer pulling its state
meanwhile), the state restored from where restore.py says, and the ring and disk persisters
bound to the new layout (`_restore_adopted`).
"""
from __future__ import annotations

import os
import time

import torch.distributed as dist

from .. import protocol as P
from ..errors import HpctError, UsageError
from ..events import Ev
from . import fault_trace
from .controller_loss import witnesses
from .generation import _Stopped
from .health import health_check
from .striped import Prefetch

# What a failed step or formation raises: the whole group restarts in place, or re-forms
_FAULTS = (RuntimeError, _Stopped, HpctError, dist.DistStoreError)
# Errors a script makes the same way on any node and at every try: a mistake in its code or in
# how it uses hpct-slurm, not a node's fault. Restarting in place or on a spare would raise it
# again and fence healthy nodes meanwhile, so the rank says so and the job fails at once.
# (OSError and MemoryError may be the node's; RuntimeError is a collective's: neither here.)
SCRIPT_ERRORS = (UsageError, TypeError, NameError, AttributeError, ImportError, KeyError,
                 IndexError, ValueError, AssertionError, ZeroDivisionError)
LOST = "controller connection lost"  # the client's Goodbye reason when the socket died
SCRIPT_ERROR_ANSWER_S = 5.0  # how long a rank whose script raised waits for the job's end


class RankRound:
    """A fault and the next assignment, on this rank (a piece of Job, job.py)."""

    # What it uses of the Job: its rooms (_policy, _group, _restorer, _integrity,
    # _controller_loss, snapshots, replicas, state), client, transfer, events, _fault,
    # host_addr, _controller_addr, _corrupt_serve and where it stands (rank, world_size,
    # generation, data_ranks, data_world, mesh_spec, _formed); _shutdown (job.py) and
    # _read_back_losses (stepping.py).

    def _recover(self, failure: str, where: str = "") -> None:
        t0 = time.time()
        self.events.emit(Ev.RANK_FAULT, rank=self.rank, generation=self.generation,
                         error=failure, where=where, stop_reason=self.client.stop_reason)
        self._policy.settle()
        self._policy.capture_pending()
        if not self.client.stop_event.is_set() and not self.client.closed.is_set():
            # Left on its own, before any STOP: its peers may be blocked reading from it.
            # After the captures: a replica push in flight rides these connections.
            self.client.leave_group()
        self._group.release()
        # Ready does not wait for the broken group's teardown (gc, gloo's destructor): the
        # state is safe once captured, so the teardown runs on its own thread while the
        # controller decides and the replacement pulls its state; the next formation waits
        # for it (Generation.await_teardown), and a teardown that hangs ends this process there.
        self._group.await_teardown()  # one still running from a fault before (a STOP mid-adoption)
        self._group.teardown_in_background()
        healthy, detail = health_check()
        latest = self.snapshots.latest()
        self.client.step = latest.step if latest else -1
        # Holdings first: the controller chooses the restore step once every survivor is ready.
        self.client.report_holdings(self._restorer.holdings(failure))
        self.client.state = "ready" if healthy else "unhealthy"
        self.client.heartbeat_now()
        self.events.emit(Ev.RANK_READY, rank=self.rank, healthy=healthy, detail=detail,
                         latest_step=self.client.step, teardown_s=time.time() - t0)
        if not healthy:
            self._shutdown(f"health check failed: {detail}")
            os._exit(3)  # a stuck gloo thread would hold up a normal interpreter exit

    def _script_failed(self, exc: BaseException) -> None:
        """The script raised one of SCRIPT_ERRORS while this process held a rank: the
        controller is told (the Goodbye's reason) before the error ends the process, so the
        job fails as the script's error instead of fencing this node and replacing it."""
        if not isinstance(exc, SCRIPT_ERRORS) or self.rank < 0 or self.client.closed.is_set():
            return
        error = _describe(exc)
        self.events.emit(Ev.RANK_SCRIPT_ERROR, rank=self.rank, generation=self.generation,
                         error=error, where=_where(exc))
        reason = P.SCRIPT_ERROR + error
        # Until the controller's own Goodbye (the job's end decided), at most a few seconds:
        # an exit it saw first would read as this node's loss, fenced and replaced.
        self.client.say_goodbye(reason, answer_within_s=SCRIPT_ERROR_ANSWER_S)

    def _adopt(self, a: P.Assign) -> None:
        t0 = time.time()
        self._policy.settle(follow_ups=True)  # its push uses the pusher replaced below
        # Own snapshots exist only once this process trained or restored for its position
        # (see SnapshotPolicy.hold_restored): then it restores from itself first.
        held_state = bool(self.snapshots.slots.steps())
        # The rank and generation first: whatever happens next, this process reports (ready,
        # holdings) as the rank it was assigned, which is what the controller waits for.
        self.rank, self.world_size, self.generation = a.rank, a.world_size, a.generation
        self.data_ranks = list(a.data_ranks) or [a.rank]
        self.data_world = a.data_world or a.world_size
        self.client.rank, self.client.generation = a.rank, a.generation
        # A STOP for the generation being adopted can overtake the adoption (a second fault
        # right after the assignment): it must survive, or this rank would wait for the dead
        # peer in init. Only older STOPs are done with.
        if self.client.stop_generation < a.generation:
            self.client.stop_event.clear()
            self.client.stop_reason = ""
        elif self.client.stop_event.is_set():
            raise _Stopped(self.client.stop_reason)
        self.client.state = "forming"
        self._fault.arm(newcomer=not held_state, generation=a.generation)
        self._fault.at("assigned", a.rank)
        self.transfer.rank = a.rank
        self.transfer.corrupt_on_serve = a.rank in self._corrupt_serve
        # A newcomer pulls its state from every source at once while the group forms; not
        # where the state is registered only after it (job.register): which ranks share this
        # one's shard is read from that model's mesh, unknown until then.
        prefetch = None if self._group.late else self._restorer.prefetch(a, held_state)
        if prefetch is not None:
            self._fault.at("pull", a.rank)
        self._group.form(a, self._fault)
        self._updating = False
        if self._group.late:
            # the inline form, state registered late: the script builds its model on its
            # own mesh of this group, and job.register(...) restores it (_restore_adopted)
            self._formed = (a, prefetch, held_state, t0, time.time())
            return
        self._restore_adopted(a, prefetch, held_state, t0, time.time())

    def _restore_adopted(self, a: P.Assign, prefetch: Prefetch | None, held_state: bool,
                         t0: float, t_formed: float) -> None:
        """The second half of an adoption, once the group formed and the state is
        registered: the restore, and what this rank holds and serves from then on."""
        source = "creation"
        self.state.forget_restored()
        if a.restore_step >= 0 or a.generation > 0:
            # Every recovery restores, a fault during step 0 included (to the state at
            # creation, step -1): survivors may have moved their own state (a sampler position)
            # before it failed. A survivor holds the restore step itself, whatever its new
            # rank (shared state is the same on every rank); a newcomer pulls it from a peer.
            source = self._restorer.restore(a, survivor=held_state, prefetch=prefetch)
        if not held_state and a.restore_step >= 0:
            self._read_back_losses(a.rank, a.restore_step)
        self._policy.hold_restored(a.restore_step)
        self._integrity.restored(a.restore_step, proof_due=source != "creation")
        dropped = self.replicas.forget_after(a.restore_step)
        if dropped:
            self.events.emit(Ev.REPLICA_ROLLED_BACK, ranks=dropped, step=a.restore_step)
        self._group.renew_ddp()
        self._policy.open_persisters(self._group.key)
        self._policy.ring(a)
        # A fault's STOP cuts every connection of the group, as does a rank that leaves a
        # step on its own: a survivor otherwise waits on a live peer that already left the
        # collective (plain DDP scripts tried by new users: survivors sat out the 10 s
        # collective timeout in 15 faults of 16). A planned STOP cuts the whole group too where a rank leaving at its step
        # boundary may leave a peer blocked mid-step: a sharded job's sub-groups, and a job
        # that carries its ranks' state in an all-reduce of its own beside the gradients'.
        self.client.group_addrs = {str(h) for h, _ in a.peers.values()} - {self.host_addr}
        self.client.cut_group_on_any_stop = (self.mesh_spec is not None
                                             or self._policy.carry is not None)
        # ... and on this node too where it runs more of the group's ranks (a TP pair, which
        # a lost remote peer leaves waiting on each other: measured, 10 s on a 3-D job)
        self.client.sever_own_node = a.tasks_per_node > 1
        self._controller_loss.peers = witnesses(a, {self.host_addr, self._controller_addr.host})
        self.events.emit(Ev.RANK_ADOPTED, rank=a.rank, generation=a.generation,
                         restore_step=a.restore_step, source=source,
                         reform_s=t_formed - t0, restore_s=time.time() - t_formed)
        self._fault.at("first_step", a.rank)


def _describe(exc: BaseException) -> str:
    """A fault's one-line description: its type and the first line of its message."""
    return f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"


def _where(exc: BaseException, frames: int = 4) -> str:
    """Where a fault was raised, the script's own line included; its traceback goes to the
    rank's log (fault_trace.py)."""
    return fault_trace.record(exc, frames)
