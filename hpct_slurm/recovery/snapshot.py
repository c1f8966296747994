"""This rank's own snapshots (`SnapshotStore`): a copy of its registered state committed at a
step's end, held lazily, or copied overlapped with the next step, each proven to be the step it
claims (`Unchanged`). Kept in two slots (slots.py). The replicas this rank holds of its peers'
snapshots are replicas.py's; which node holds whose is ring.py's rule.

The commit itself is only the copy. A snapshot's digest (the protocol's `part_digest`, the same
one its transfer frames carry, so it is computed once per snapshot however often it is sent) is
*sealed* off the critical path: by default by its first reader (a fault-time serve, a replica
push, a disk save, `verify`), optionally by a background sealer thread right after the commit.
Nothing is sent, stored or restored without a digest, and a receiver checks every byte against it.

Why not always in the background: on a CPU-bound step the sealer takes the step's own cores
(hashing the state costs several times copying it; `hpct-slurm bench replication` measures both
side by side). Where host cores idle (GPU training), `background_seal=True` shortens the
fault-time serve by one hash of the state and narrows the window in which a memory error in the
slot would be sealed into the digest rather than caught.
"""
from __future__ import annotations

import contextlib
import threading
from typing import Callable

import torch

from ..errors import HpctError
from .copies import Marks, as_memoryview, issue_copies, mark_ready, order_after, wait_marks
from .encoding import Layout
from .slots import _SEALER, DoubleBuffer, Snapshot
from .state import Scope, TrainState

# Every step: the recovery contract is "nothing recomputed" (the cluster tests and the demo
# check it). What that costs is one memory copy of the state per step, measured by
# `hpct-slurm bench replication` for every=1 and larger K side by side; a job whose steps are
# short next to that copy trades recomputation for speed with HPCT_SNAPSHOT_EVERY (see
# `SnapshotStore`).
DEFAULT_SNAPSHOT_EVERY = 1


class NotTheStep(HpctError):
    """A held or overlapped snapshot whose tensors changed in place after its step ended: it
    is not that step's state (it would be silently wrong), so it is never published."""


class Unchanged:
    """Proof that a snapshot is the step it claims: the in-place version counters
    (`Tensor._version`; a DTensor's local shard's, which shares its base's) of the tensors a
    lazy hold or an overlapped copy reads after the step ended, as they were then.

    The rule these rest on, "parameters and optimizer state change only inside the watched
    optimizer step", is broken by ordinary code: SAM's perturbation of the weights before its
    second forward, weight decay or clipping applied by hand before the update, an EMA
    updated at a step's start, a second optimizer not given to Job. Any of them moves a
    counter; `changed` names how many tensors moved. Reading and comparing the counters costs
    about 0.15 us a tensor (150 us a step for 1,000 tensors, measured on this project's 2-core
    machine: docs/benchmarks.md)."""

    def __init__(self, tensors: list[torch.Tensor]):
        self.tensors = tensors
        self.versions = [t._version for t in tensors]

    def now(self) -> list[int]:
        return [t._version for t in self.tensors]

    def changed(self, versions: list[int] | None = None) -> int:
        """How many tensors were changed in place since the step ended (by `versions`, the
        counters read at some later moment, or now)."""
        now = self.now() if versions is None else versions
        return sum(a != b for a, b in zip(self.versions, now))

    def keep(self, which: list[bool]) -> "Unchanged":
        """The proof for the tensors marked in `which` only, with the versions of the step."""
        kept = Unchanged([])
        kept.tensors = [t for t, k in zip(self.tensors, which) if k]
        kept.versions = [v for v, k in zip(self.versions, which) if k]
        return kept


class SnapshotStore:
    """This rank's own snapshots of `state`, committed every `every` steps.

    The trade of `every` = K: a commit costs one copy of the state (memory bandwidth), paid on
    1/K of the steps; a fault rolls the group back to the last commit, so up to K-1 finished steps
    are recomputed (bit-identically, since `Job` reseeds every step from (seed, rank, step)).
    Commits land on steps divisible by K, the same steps on every rank, so all survivors hold the
    step the controller picks (the oldest newest commit; the other slot keeps the one before).
    `background_seal` (see the module docstring) hashes each commit right away on a background
    thread instead of leaving the digest to its first reader. `rng`: whether a snapshot of the
    `rank` scope holds the RNG states (TrainState: not where the owner reseeds them before
    every step, as `Job` does).
    """

    def __init__(self, state: TrainState, scopes: tuple[Scope, ...] = ("shared", "rank"),
                 every: int = DEFAULT_SNAPSHOT_EVERY, background_seal: bool = False,
                 rng: bool = True):
        if every < 1:
            raise HpctError(f"snapshot interval every={every} must be >= 1 step")
        self.state = state
        self.scopes = scopes
        self.rng = rng
        self.every = every
        self.background_seal = background_seal
        self.slots = DoubleBuffer()
        # commit_async's state: its copy done, it and its follow-up done, its error
        self._copied = threading.Event()
        self._done = threading.Event()
        # commit_async's copies queued (done, on a CPU), and the events of those on a GPU
        self._issued = threading.Event()
        self._late_marks: Marks = []
        self._copied.set()
        self._done.set()
        self._issued.set()
        self._error: BaseException | None = None
        # prepare_lazy's slot: (index, buffer, step, layout, parameter copies still to make,
        # marks of copies running, the versions its live tensors must keep)
        self._pending: tuple | None = None
        # _split's last answer: the live tensors' addresses, and which of them are late
        self._split_ptrs: tuple[int, ...] | None = None
        self._split_late: list[bool] = []
        # An overlapped commit's version counters read where the next update was ordered after
        # its copy (before_optimizer_step): changes from there on cannot reach the copy.
        self._ordered: list[int] | None = None
        self._async_watch = Unchanged([])
        self._watch_lock = threading.Lock()
        # Called with (step, detail) for a snapshot refused as not its step's state (the
        # policy records it); the store then keeps holding the one before.
        self.on_not_the_step: Callable[[int, str], None] | None = None

    def due(self, step: int) -> bool:
        return step % self.every == 0

    def after_step(self, step: int) -> Snapshot | None:
        """Commit if `step` is a commit step; the snapshot committed, else None."""
        return self.commit(step) if self.due(step) else None

    def _begin(self) -> tuple[int, torch.Tensor, Layout, list, Marks, Unchanged]:
        """Start a snapshot in the spare slot (after the last commit is done and a pending
        one given up): what can still change before the next optimizer step (buffers, RNG
        states, scalars, anything not a parameter or optimizer state) is copied now. Returns
        the slot, its buffer, the layout, the (destination, live) pairs still to copy (the
        parameters and optimizer state) and the marks of copies still running on a GPU: the
        step's end (mark_ready), and those early copies themselves, which the next step's
        kernels wait for on the GPU (a buffer is written by the next forward) while this
        thread goes on; and the version counters those late pairs must keep until they are
        copied. The caller ends with `_finish` or `abandon`."""
        self.wait()
        self.drop_pending()
        idx, buf = self.slots.acquire_target()
        try:
            layout, buf, pairs = self.state.prepare(buf, self.scopes, self.rng)
            early_pairs, late = self._split(pairs)
            ready = mark_ready(pairs)
            early = issue_copies(early_pairs, ready)
            order_after(early)
        except BaseException:
            self.slots.abandon(idx)
            raise
        return idx, buf, layout, late, ready + early, Unchanged([t for _, t in late])

    def _split(self, pairs: list) -> tuple[list, list]:
        """(early, late): the pairs whose live tensor anything may change before the next
        optimizer step (buffers), and those only an optimizer step changes (parameters and
        optimizer state: TrainState.stable_ptrs). The split is kept for the live tensors'
        addresses, in order: a walk over every parameter and optimizer state a step was a
        sixth of a lazy hold's cost, for the same answer while the tensors stay where they
        are (a tensor moved or added changes the addresses, and the split is made again)."""
        ptrs = tuple(src.data_ptr() for _, src in pairs)
        if ptrs != self._split_ptrs:
            stable = self.state.stable_ptrs() if pairs else set()
            self._split_late = [p in stable for p in ptrs]
            self._split_ptrs = ptrs
        split: tuple[list, list] = ([], [])
        for pair, late in zip(pairs, self._split_late):
            split[late].append(pair)
        return split

    def _finish(self, idx: int, buf: torch.Tensor, step: int, layout: Layout,
                late: list, marks: Marks, watch: Unchanged) -> Snapshot:
        """Copy the rest of a begun snapshot and make it current (unsealed), unless what it
        copied changed in place since its step ended (NotTheStep)."""
        try:
            marks = marks + issue_copies(late, marks)
        except BaseException:
            self.slots.abandon(idx)
            raise
        return self._publish(idx, buf, step, layout, marks, watch)

    def _publish(self, idx: int, buf: torch.Tensor, step: int, layout: Layout,
                 marks: Marks, watch: Unchanged, versions: list[int] | None = None
                 ) -> Snapshot:
        """Once the copies behind `marks` are done, make the slot current (unsealed) if the
        tensors they read kept their versions (`versions`: as read where later changes could
        no longer reach the copy; default: now, once it is done)."""
        try:
            wait_marks(marks)
            moved = watch.changed(versions)
            if moved:
                raise NotTheStep(f"{moved} of {len(watch.tensors)} tensors of step {step}'s "
                                 f"snapshot were changed in place after the step ended, "
                                 f"outside the watched optimizer step: it is not that "
                                 f"step's state")
        except BaseException:
            self.slots.abandon(idx)
            raise
        snap = self.slots.publish(idx, buf, step, layout, None)
        if self.background_seal:
            _SEALER.put(snap)
        return snap

    def _refused(self, step: int, exc: NotTheStep) -> None:
        if self.on_not_the_step is not None:
            self.on_not_the_step(step, exc.message)

    def commit(self, step: int) -> Snapshot:
        """Capture the state after `step` into the spare slot and make it current (unsealed)."""
        idx, buf, layout, late, marks, watch = self._begin()
        return self._finish(idx, buf, step, layout, late, marks, watch)

    def adopt(self, step: int, layout: Layout, buf: torch.Tensor,
              leaves: list[bytes]) -> Snapshot:
        """Make `buf`, this store's kind of state at `step` pulled from peers and checked on
        arrival against `leaves` (fetch_striped), the current snapshot as it is: no copy and
        no hashing, where a commit of the just restored state would copy it all again into
        fresh memory. The caller gives `buf` up (it becomes a slot)."""
        self.wait()
        self.drop_pending()
        idx, _ = self.slots.acquire_target()
        snap = self.slots.publish(idx, buf, step, layout, None)
        snap.seal_with(leaves)
        return snap

    def put(self, step: int, layout: Layout, data: bytes) -> Snapshot:
        """Make `data`, this store's kind of state at `step` captured and checked elsewhere
        (a rank's carried slot, checked against a fresh plan: Carry.commit), the current
        snapshot: copied into the spare slot, unsealed."""
        if layout.nbytes != len(data):
            raise HpctError(f"snapshot of step {step}: its layout says {layout.nbytes} bytes, "
                            f"{len(data)} given")
        self.wait()
        self.drop_pending()
        idx, buf = self.slots.acquire_target(len(data))
        assert buf is not None
        if data:
            as_memoryview(buf)[:len(data)] = data
        snap = self.slots.publish(idx, buf, step, layout, None)
        if self.background_seal:
            _SEALER.put(snap)
        return snap

    def commit_async(self, step: int, then: Callable[[Snapshot], None] | None = None) -> None:
        """Commit `step` off the step's critical path: what can still change before the next
        optimizer step is captured now (`_begin`); parameters and optimizer state are copied
        on a background thread while the next step's forward and backward run. The
        optimizer's step pre-hook (`before_optimizer_step`) holds the next update back until
        that copy is done: on a CPU this thread waits for it; on a GPU, where the copy runs
        on a copy stream, only the update's kernels wait for it, on the GPU. The snapshot is
        published, and `then(snapshot)` runs (a push, a save), on the background thread."""
        idx, buf, layout, late, marks, watch = self._begin()
        self._copied.clear()
        self._done.clear()
        self._issued.clear()
        self._late_marks = []
        with self._watch_lock:
            self._ordered = None
            self._async_watch = watch

        def work() -> None:
            snap = None
            versions = None
            try:
                self._late_marks = issue_copies(late, marks)  # a CPU's copies are done here
                if not self._late_marks:
                    # Done on this thread: the update still waits for _issued, so any change
                    # seen now came from elsewhere, while the copy read.
                    versions = watch.now()
            except BaseException as exc:  # kept for the training thread (wait)
                self.slots.abandon(idx)
                self._error = exc
            finally:
                self._issued.set()
            try:
                if self._error is None:
                    wait_marks(self._late_marks)
                    if versions is None:
                        # On a GPU: as read where the next update was ordered after the copy,
                        # or now if it was not yet (then a change now may have raced it)
                        with self._watch_lock:
                            versions = self._ordered
                    snap = self._publish(idx, buf, step, layout, marks + self._late_marks,
                                         watch, versions)
            except NotTheStep as exc:
                self._refused(step, exc)
            except BaseException as exc:
                self._error = exc
            finally:
                self._copied.set()
            try:
                if snap is not None and then is not None:
                    then(snap)  # reports its own failures: they do not stop training
            finally:
                self._done.set()

        threading.Thread(target=work, name="hpct-snapshot", daemon=True).start()

    def forget_live(self) -> None:
        """Let go of the live tensors the last overlapped commit watched, once it is settled:
        the inline form (Job.main) drops the objects they belong to when main() runs again,
        and on a GPU a reference kept here would hold the old model's memory beside the new."""
        with self._watch_lock:
            self._async_watch = Unchanged([])
            self._ordered = None
        self._late_marks = []

    def prepare_lazy(self, step: int) -> None:
        """Hold step `step` without copying the big state: what can still change before the
        next optimizer step is copied now (`_begin`), and the parameters and optimizer state
        are left where they are, to be copied only if a fault comes before the next optimizer
        step starts (`finish_pending`): until then they are exactly the state after `step`.
        The next optimizer step drops the pending snapshot (`before_optimizer_step`)."""
        idx, buf, layout, late, marks, watch = self._begin()
        self._pending = (idx, buf, step, layout, late, marks, watch)

    def drop_pending(self) -> None:
        pending, self._pending = self._pending, None
        if pending is not None:
            self.slots.abandon(pending[0])

    def finish_pending(self) -> Snapshot | None:
        """After a fault: copy the pending step's parameters and optimizer state, untouched
        since it ended, and publish it. None when nothing is pending (an optimizer step
        started since the last step ended: the live state is no step's state)."""
        pending, self._pending = self._pending, None
        if pending is None:
            return None
        try:
            return self._finish(*pending)
        except NotTheStep as exc:  # its tensors moved since the step: it is no step's state
            self._refused(pending[2], exc)
            return None

    def before_optimizer_step(self, ahead: set[int] | None = None) -> None:
        """From the optimizer's step pre-hook: the parameters and optimizer state are about
        to change, so a pending snapshot no longer describes them, and the background copy of
        the last commit must read them first: on a CPU it is done when this returns; on a
        GPU its copies are queued and the update's kernels wait for them there (this thread
        waits only for the copies to be queued, a matter of the host's launch time).

        `ahead`: the addresses of the tensors this update changes, given where it is not the
        step's last (a GAN's discriminator, updated before the generator's gradients are
        reduced): those of the pending snapshot are copied now, before they change, and the
        step stays held (`_copy_ahead`)."""
        if ahead is None or not self._copy_ahead(ahead):
            self.drop_pending()
        if not self._issued.is_set():  # (mostly set: no condition to take)
            self._issued.wait()  # the issuing thread set the marks (or the error) before this
        self._raise()
        marks = self._late_marks
        order_after(marks)
        if marks and not self._copied.is_set():
            # From here on this update, and any later write, runs after the copy on the GPU:
            # the versions now are the ones the copy must have read.
            with self._watch_lock:
                if self._ordered is None:
                    self._ordered = self._async_watch.now()

    def _copy_ahead(self, ahead: set[int]) -> bool:
        """Copy the pending snapshot's live tensors at `ahead` into its slot now, and keep
        holding it: the rest stays untouched until a later update (the step's last, which
        drops it), so a fault in between still finds the step whole (finish_pending copies
        the rest). Costs a copy of what this update changes, where dropping the hold would
        cost the group a rollback to the last full commit. False when nothing is pending, or
        the pending step is no longer the live state (refused, as at a fault)."""
        pending = self._pending
        if pending is None:
            return False
        idx, buf, step, layout, late, marks, watch = pending
        moved = watch.changed()
        if moved:
            self.drop_pending()
            self._refused(step, NotTheStep(f"{moved} of {len(watch.tensors)} tensors of "
                                           f"step {step}'s snapshot were changed in place "
                                           f"before the step's next update"))
            return False
        now = [src.data_ptr() in ahead for _, src in late]
        try:
            copied = issue_copies([pair for pair, n in zip(late, now) if n], marks)
        except BaseException:
            self.drop_pending()
            raise
        order_after(copied)  # on a GPU the update's kernels wait for these copies
        self._pending = (idx, buf, step, layout, [pair for pair, n in zip(late, now) if not n],
                         marks + copied, watch.keep([not n for n in now]))
        return True

    def wait_copied(self) -> None:
        """Until the background copy of the last commit is done (the parameters and optimizer
        state may change from here on)."""
        self._copied.wait()
        self._raise()

    def wait(self) -> None:
        """Until the last commit and what follows it (`then`) are done."""
        if not self._done.is_set():  # (mostly set: no condition to take)
            self._done.wait()
        self._raise()

    def _raise(self) -> None:
        if self._error is not None:
            exc, self._error = self._error, None
            raise exc

    def latest(self) -> Snapshot | None:
        return self.slots.latest()

    def lease(self, step: int | None = None) -> contextlib.AbstractContextManager[Snapshot | None]:
        return self.slots.lease(step)
