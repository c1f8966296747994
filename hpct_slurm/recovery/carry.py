"""Each rank's own small state (a sampler position) carried to its ring holder inside the
step's gradient all-reduce, instead of pushed over a connection of its own after the step.

Why: pushing a few hundred bytes every step woke a thread on the sender and the transfer
server's thread on the holder, every step, for a frame the holder could have had for free.
On a CPU-bound step those wake-ups took the cores from the step's matrix products:
`hpct-slurm bench replication` (100 MB, 43 ms steps, 15 rounds, one run): the shared state
held lazily +3.7 %, with a sampler's position pushed every step +5.8 %, carried +4.0 %. The
push also left a window: a rank lost between its last all-reduce and its push left its holder
one step behind the survivors, and the group rolled back to disk.

How: every rank of the group adds one more all-reduce to the step's gradient reduction, a
uint8 region of `SLOT_BYTES` per rank, zero but for its own slot: the sum is every rank's
slot (integers, one non-zero term each: exact in any order). It is its own collective, so the
gradients' buffers and thus their sums are the same bit for bit as without it. The holder of
each rank (ring.replica_peer_rank) decodes that rank's slot into its `ReplicaStore` as
the rank's snapshot of the step in progress. The step's end then checks that the rank's own
commit is what it carried (the state did not move after the all-reduce); the push is skipped.

What the slot holds is the rank state as it stands at the all-reduce, labelled with the step
in progress: right when a script changes its registered per-rank state only before its
backward pass (a batch drawn, then forward, backward, update), which the step's end verifies.
A rank whose state moved after its all-reduce (the loop form's next batch, a counter bumped
after the update) is caught there: its carried copy is replaced by a synchronous push of the
committed one, an event says so, and that rank pushes every step from then on. A rank carries
nothing until one step has shown its state does not move (`Carry.trusted`): a script that
always moves it never sends a carried copy at all. Left open: a script whose state moves after
the all-reduce only now and then, whose rank is lost in the moment between such a step's
all-reduce and its corrective push (docs/architecture.md, "The rank's own state")."""
from __future__ import annotations

import functools
import hashlib
import hmac
import struct
from typing import Callable

import torch
import torch.distributed as dist

from .. import protocol as P
from ..errors import HpctError
from ..events import Ev, EventLog
from .encoding import Layout
from .replicas import ReplicaStore
from .ring import ranks_held_by
from .slots import Snapshot
from .snapshot import SnapshotStore
from .state import TrainState

# Part of every rank's layout of the collective: the same constant on every rank (a setting
# could let two ranks differ, and the all-reduce would mix their slots). A sampler's snapshot
# is ~180 bytes of layout and no tensor bytes (ResumableSampler).
SLOT_BYTES = 512
# The region is world x SLOT_BYTES on every rank; beyond this (8,192 ranks) the per-step
# bytes are no longer small next to a push of one slot, and ranks push instead.
MAX_REGION_BYTES = 4 << 20
_MAGIC = 0xC2                   # (0xC1: the unkeyed 8-byte check)
_HEAD = struct.Struct("<BqHH")  # magic, step, layout length, data length
# The slot's MAC: keyed blake2b (slot_key: the job's secret) over the sending rank and the head
# and body. Why keyed: this rank state used to travel only on the transfer channel, which the
# job's secret authenticates; with a plain checksum anyone who could write into the gloo
# all-reduce could forge a slot, its check recomputed, and a replacement restored the forged
# position. The rank is in it so a genuine slot moved to another rank's place is refused. 16
# bytes of the 512; a sampler's slot encoded in 0.9 us instead of 0.5 (this project's 2-core
# VM, timeit), once a step.
_CHECK = 16
_RANK = struct.Struct("<q")
# A sampler's slot has no tensor bytes (its position is in the layout's tree): the digest a
# holder serves for it is this one, every step
_EMPTY_DIGEST = P.part_digest(b"")


def slot_key(secret: bytes) -> bytes:
    """The key of the slots' MACs, derived from the job's secret: a key of its own, so a
    slot's MAC can never be taken for a protocol frame's or a persisted file's."""
    return hmac.new(secret, b"hpct carried slot", hashlib.sha256).digest()


def _mac(key: bytes, rank: int, body: bytes | memoryview) -> bytes:
    mac = hashlib.blake2b(_RANK.pack(rank), digest_size=_CHECK, key=key)
    mac.update(body)
    return mac.digest()


def encode(step: int, layout_json: bytes, data: bytes, *, key: bytes, rank: int
           ) -> bytes | None:
    """Rank `rank`'s slot: its state at `step`, MACed with `key` (slot_key); None when it
    does not fit a slot."""
    if len(layout_json) > 0xFFFF or len(data) > 0xFFFF:
        return None
    body = _HEAD.pack(_MAGIC, step, len(layout_json), len(data)) + layout_json + data
    blob = body + _mac(key, rank, body)
    return blob if len(blob) <= SLOT_BYTES else None


def _head(slot: bytes) -> tuple[int, int, int]:
    """(step, layout length, end of the body) from a slot's head, unchecked; a head that is
    not one `encode` made raises, naming what is wrong."""
    if len(slot) != SLOT_BYTES:
        raise HpctError(f"carried slot is {len(slot)} bytes, not {SLOT_BYTES}")
    magic, step, n_layout, n_data = _HEAD.unpack_from(slot)
    end = _HEAD.size + n_layout + n_data
    if magic != _MAGIC or end + _CHECK > SLOT_BYTES:
        raise HpctError(f"carried slot has magic {magic:#x} and lengths {n_layout}+{n_data}: "
                        f"not a slot of this version")
    return step, n_layout, end


def decode(slot: bytes, *, key: bytes, rank: int) -> tuple[int, Layout, bytes] | None:
    """(step, layout, data) from rank `rank`'s slot; None for an empty one (all zeros: that
    rank sent nothing this step). A slot that is not one `encode` made for `rank` with `key`
    raises, naming what is wrong."""
    if len(slot) == SLOT_BYTES and slot.count(0) == SLOT_BYTES:  # (counted in C)
        return None
    step, n_layout, end = _head(slot)
    if not hmac.compare_digest(_mac(key, rank, slot[:end]), slot[end:end + _CHECK]):
        raise HpctError(f"carried slot of rank {rank} at step {step} fails its MAC: torn, "
                        f"mixed, or not made by this job's rank {rank}")
    layout = Layout.from_json(slot[_HEAD.size:_HEAD.size + n_layout])
    data = slot[_HEAD.size + n_layout:end]
    if layout.nbytes != len(data):
        raise HpctError(f"carried slot's layout says {layout.nbytes} bytes, the slot holds "
                        f"{len(data)}")
    return step, layout, data


def _replica(slot: bytes, *, key: bytes, rank: int) -> tuple[Layout, bytes, bytes]:
    """A held rank's replica from its non-empty slot: (layout, data, digest), the digest what
    a fetch serves (the slot's own MAC passed). ReplicaStore.defer's decoder."""
    got = decode(slot, key=key, rank=rank)
    if got is None:
        raise HpctError("carried slot is empty")
    _, layout, data = got
    return layout, data, P.part_digest(data) if data else _EMPTY_DIGEST


def _same_tensors(layout: Layout, a: bytes, b: memoryview) -> bool:
    """Whether two captures of one layout hold the same tensor bytes. Only the entries' bytes
    count: the alignment padding between them is whatever the buffer held before (torch.empty),
    different in the carry's scratch buffer and the snapshot's slot, and compared whole it
    made a rank state with a tensor of its own (not a multiple of 64 bytes) look moved after
    every all-reduce."""
    return all(a[e.offset:e.offset + e.nbytes] == b[e.offset:e.offset + e.nbytes]
               for e in layout.entries)


class CarryRecord:
    """What this process learned of its own rank state, kept across generations: how many
    steps showed it does not move after the all-reduce, and whether it ever did."""

    def __init__(self) -> None:
        self.verified = 0
        self.moved = False


class Carry:
    """One generation's carrying, for a rank of plain data parallelism over gloo: `start()`
    beside the gradient all-reduce (the region of `region()` all-reduced), `finish()` after it
    (`take` of the summed region), `confirm(step, snap)` at the step's end.

    `rank`/`world`: the group's; `held`: the ranks whose replicas this rank holds;
    `step_now()`: the step in progress; `rng`: whether the rank snapshot holds RNG states;
    `secret`: the job's secret, which keys every slot's MAC (slot_key)."""

    def __init__(self, state: TrainState, rank: int, world: int, held: list[int],
                 replicas: ReplicaStore, events: EventLog, step_now: Callable[[], int],
                 record: CarryRecord, rng: bool = False, *, secret: bytes):
        self.state, self.rank, self.world, self.held = state, rank, world, held
        self._key = slot_key(secret)
        self.replicas, self.events, self.step_now, self.record = replicas, events, step_now, record
        self.rng = rng
        self._region = torch.zeros(world * SLOT_BYTES, dtype=torch.uint8)
        # The same memory as numpy: the per-step filling and reading of slots are numpy and
        # bytes operations, each a fraction of a torch call's dispatch (this runs every step,
        # right after the backward pass, when little of the interpreter is still in cache)
        self._region_np = self._region.numpy()
        self._region_mv = memoryview(self._region_np)
        self._scratch: torch.Tensor | None = None
        # what this rank's slot said at the last all-reduce: (step, layout json, data, sent)
        self.captured: tuple[int, bytes, bytes, bool] | None = None
        self._too_big = False
        self._work: dist.Work | None = None
        # each held rank's last step taken: `replica.stored` is recorded where a run of
        # consecutive carried steps begins, not for every step (a record every step was an
        # open, a write and a close of the rank's event log on the run directory's shared
        # file system, per rank and step, for what the holder's fault report says anyway)
        self._last_taken: dict[int, int] = {}
        # each held rank's teller of a slot refused when it is decoded (ReplicaStore.defer)
        self._refusals = {r: functools.partial(self._refused, r) for r in held}
        # and its decoder, which checks the slot's MAC as that rank's
        self._decoders = {r: functools.partial(_replica, key=self._key, rank=r) for r in held}

    @classmethod
    def applies(cls, rank: int, world: int, num_nodes: int) -> bool:
        """Whether a group carries: gloo (CPU tensors; NCCL jobs push, their host cores idle),
        a ring of two nodes or more, a region within MAX_REGION_BYTES, the group's ranks the
        job's. The same answer on every rank: the extra all-reduce is issued by all or by
        none."""
        return (num_nodes >= 2 and world * SLOT_BYTES <= MAX_REGION_BYTES
                and dist.is_initialized() and dist.get_backend() == "gloo"
                and dist.get_world_size() == world and dist.get_rank() == rank)

    @staticmethod
    def held_by(rank: int, num_nodes: int, tasks_per_node: int) -> list[int]:
        """The rank whose replica `rank` holds: the same local rank on the node half the
        ring back (ring.ranks_held_by, the inverse of replica_peer_rank)."""
        node, local = divmod(rank, tasks_per_node)
        return [ranks_held_by(node, num_nodes, tasks_per_node)[local]]

    @property
    def trusted(self) -> bool:
        """Send carried copies: one step showed this rank's state stays put after the
        all-reduce, and none showed it moving."""
        return self.record.verified >= 1 and not self.record.moved

    def start(self) -> None:
        """This step's all-reduce of the region, started (average_gradients starts it before
        the gradients' chunks and finishes it after them)."""
        self._work = dist.all_reduce(self.region(), async_op=True)

    def finish(self) -> None:
        """Wait for the all-reduce `start` began, and take the held ranks' slots."""
        work, self._work = self._work, None
        if work is not None:
            work.wait()
            self.take(self._region)

    def abandon(self) -> None:
        """Let go of a started all-reduce that will not be waited for (the step failed): the
        work holds the group's gloo context, and with it this rank's connections
        (average_gradients says why that matters)."""
        self._work = None

    def region(self) -> torch.Tensor:
        """The region to all-reduce: zeros, and this rank's state now in its own slot when
        it is trusted (its state is captured either way, for the step's end to verify)."""
        step = self.step_now()
        self._region_np.fill(0)
        self.captured = None
        try:
            layout, buf = self.state.capture_into(self._scratch, ("rank",), self.rng)
        except Exception:  # noqa: BLE001 - the step's end commits the same state and raises
            # this rank must still take part in the all-reduce with an empty slot: the
            # others are already in it
            return self._region
        self._scratch = buf
        layout_json = layout.to_json()
        data = buf.numpy()[:layout.nbytes].tobytes() if layout.nbytes else b""
        blob = encode(step, layout_json, data, key=self._key, rank=self.rank) \
            if self.trusted else None
        if self.trusted and blob is None and not self._too_big:
            self._too_big = True
            self.events.emit(Ev.RANK_CARRY_TOO_BIG, rank=self.rank, step=step,
                             nbytes=len(layout_json) + len(data), slot=SLOT_BYTES)
        if blob is not None:
            lo = self.rank * SLOT_BYTES
            self._region_mv[lo:lo + len(blob)] = blob
        self.captured = (step, layout_json, data, blob is not None)
        return self._region

    def take(self, region: torch.Tensor) -> None:
        """After the all-reduce: the held ranks' slots into this rank's replicas, each as it
        came (ReplicaStore.defer): decoded and checked when the replicas are read, where a
        slot refused is an event and the holder keeps what it had. Only a slot whose head is
        not this version's is refused here. `replica.stored` thus says a slot arrived."""
        flat = self._region_mv if region is self._region else memoryview(region.numpy())
        for r in self.held:
            # only the held slots are read: the region is world x SLOT_BYTES
            slot = flat[r * SLOT_BYTES:(r + 1) * SLOT_BYTES].tobytes()
            if slot.count(0) == SLOT_BYTES:  # that rank sent nothing this step
                continue
            try:
                step, n_layout, end = _head(slot)
            except HpctError as exc:
                self._refused(r, -1, exc.message)
                continue
            self.replicas.defer(r, step, slot, self._decoders[r], self._refusals[r])
            if self._last_taken.get(r) != step - 1:
                self.events.emit(Ev.REPLICA_STORED, rank=r, step=step,
                                 nbytes=end - _HEAD.size - n_layout, via="carry")
            self._last_taken[r] = step

    def _refused(self, rank: int, step: int, why: str) -> None:
        self.events.emit(Ev.REPLICA_REJECTED, rank=rank, step=step, via="carry", error=why)

    def commit(self, step: int, store: SnapshotStore) -> tuple[Snapshot, str]:
        """This rank's own snapshot of `step`, committed into `store` at the step's end, and
        what its holder needs now (`confirm`). Where this step's capture holds no tensor bytes
        (a sampler's position is all in its layout's tree), a fresh plan of the state that
        reads the same is proof the state did not move, and the capture itself becomes the
        snapshot (SnapshotStore.put): no second capture into the store's slot, no second
        comparison (commit and confirm measured 0.17 ms a step in place on this project's
        2-core VM, this 0.13: most of either is touching what the backward and the update
        pushed out of the caches)."""
        captured = self.captured
        if captured is not None and captured[0] == step and not captured[2]:
            layout, live = self.state.plan(("rank",), self.rng)
            if not live and layout.to_json() == captured[1]:
                self.captured = None
                self.record.verified += 1
                return store.put(step, layout, b""), "carried" if captured[3] else "push"
        snap = store.commit(step)
        return snap, self.confirm(step, snap)

    def confirm(self, step: int, snap: Snapshot) -> str:
        """At the step's end, with this rank's committed snapshot of it, what its holder needs
        now: "carried" (it has exactly this step, carried in the all-reduce and unchanged
        since), "push" (nothing was carried: push as before) or "replace" (a carried copy
        is not the committed state, which moved after the all-reduce: push the commit and
        wait for it). A state seen moving is recorded for good: this rank pushes from then
        on."""
        captured, self.captured = self.captured, None
        if captured is None or captured[0] != step:
            return "push"  # no all-reduce through Job in this step
        _, layout_json, data, sent = captured
        if layout_json == snap.layout.to_json() and _same_tensors(snap.layout, data, snap.data):
            self.record.verified += 1
            return "carried" if sent else "push"
        if not self.record.moved:
            self.record.moved = True
            self.events.emit(Ev.RANK_STATE_MOVED_AFTER_REDUCE, rank=self.rank, step=step,
                             carried=sent)
        return "replace" if sent else "push"
