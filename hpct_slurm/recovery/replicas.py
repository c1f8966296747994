"""Replicas of other ranks' snapshots held on this rank (`ReplicaStore`): what a ring
neighbour pushed, or what arrived carried in the gradients' all-reduce (carry.py), each rank's
in two slots (slots.py), and the steps their owners pin kept beside them.
"""
from __future__ import annotations

import contextlib
import hmac
import threading
from typing import Callable

import torch

from .. import protocol as P
from ..errors import HpctError
from .copies import as_memoryview
from .encoding import Layout
from .slots import DoubleBuffer, Snapshot


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
