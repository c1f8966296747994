"""Double-buffered in-memory snapshots: this rank's own, and replicas of peers'.

Each store has two slots. A new snapshot (a capture, or a replica arriving over the network) is
written into the slot that is not current and becomes current only once complete (and, for a
replica, digest-verified): a torn write never replaces the last good copy. Readers take a
lease on a slot; a writer waits for the leases on the slot it is about to overwrite, so a
transfer in flight never sends half-overwritten bytes.

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
import hmac
import threading
from typing import Callable, Iterator

import torch

from .. import protocol as P
from ..errors import HpctError
from .state import (Layout, Marks, Scope, TrainState, as_memoryview, issue_copies, mark_ready,
                    order_after, wait_marks)
from .worker import BackgroundQueue

# Every step: the recovery contract is "nothing recomputed" (the cluster tests and the demo
# check it). What that costs is one memory copy of the state per step, measured by
# `hpct-slurm bench replication` for every=1 and larger K side by side; a job whose steps are
# short next to that copy trades recomputation for speed with HPCT_SNAPSHOT_EVERY (see
# `SnapshotStore`).
DEFAULT_SNAPSHOT_EVERY = 1


class Flag:
    """The set()/is_set() half of a threading.Event, without its condition and lock: nothing
    waits on a snapshot's `superseded`, it is only set and read, and a snapshot is made
    several times a step (a rank's own, a carried replica), where an Event's condition was a
    noticeable part of the cost. A bool's store and load are atomic under the GIL."""

    __slots__ = ("_set",)

    def __init__(self) -> None:
        self._set = False

    def set(self) -> None:
        self._set = True

    def is_set(self) -> bool:
        return self._set


class Snapshot:
    """One published snapshot: `data` is exactly `layout.nbytes` bytes.

    The digest is given (a received replica, checked on arrival) or computed once, by the sealer
    or by the first caller of `digest()`.
    """

    def __init__(self, step: int, layout: Layout, data: memoryview, digest: bytes | None = None):
        self.step, self.layout, self.data = step, layout, data
        self._digest = digest
        # The part digest's leaves, kept when this process sealed it: a striped pull then gets
        # any leaf-aligned range under its own digest without hashing (P.range_digest).
        self._leaves: list[bytes] | None = None
        self._leaves_lock = threading.Lock()  # a second caller of leaves() waits, not re-hashes
        # Set when the slot is about to be overwritten: a background seal in progress gives up.
        self.superseded = Flag()

    @property
    def sealed(self) -> bool:
        return self._digest is not None

    def digest(self) -> bytes:
        """The digest sealed for this snapshot, computed now (on all hash threads) if need be.
        Call while holding a lease, so the memory cannot change underneath."""
        if self._digest is None:
            self.leaves()
        return self._digest  # type: ignore[return-value]

    def leaves(self) -> list[bytes]:
        """The leaf digests under the sealed digest, computed now (on all hash threads) if this
        process has not got them yet. Call while holding a lease."""
        with self._leaves_lock:
            return self._compute_leaves()

    @property
    def has_leaves(self) -> bool:
        return self._leaves is not None

    def _compute_leaves(self) -> list[bytes]:
        if self._leaves is None:
            leaves = P.leaf_digests(self.data) or []
            root = P.range_digest(leaves, len(self.data), 0, len(self.data))
            if self._digest is not None and not hmac.compare_digest(root, self._digest):
                raise HpctError(f"snapshot of step {self.step} no longer matches the digest "
                                f"sealed for it")
            self._leaves, self._digest = leaves, root
        return self._leaves

    def seal_with(self, leaves: list[bytes]) -> None:
        """Seal with leaf digests this process already checked every byte against (a striped
        pull's manifest): no hashing."""
        root = P.range_digest(leaves, len(self.data), 0, len(self.data))
        with self._leaves_lock:
            self._leaves, self._digest = list(leaves), root

    def seal_in_background(self) -> bool:
        """Compute the digest in this thread, leaf by leaf, giving up once superseded. Needs no
        lease: a writer marks the snapshot superseded before touching its memory, and a digest
        finished after that mark is thrown away."""
        if self._digest is None:
            leaves = P.leaf_digests(self.data, parallel=False, cancel=self.superseded)
            if leaves is None or self.superseded.is_set():
                return False
            self._leaves = leaves
            self._digest = P.range_digest(leaves, len(self.data), 0, len(self.data))
        return True

    def verify(self) -> bool:
        """Whether the memory still matches the digest sealed earlier. A snapshot not sealed yet
        (one captured at a fault and never served) has no earlier digest to compare with, so
        there is nothing to check: True, and no hashing on a survivor's restore (it is sealed
        when first served)."""
        if self._digest is None:
            return True
        return hmac.compare_digest(P.part_digest(self.data), self._digest)  # type: ignore[arg-type]


def _seal(snap: Snapshot) -> None:
    if not snap.superseded.is_set():
        snap.seal_in_background()


# One thread per process sealing the snapshots queued after commits; a superseded one is
# skipped, so the newest wins.
_SEALER: BackgroundQueue[Snapshot] = BackgroundQueue("hpct-sealer", _seal, lazy=True)


class DoubleBuffer:
    """Two slots of flat bytes with an atomic flip and reader leases (thread-safe), and at
    most one snapshot pinned beside them (`pin`): an older step kept while the slots move on."""

    def __init__(self) -> None:
        self._bufs: list[torch.Tensor | None] = [None, None]
        self._snaps: list[Snapshot | None] = [None, None]
        self._leases = [0, 0]
        self._current = -1
        # The pinned snapshot owns its memory: its slot let go of the buffer when it was
        # pinned, so no writer overwrites it, and it lives until another is pinned.
        self._pinned: Snapshot | None = None
        self._cond = threading.Condition()
        # One writer at a time: held from acquire_target until publish or abandon.
        self._writer = threading.Lock()

    def _target(self) -> int:
        return 0 if self._current != 0 else 1

    def acquire_target(self, nbytes: int | None = None,
                       check: Callable[[Snapshot | None], None] | None = None
                       ) -> tuple[int, torch.Tensor | None]:
        """The non-current slot, invalidated and with no readers, for a writer to fill.
        `check(latest)`, once this writer has the writer lock and before the slot is given
        up: what is held then, which no other writer changes until this one is done; it may
        `discard` it, or raise to refuse the write (nothing given up, nothing held).

        The caller must end with `publish` or `abandon`.
        """
        self._writer.acquire()
        try:
            if check is not None:
                check(self.latest())
            with self._cond:
                idx = self._target()
                old = self._snaps[idx]
                if old is not None and old is not self._pinned:
                    old.superseded.set()
                if self._leases[idx]:  # (mostly none: no wait to set up)
                    self._cond.wait_for(lambda: self._leases[idx] == 0)
                self._snaps[idx] = None
                buf = self._bufs[idx]
                if nbytes is not None and (buf is None or buf.numel() < nbytes):
                    # Allocated once per size change; never shrunk, so steady state allocates
                    # nothing.
                    buf = self._bufs[idx] = torch.empty(nbytes, dtype=torch.uint8)
                return idx, buf
        except BaseException:
            # A failed allocation must not leave the writer lock held: every later write
            # would hang.
            self._writer.release()
            raise

    def publish(self, idx: int, buf: torch.Tensor, step: int, layout: Layout,
                digest: bytes | None) -> Snapshot:
        snap = Snapshot(step, layout, as_memoryview(buf)[:layout.nbytes], digest)
        with self._cond:
            self._bufs[idx] = buf
            self._snaps[idx] = snap
            self._current = idx
        self._writer.release()
        return snap

    def abandon(self, idx: int) -> None:
        """Give up a write; the current snapshot stays what it was."""
        self._writer.release()

    def latest(self) -> Snapshot | None:
        """The current slot's snapshot (the pinned one where both slots are empty)."""
        with self._cond:
            return self._snaps[self._current] if self._current >= 0 else self._pinned

    def steps(self) -> list[int]:
        with self._cond:
            held = {s.step for s in self._snaps if s is not None}
            if self._pinned is not None:
                held.add(self._pinned.step)
            return sorted(held)

    def pin(self, step: int) -> bool:
        """Keep the snapshot of `step`, held in a slot now, after the slots move on, until
        another is pinned (the step a group can roll back to when the two newest are no
        step's state: SnapshotPolicy). No copy: the slot gives its buffer up to it and its
        next writer allocates another. Whether `step` was held."""
        with self._cond:
            for i, s in enumerate(self._snaps):
                if s is not None and s.step == step:
                    if s is not self._pinned:
                        self._pinned = s
                        self._bufs[i] = None
                    return True
        return False

    @contextlib.contextmanager
    def lease(self, step: int | None = None) -> Iterator[Snapshot | None]:
        """Hold the snapshot at `step` (None: the latest) so no writer overwrites it meanwhile."""
        with self._cond:
            idx = self._current
            if step is not None:
                idx = next((i for i, s in enumerate(self._snaps) if s is not None and s.step == step), -1)
            snap = self._snaps[idx] if idx >= 0 else None
            if snap is not None:
                self._leases[idx] += 1
            elif self._pinned is not None and step in (None, self._pinned.step):
                # no writer ever reuses a pinned snapshot's memory: nothing to count
                snap, idx = self._pinned, -1
        try:
            yield snap
        finally:
            if snap is not None and idx >= 0:
                with self._cond:
                    self._leases[idx] -= 1
                    self._cond.notify_all()

    def drop_after(self, step: int) -> bool:
        """Forget the snapshots newer than `step`; one at `step` or older stays. Whether any
        was dropped."""
        with self._cond:
            newer = [x for x in [*self._snaps, self._pinned] if x is not None and x.step > step]
        for x in newer:
            self.discard(x)
        return bool(newer)

    def discard(self, snap: Snapshot) -> None:
        """Forget a snapshot found corrupt, so it is not offered again."""
        with self._cond:
            if snap is self._pinned:
                self._pinned = None
            for i, s in enumerate(self._snaps):
                if s is snap:
                    self._snaps[i] = None
                    if self._current == i:
                        other = 1 - i
                        self._current = other if self._snaps[other] is not None else -1


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


# What a deferred replica needs to become one (ReplicaStore.defer): its payload decoded and
# checked into (layout, data, digest), raising HpctError when it is not a good replica
Decoder = Callable[[bytes], tuple[Layout, bytes, bytes]]
# Told (step, why) when a deferred replica is refused at its decoding
Refused = Callable[[int, str], None]
# How many deferred replicas of a rank wait undecoded: the two newest, what its slots keep
_DEFERRED = 2


class ReplicaStore:
    """Replicas of other ranks' snapshots, each rank double-buffered. `pin(step)`: whether a
    replica of `step` is kept after the newer ones move on (DoubleBuffer.pin): the steps the
    owners keep too (SnapshotPolicy: a rank's own state at its last full commit).

    A replica can also arrive undecoded (`defer`: a rank's slot carried in the gradient
    all-reduce, every step): it is decoded, checked and stored by the first read of that
    rank's replicas, not in the step that brought it. Every reader below settles them first,
    so what they answer is as if each had been stored on arrival."""

    def __init__(self, pin: Callable[[int], bool] | None = None) -> None:
        self._lock = threading.Lock()
        self._ranks: dict[int, DoubleBuffer] = {}
        self._pin = pin
        # rank -> its deferred replicas, oldest first: (step, payload, decoder, refused)
        self._deferred: dict[int, list[tuple[int, bytes, Decoder, Refused]]] = {}
        # One settler at a time, so no reader answers while another holds replicas it took
        # out of `_deferred` and has not stored yet
        self._settling = threading.RLock()
        # How many settlers hold replicas taken out of `_deferred` and not stored yet (counted
        # under `_lock` with the taking): a reader that finds nothing deferred must still wait
        # for them, or it answers without a step being decoded that moment
        self._decoding = 0

    def _buffer(self, rank: int) -> DoubleBuffer:
        with self._lock:
            return self._ranks.setdefault(rank, DoubleBuffer())

    def _slots(self, rank: int) -> DoubleBuffer:
        """`rank`'s slots, its deferred replicas stored first, and those another thread is
        decoding now (`_settle` waits for that thread)."""
        with self._lock:
            busy = rank in self._deferred or self._decoding
        if busy:
            self._settle([rank])
        return self._buffer(rank)

    def _settle(self, ranks: list[int] | None = None) -> None:
        """Decode and store the deferred replicas of `ranks` (None: every rank), oldest first;
        one refused is told to its `refused` and leaves what was held."""
        with self._settling:
            with self._lock:
                todo = [(r, self._deferred.pop(r)) for r in
                        (list(self._deferred) if ranks is None else ranks)
                        if r in self._deferred]
                self._decoding += 1
            try:
                for rank, pending in todo:
                    for step, payload, decoder, refused in pending:
                        try:
                            layout, data, digest = decoder(payload)
                            idx, buf = self._begin(rank, len(data), step, carried=True)
                            if data:
                                as_memoryview(buf)[:len(data)] = data
                            self._finish(rank, idx, buf, step, layout, digest, checked=True)
                        except HpctError as exc:
                            refused(step, exc.message)
            finally:
                with self._lock:
                    self._decoding -= 1

    def defer(self, rank: int, step: int, payload: bytes, decoder: Decoder,
              refused: Refused) -> None:
        """`rank`'s replica of `step`, stored undecoded: `decoder(payload)` runs when the
        rank's replicas are next read (any method here), and a replica it refuses is told to
        `refused` then. Why: the carried slots arrive every step, on the training thread,
        and decoding one (its check, its layout's JSON, the slots' bookkeeping) was 0.2 ms of
        a 37 ms step on this project's 2-core VM (`hpct-slurm bench replication`), for a
        replica read only after a fault. Only the two newest wait (older ones would have been
        overwritten by them, as in the slots); a step the holder pins is stored at once, since
        the pin must outlive them."""
        with self._lock:
            pending = self._deferred.setdefault(rank, [])
            pending.append((step, payload, decoder, refused))
            if len(pending) > _DEFERRED:
                del pending[0]
        if self._pin is not None and self._pin(step):
            self._settle([rank])

    def ranks(self) -> list[int]:
        self._settle()
        with self._lock:
            return sorted(r for r, db in self._ranks.items() if db.latest() is not None)

    def begin(self, rank: int, nbytes: int, step: int | None = None) -> tuple[int, torch.Tensor]:
        """A writable slot of at least `nbytes` for an incoming replica of `rank` at `step`.

        A step older than the newest one held is refused here, under the writer lock, before
        the older slot is given up for it; so is a size that cannot be allocated. Either way
        nothing stays held. A copy of the step held newest replaces it (`_begin`)."""
        self._slots(rank)
        return self._begin(rank, nbytes, step)

    def _begin(self, rank: int, nbytes: int, step: int | None, carried: bool = False
               ) -> tuple[int, torch.Tensor]:
        """`begin`; `carried`: for a replica carried in the all-reduce (`defer`), not pushed."""
        slots = self._buffer(rank)

        def check(newest: Snapshot | None) -> None:
            # Under the writer lock: no copy is published between this look and the write
            self._refuse_older(rank, step, newest)
            if newest is not None and newest.step == step:
                # The step held newest, again. Two copies of one step must never be held (a
                # lease by step would take either), and the committed copy wins: a push of
                # the step held is the owner's commit, sent because the copy it carried in
                # the all-reduce is not its step's state (it moved after it: carry.py), so
                # it replaces that copy and the step before stays; a carried copy of a step
                # held is dropped (the push came first: the holder took its all-reduce's
                # slots after it), the committed copy kept.
                if carried:
                    raise HpctError(f"carried copy of rank {rank}'s step {step} dropped: the "
                                    f"committed copy of that step, pushed at its end, is "
                                    f"held and stays")
                slots.discard(newest)

        try:
            idx, buf = slots.acquire_target(nbytes, None if step is None else check)
        except (RuntimeError, MemoryError) as exc:  # what torch raises when it cannot allocate
            raise HpctError(f"cannot allocate {nbytes} bytes for a replica of rank {rank}: "
                            f"{exc}") from None
        assert buf is not None
        return idx, buf

    def forget_after(self, step: int) -> list[int]:
        """Drop every rank's replicas newer than `step`: the group rolled back to it (a restore
        from disk), so the next pushes legitimately carry older steps than those held, and the
        newer copies belong to a history that no longer happens. A replica at `step` itself
        stays: it is the state the group restores, and a newcomer may still be fetching it
        from this holder (a planned move's restore step is often one behind the newest
        replica; dropping it lost the race to the newcomer's fetch). The ranks dropped."""
        self._settle()
        with self._lock:
            dropped = [r for r, db in self._ranks.items() if db.drop_after(step)]
            for r in dropped:
                if self._ranks[r].latest() is None:
                    del self._ranks[r]
        return dropped

    @staticmethod
    def _refuse_older(rank: int, step: int, held: Snapshot | None) -> None:
        # Replicas only move forward: an older one arriving is stale or replayed, and taking it
        # would roll the holder back.
        if held is not None and step < held.step:
            raise HpctError(f"replica of rank {rank} at step {step} is older than step "
                            f"{held.step} held; refused")

    def finish(self, rank: int, idx: int, buf: torch.Tensor, step: int, layout: Layout,
               digest: bytes, checked: bool = False) -> Snapshot:
        """Make a received replica current, only if its bytes match `digest` (`checked`: the
        protocol already verified them while receiving, so they are not hashed twice) and it is
        not older than the newest held."""
        return self._finish(rank, idx, buf, step, layout, digest, checked)

    def _finish(self, rank: int, idx: int, buf: torch.Tensor, step: int, layout: Layout,
                digest: bytes, checked: bool) -> Snapshot:
        slots = self._buffer(rank)
        try:
            self._refuse_older(rank, step, slots.latest())
        except HpctError:
            slots.abandon(idx)
            raise
        if not checked and not hmac.compare_digest(P.part_digest(as_memoryview(buf)[:layout.nbytes]),
                                                   digest):
            slots.abandon(idx)
            raise HpctError(f"replica of rank {rank} at step {step} does not match the sender's "
                            f"digest {digest.hex()[:16]}...; kept the previous replica")
        snap = slots.publish(idx, buf, step, layout, digest)
        if self._pin is not None and self._pin(step):
            slots.pin(step)
        return snap

    def pin(self, step: int) -> list[int]:
        """Pin every rank's replica of `step` where one is held (the step a group restored:
        SnapshotPolicy.hold_restored). The ranks pinned."""
        self._settle()
        with self._lock:
            held = list(self._ranks.items())
        return sorted(r for r, db in held if db.pin(step))

    def abandon(self, rank: int, idx: int) -> None:
        self._buffer(rank).abandon(idx)

    def latest(self, rank: int) -> Snapshot | None:
        return self._slots(rank).latest()

    def steps(self, rank: int) -> list[int]:
        return self._slots(rank).steps()

    def lease(self, rank: int, step: int | None = None) -> contextlib.AbstractContextManager[Snapshot | None]:
        return self._slots(rank).lease(step)

    def discard(self, rank: int, snap: Snapshot) -> None:
        self._buffer(rank).discard(snap)


# --- placement (pure) --------------------------------------------------------------------------

def ring_offset(num_nodes: int) -> int:
    """How far along the node order a node's replicas live: half the ring. Neighbours in the
    node order (n2, n3) tend to share a rack, a switch or a power feed, so the copy of a node's
    state goes to the node farthest from it; two adjacent nodes lost together then never take
    a state and its only replica with them."""
    return max(1, num_nodes // 2)


def replica_peer(node_index: int, num_nodes: int) -> int:
    """The node that holds replicas of `node_index`'s ranks: half the ring away."""
    if num_nodes < 2:
        raise HpctError(f"replicas need at least 2 nodes, got num_nodes={num_nodes}")
    if not 0 <= node_index < num_nodes:
        raise HpctError(f"node_index {node_index} is outside 0..{num_nodes - 1}")
    return (node_index + ring_offset(num_nodes)) % num_nodes


def replica_source_node(node_index: int, num_nodes: int) -> int:
    """The node whose ranks' replicas `node_index` holds (half the ring back)."""
    replica_peer(node_index, num_nodes)
    return (node_index - ring_offset(num_nodes)) % num_nodes


def replica_peer_rank(rank: int, num_nodes: int, tasks_per_node: int) -> int:
    """The rank that holds `rank`'s replica: same local rank on the node half the ring away."""
    node, local = divmod(rank, tasks_per_node)
    return replica_peer(node, num_nodes) * tasks_per_node + local


def ranks_held_by(node_index: int, num_nodes: int, tasks_per_node: int) -> list[int]:
    """Ranks whose replicas live on node `node_index` (one per local rank)."""
    src = replica_source_node(node_index, num_nodes)
    return [src * tasks_per_node + local for local in range(tasks_per_node)]
