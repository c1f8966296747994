"""One snapshot, and the two slots a store keeps of it (thread-safe).

Each store has two slots. A new snapshot (a capture, or a replica arriving over the network) is
written into the slot that is not current and becomes current only once complete (and, for a
replica, digest-verified): a torn write never replaces the last good copy. Readers take a
lease on a slot; a writer waits for the leases on the slot it is about to overwrite, so a
transfer in flight never sends half-overwritten bytes.

A `Snapshot`'s digest (the protocol's `part_digest`, the same one its transfer frames carry, so
it is computed once per snapshot however often it is sent) is *sealed* off the critical path:
by its first reader, or by the sealer thread here (`_SEALER`) right after a commit when the
store asks for it (snapshot.py's module docstring says when that pays).
"""
from __future__ import annotations

import contextlib
import hmac
import threading
from typing import Callable, Iterator

import torch

from .. import protocol as P
from ..errors import HpctError
from .copies import as_memoryview
from .encoding import Layout
from .worker import BackgroundQueue


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
