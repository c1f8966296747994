"""How a rank holds its snapshots: the recovery mode (jit or replicated), which steps are
committed in full and which are held lazily, whether a commit's copy overlaps the next step,
what goes to the ring neighbour and to disk after a commit, and what is captured at a fault.

`Job` (job.py) asks it at the end of every step (`end_step`) and of the job (`check_last`),
before every optimizer update (the hook `watch_optimizer` registers), at a fault (`settle`,
`capture_pending`) and at every adoption (`hold_restored`, `open_persisters`, `ring`)."""
from __future__ import annotations

import weakref
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

from torch.optim.optimizer import register_optimizer_step_pre_hook

from .. import protocol as P
from ..config import JobSettings
from ..errors import HpctError
from ..events import Ev, EventLog
from .carry import Carry, CarryRecord
from .layout_rules import MeshSpec, first_mode, sharded_mode
from .persist import DiskPersister
from .replicas import ReplicaStore
from .ring import replica_peer_rank
from .slots import Snapshot
from .snapshot import DEFAULT_SNAPSHOT_EVERY, SnapshotStore
from .state import TrainState, local_ptr, optimizer_state_tensors
from .transfer import ReplicaPusher

if TYPE_CHECKING:
    from .standing import Standing

# Between lazily held steps, a full commit (a copy of the whole state) every LAZY_FULL_EVERY
# steps: what the group rolls back to where a held step cannot be used, i.e. a fault found
# inside a step's optimizer update (a collective after `optimizer.step()`: a loss all-reduce
# for logging) or a script that changes its weights outside the watched update (SAM, an EMA
# at a step's start: the held step is refused). Every job pays the copy, 1/K of it a step;
# only those faults pay the recompute, up to K-1 steps. At 16 the copy was a third of the
# documented adoption's cost on CPU (100 MB, 47 ms steps: 7.7 ms / 16 = 0.48 ms a step, 1 %;
# `hpct-slurm bench replication`) and on one H200 the lazy mode's +3.8 % (2.6 GB a commit),
# against goals of 3 % and 1 %. At 64: 0.25 % on CPU, and such a fault recomputes up to 63
# steps (3 s of 47 ms steps), still seconds against a restart's minutes.
# HPCT_SNAPSHOT_EVERY sets it per job.
LAZY_FULL_EVERY = 64
# `Job` seeds every generator a snapshot could hold (python's, numpy's, torch's; seeds.py)
# from (seed, rank, step) before each step's own code runs, in all three forms of `Job.run`:
# the RNG states at a step's end are overwritten before anything reads them, so its snapshots
# leave them out (7.5 KB of a sampler's rank snapshot, and most of its cost: bench replication).
RESEEDED = True


def _discard(store: SnapshotStore, steps: list[int]) -> None:
    """Give up the snapshots of `steps` this store holds (their slots are free again)."""
    for step in steps:
        with store.lease(step) as snap:
            if snap is not None:
                store.slots.discard(snap)


def _changed_by(optimizer: Any) -> set[int]:
    """The addresses of the tensors an optimizer's update changes: its parameters and its
    state's tensors."""
    return {local_ptr(t) for t in (*_params(optimizer), *optimizer_state_tensors(optimizer))}


def _params(optimizer: Any) -> list[Any]:
    return [p for g in optimizer.param_groups for p in g["params"]]


class SnapshotPolicy:
    """This rank's snapshots (`snapshots`: the shared state; `rank_snaps`: its own small
    state, None when it has none), the replicas it holds for others (`replicas`), and the
    rules of when and how they are taken and copied. `mode` is the recovery mode, `updating`
    whether the step in progress reached its optimizer update.

    `on_gpu` says whether the state lives on a GPU (the default for overlapping copies);
    `persister` builds the disk persisters (the real class unless a test passes a fake)."""

    def __init__(self, state: TrainState, settings: JobSettings, mode: str,
                 mode_given: str | None, *, persist_every: int, events: EventLog, secret: bytes,
                 job_id: str, run_dir: Path, standing: Standing, on_gpu: Callable[[], bool],
                 persister: Callable[..., DiskPersister] = DiskPersister):
        s = settings
        self.state, self.events, self.secret, self.job_id = state, events, secret, job_id
        self.run_dir, self.standing, self._on_gpu = run_dir, standing, on_gpu
        self._make_persister = persister
        self.timeout = s.collective_timeout_s
        self.mode = mode
        self._mode_given = mode_given
        self._every_given = s.snapshot_every
        every = self._every_given or DEFAULT_SNAPSHOT_EVERY
        # No RNG states in either store: `Job` reseeds python's, numpy's and torch's generators
        # from (seed, rank, step) before every step, so a restored rank gets them from its
        # step's seed, never from a copy (RESEEDED).
        self.snapshots = SnapshotStore(state, scopes=("shared",), every=every, rng=not RESEEDED)
        # This rank's own small state (a sampler position, extras): its own snapshot, pushed
        # to the ring neighbour after every commit and persisted with the shared state.
        self.rank_snaps = (SnapshotStore(state, scopes=("rank",), every=every,
                                         rng=not RESEEDED)
                           if state.has_rank_state() else None)
        self.snapshots.on_not_the_step = self._not_the_step
        # the optimizers this rank watches (Job's, each sharded build's) and, for every
        # other optimizer that steps in this process, whether it updates registered state
        # (weak: an id() could be a later optimizer's once the first is collected)
        self._watched: weakref.WeakSet[Any] = weakref.WeakSet()
        self._updates_state: weakref.WeakKeyDictionary[Any, bool] = weakref.WeakKeyDictionary()
        self._global_hook: Any = None
        self._pushed: SnapshotStore | None = None
        # Copy the parameters and optimizer state of step s while step s+1 computes (off the
        # critical path), or before step s returns. Default: overlap where the state lives on
        # a GPU (host cores idle during the step); not for CPU training, whose step already
        # uses every core: there the copy thread measured slower than the copy itself
        # (`hpct-slurm bench replication`, jit_k1 vs jit_k1_sync).
        self._overlap_given = (None if s.snapshot_overlap == "auto"
                               else s.snapshot_overlap == "1")
        # Between full commits, hold each step's shared state where it lies and copy it only
        # at a fault (see _lazy); 0 makes every step a full commit.
        self.lazy = s.snapshot_lazy
        self.persist_every = persist_every  # read by _full_commit and the persisters
        self.set_mode(self.mode)
        # Other ranks' copies; each one's own state at the last full commit stays pinned
        self.replicas = ReplicaStore(pin=self._pins)
        self.pusher: ReplicaPusher | None = None
        # This rank's own state carried in the gradient all-reduce to its ring holder, where
        # the group allows it (carry.py); the record of whether its state stays put after the
        # all-reduce outlives each generation's Carry.
        self.carry: Carry | None = None
        self._carry_record = CarryRecord()
        self.persister: DiskPersister | None = None
        self.rank_persister: DiskPersister | None = None
        self._peers: dict[int, tuple[str, int]] = {}
        # Whether the step in progress reached its optimizer update (Generation._abandon)
        self.updating = False
        # Updates of registered state in the step in progress, and in the last whole step: an
        # update that is not a step's last copies what it changes ahead (before_update)
        self._updates = 0
        self._updates_per_step = 1
        # Called at every full commit of a lazily holding job, before the step is committed
        # or pinned, and at its last step (check_last): the replicas' cross-check
        # (Integrity.cross_check, crosscheck.py); it raises when they disagree
        self.cross_check: Callable[[int], None] | None = None

    # ---- the mode -------------------------------------------------------------------------
    def sharded_mode(self, spec: MeshSpec) -> str:
        return sharded_mode(self.state, self._mode_given, spec)

    def data_parallel_mode(self) -> str:
        """The mode of plain data parallelism for the state registered now (the inline
        form registers it only after the group formed: job.register)."""
        return first_mode(self.state, self._mode_given, None)

    def set_mode(self, mode: str) -> None:
        self.mode = mode
        self.snapshots.scopes = ("shared",) if mode == "jit" else ("shared", "rank")
        # What goes to the ring neighbour after each commit, synchronously: the neighbour then
        # always holds the step this rank last committed (and the one before).
        self._pushed = self.snapshots if mode == "replicated" else self.rank_snaps
        # Full commits every step, unless the steps between can be held lazily: then every
        # LAZY_FULL_EVERY steps (what a fault inside an optimizer step rolls back to at most)
        if self._every_given is None:
            self.snapshots.every = LAZY_FULL_EVERY if self._lazy() else DEFAULT_SNAPSHOT_EVERY

    def _lazy(self) -> bool:
        """Whether the shared state of a step between full commits is held without a copy
        (SnapshotStore.prepare_lazy). Only where every survivor's live state at a fault is
        a state the group can restore: jit mode (a replicated ring push needs the bytes).

        With per-rank state (a sampler position) as well: its own small snapshot is still
        taken every step and sent to the ring holder, so a fault before the next optimizer
        update restores the held step exactly as without it. A fault inside a step's update
        (from the update's start to the step's end: a loss all-reduce for logging after
        `optimizer.step()`) finds the survivors' held step dropped: the group rolls back to
        the last full commit, and every rank's position at it is pinned in memory, by the
        rank and by its ring holder (`_pins`), beside the two newest. No disk needed."""
        return self.lazy and self.mode == "jit"

    def _full_commit(self, step: int) -> bool:
        """Whether `step` ends in a full commit: the same rule on every rank, so the commit
        steps line up."""
        return self.snapshots.due(step) or (
            bool(self.persist_every) and step % self.persist_every == 0)

    def _pins(self, step: int) -> bool:
        """Whether a rank's own state at `step` is pinned (by the rank and by its holder):
        at every full commit while the steps between are held lazily."""
        return self.rank_snaps is not None and self._lazy() and self._full_commit(step)

    def _overlap(self) -> bool:
        if self._overlap_given is not None:
            return self._overlap_given
        return self._on_gpu()

    # ---- every step -----------------------------------------------------------------------
    def end_step(self, step: int) -> None:
        """After a step: its snapshot, when one is due (full, its copy overlapping the next
        step or not), else held lazily where that is allowed."""
        self._updates_per_step, self._updates = max(self._updates, 1), 0
        if self._full_commit(step):
            self._commit_rank_state(step)
            if self.cross_check is not None and self._lazy():
                # before this step is committed, and before its rank state is pinned in place
                # of the last agreeing one's, which a disagreement rolls back to
                self.cross_check(step)
            if self._pins(step):
                self.rank_snaps.slots.pin(step)  # type: ignore[union-attr]
            if self._overlap():
                self.snapshots.commit_async(step, then=self._after_shared_commit)
            else:
                self._after_shared_commit(self.snapshots.commit(step))
        elif self._lazy():
            # this rank's own small state, every step: a fault before the next update restores
            # the held step, and the ring holder must have this rank's position at it
            self._commit_rank_state(step)
            self.snapshots.prepare_lazy(step)

    def check_last(self, step: int) -> None:
        """The job's last step, before this rank reports done: where it was no full commit the
        replicas compare once more (raising as at a commit), so a flip after the last full
        commit cannot end the job."""
        if self.cross_check is not None and self._lazy() and not self._full_commit(step):
            self.cross_check(step)

    def _commit_rank_state(self, step: int) -> None:
        """This rank's own small state, now: the next step moves it (a sampler position).
        In jit mode it is all that goes to the ring holder. Mostly it is there already,
        carried in this step's gradient all-reduce (carry.py): then nothing is sent. Else it
        is pushed now, its acknowledgement awaited at the next step's end, not this one's
        (ReplicaPusher.push_next). When such a step ends the holder has the step before it,
        and this one is on its way; a fault that loses this rank in the moment between (a
        round trip, well under a millisecond on one switch) finds the holder one step
        behind, and the group restores the step before, or the last persisted one where
        that step was held lazily (recomputed and counted, never wrong: the controller plans
        from what holders report holding). A carried copy the state moved away from after
        the all-reduce is replaced before the step returns."""
        held = "push"
        if self.rank_snaps is not None:
            if self.carry is not None:
                _, held = self.carry.commit(step, self.rank_snaps)
            else:
                self.rank_snaps.commit(step)
            if self.rank_persister:
                self.rank_persister.after_commit(step)
        if self.pusher is None or self._pushed is not self.rank_snaps:
            return
        if held == "carried":
            return
        if held == "replace":
            self.pusher.after_commit(step)
            self.pusher.flush()
            return
        # waits for the previous push, bounded by the pusher's timeout; a failure is an
        # event
        self.pusher.push_next(step)

    def _after_shared_commit(self, snap: Snapshot) -> None:
        """After the shared state of a step is copied (on the snapshot thread when the copy
        overlaps the next step): its save to disk, and in replicated mode its ring push."""
        try:
            if self.persister:
                self.persister.after_commit(snap.step)
            if self.pusher is not None and self._pushed is self.snapshots:
                self.pusher.after_commit(snap.step)
                self.pusher.flush()
        except Exception as exc:  # noqa: BLE001 - a lost copy is an event, not a fault
            self.events.emit(Ev.SNAPSHOT_FOLLOW_UP_FAILED, rank=self.standing.rank,
                             step=snap.step, error=f"{type(exc).__name__}: {exc}")

    def watch_optimizer(self, optimizer: Any) -> None:
        """Before each optimizer step: drop a lazily held step (the live state stops being
        it) and wait for the background copy of the last commit (it reads what that step is
        about to change). Every other optimizer that steps in this process is watched too,
        through torch's global step pre-hook, when it updates registered state (a GAN's
        discriminator passed to Job as extra state): its update must not race the copy."""
        optimizer.register_step_pre_hook(lambda opt, *_: self.before_update(opt))
        self._watched.add(optimizer)
        if self._global_hook is None:
            policy = weakref.ref(self)

            def any_optimizer(opt: Any, *_: Any) -> None:
                me = policy()
                if me is not None:
                    me._before_any_update(opt)

            self._global_hook = register_optimizer_step_pre_hook(
                any_optimizer)

    def _before_any_update(self, optimizer: Any) -> None:
        if optimizer in self._watched:
            return  # its own hook runs
        if optimizer not in self._updates_state:
            stable = self.state.stable_ptrs()
            self._updates_state[optimizer] = any(local_ptr(p) in stable
                                                 for p in _params(optimizer))
        if self._updates_state[optimizer]:
            self.before_update(optimizer)

    def _not_the_step(self, step: int, detail: str) -> None:
        """A held or overlapped snapshot refused (SnapshotStore.on_not_the_step): this rank
        holds the one before, and a fault now rolls back to it (recomputed, and counted)."""
        self.events.emit(Ev.SNAPSHOT_NOT_THE_STEP, rank=self.standing.rank, step=step,
                         error=detail, holds=self.snapshots.slots.steps())

    def before_update(self, optimizer: Any = None) -> None:
        """Before an update of registered state. Where the last whole step made more than one
        (a GAN's discriminator and generator), every one but the last keeps the held step:
        the tensors it changes are copied first (SnapshotStore.before_optimizer_step). A
        fault between two such updates (the generator's gradients reduced after the
        discriminator's update) then restores this step and recomputes one, where dropping
        the hold rolled the group back to the last full commit (up to LAZY_FULL_EVERY - 1
        steps)."""
        self.updating = True
        self._updates += 1
        ahead = None
        if optimizer is not None and self._updates < self._updates_per_step:
            ahead = _changed_by(optimizer)
        self.snapshots.before_optimizer_step(ahead)

    # ---- at a fault -----------------------------------------------------------------------
    def settle(self, follow_ups: bool = False) -> None:
        """Wait for the background copy of the last commit (and, with `follow_ups`, its save
        and push): what this process reports holding must be complete."""
        try:
            self.snapshots.wait() if follow_ups else self.snapshots.wait_copied()
        except Exception as exc:  # noqa: BLE001 - that snapshot is simply not held
            self.events.emit(Ev.SNAPSHOT_COPY_FAILED, rank=self.standing.rank,
                             error=f"{type(exc).__name__}: {exc}")

    def capture_pending(self) -> None:
        """A fault between two optimizer steps: the live parameters and optimizer state are
        exactly the last step's, so they become its snapshot now (SnapshotStore.prepare_lazy)."""
        try:
            snap = self.snapshots.finish_pending()
        except Exception as exc:  # noqa: BLE001 - that step is simply not held
            self.events.emit(Ev.SNAPSHOT_COPY_FAILED, rank=self.standing.rank, error=f"{exc}")
            return
        if snap is not None:
            self.events.emit(Ev.SNAPSHOT_CAPTURED_AT_FAULT, rank=self.standing.rank,
                             step=snap.step, nbytes=snap.layout.nbytes)

    # ---- at an adoption -------------------------------------------------------------------
    def hold_restored(self, step: int) -> None:
        """Make this process's own snapshots hold the step it now stands at (the state at
        creation, step -1, on a first start): a newcomer that pulled its state from peers or
        disk is then a source itself if the next fault comes before its first commit, and a
        fault during step 0 has a state at creation to roll back to."""
        self._updates = 0  # the faulted step's updates are not the next step's
        for store in (self.snapshots, self.rank_snaps):
            if store is None:
                continue
            # After a rollback (a restore from disk) newer snapshots belong to a history that
            # no longer happens: offering them in the next fault would mix two histories.
            _discard(store, [s for s in store.slots.steps() if s > step])
            if step not in store.slots.steps():
                store.commit(step)
        if self.rank_snaps is not None and self._lazy():
            # The group stands here as at a full commit: until the next one, a fault inside
            # an update rolls back to this step, every rank's position at it in memory.
            self.rank_snaps.slots.pin(step)
            self.replicas.pin(step)

    def distrust_after(self, step: int) -> None:
        """Nothing newer than `step` may be restored or served (the replicas disagreed after
        it): this rank's snapshots and the replicas it keeps of newer steps go."""
        self.snapshots.drop_pending()
        for store in (self.snapshots, self.rank_snaps):
            if store is not None:
                _discard(store, [s for s in store.slots.steps() if s > step])
        self.replicas.forget_after(step)

    def hold_again(self, step: int) -> None:
        """The script registered more state after `hold_restored(step)` and before the next
        step (the inline form's job.state.register after Job(...)): the held step is taken
        again, so that a fault in the next step restores those objects too. Only once the
        restore is proven (Job): the live state is then the restored one. The shared
        state only: per-rank state registered that late is refused (Job)."""
        if step not in self.snapshots.slots.steps():
            return
        _discard(self.snapshots, [step])
        self.snapshots.commit(step)

    def open_persisters(self, key: Callable[[int], int]) -> None:
        """The disk persisters of the rank this process now holds (`key`: a rank's shard key)."""
        rank, world_size = self.standing.rank, self.standing.world_size
        # One copy on disk per shard key is enough (one for plain data parallelism): the
        # lowest rank of each key writes it.
        own = key(rank)
        first = min(r for r in range(world_size) if key(r) == own)
        if self.persist_every and self.persister is None and rank == first:
            self.persister = self._make_persister(self.snapshots, self.run_dir / "persist",
                                                  own, self.persist_every, self.events,
                                                  key=self.secret)
        if self.persist_every and self.rank_snaps is not None and \
                (self.rank_persister is None or self.rank_persister.rank != rank):
            if self.rank_persister:
                self.rank_persister.close()
            self.rank_persister = self._make_persister(
                self.rank_snaps, self.run_dir / "persist-rank", rank, self.persist_every,
                self.events, key=self.secret)

    def ring(self, a: P.Assign) -> None:
        """Point the replica pusher at this generation's ring holder (the same local rank on
        the node half the ring away: ring.replica_peer)."""
        rank = self.standing.rank
        self._peers = {int(r): (str(h), int(p)) for r, (h, p) in a.peers.items()}
        n = len(a.member_nodes())
        self.carry = None
        if self.pusher is not None:
            # A rank push still unacknowledged is cut off: the restore was planned from what
            # the holders reported, and a holder that died would keep it waiting the timeout.
            self.pusher.abort()
            self.pusher = None
        if self._pushed is None or n < 2 or not self.standing.data_ranks == [rank]:
            return  # no ring of one node; after a shrink positions move: disk is the copy
        peer = replica_peer_rank(rank, n, a.tasks_per_node)
        if peer not in self._peers:
            raise HpctError(f"the assignment names no transfer address for rank {peer}, "
                            f"rank {rank}'s replica holder")
        self.pusher = ReplicaPusher(self._pushed, rank, self._peers[peer], self.secret,
                                    self.job_id, self.events, timeout=self.timeout)
        world = self.standing.world_size
        if self._pushed is self.rank_snaps and Carry.applies(rank, world, n):
            self.carry = Carry(self.state, rank, world,
                               Carry.held_by(rank, n, a.tasks_per_node), self.replicas,
                               self.events, lambda: self.standing.step, self._carry_record,
                               rng=not RESEEDED, secret=self.secret)

    def close(self) -> None:
        """The pusher, the persisters and the global optimizer hook, at the process's end."""
        if self._global_hook is not None:
            self._global_hook.remove()
            self._global_hook = None
        if self.pusher:
            self.pusher.close()
        for persister in (self.persister, self.rank_persister):
            if persister:
                persister.close()
