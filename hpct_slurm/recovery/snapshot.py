"""Double-buffered in-memory snapshots: this rank's own, and replicas of peers'.

Each store has two slots. A new snapshot (a capture, or a replica arriving over the network) is
written into the slot that is not current and becomes current only once complete (and, for a
replica, checksum-verified): a torn write never replaces the last good copy. Readers take a
lease on a slot; a writer waits for the leases on the slot it is about to overwrite, so a
transfer in flight never sends half-overwritten bytes.
"""
from __future__ import annotations

import contextlib
import threading
from dataclasses import dataclass
from typing import Iterator, Literal

import torch

from ..errors import HpctError
from .state import Layout, Scope, TrainState, as_memoryview, checksum

Mode = Literal["jit", "replicated"]


@dataclass(frozen=True)
class Snapshot:
    step: int
    layout: Layout
    data: memoryview      # exactly layout.nbytes bytes
    checksum: int

    def verify(self) -> bool:
        return checksum(self.data) == self.checksum


class DoubleBuffer:
    """Two slots of flat bytes with an atomic flip and reader leases (thread-safe)."""

    def __init__(self) -> None:
        self._bufs: list[torch.Tensor | None] = [None, None]
        self._snaps: list[Snapshot | None] = [None, None]
        self._leases = [0, 0]
        self._current = -1
        self._cond = threading.Condition()
        # One writer at a time: held from acquire_target until publish or abandon.
        self._writer = threading.Lock()

    def _target(self) -> int:
        return 0 if self._current != 0 else 1

    def acquire_target(self, nbytes: int | None = None) -> tuple[int, torch.Tensor | None]:
        """The non-current slot, invalidated and with no readers, for a writer to fill.

        The caller must end with `publish` or `abandon`.
        """
        self._writer.acquire()
        with self._cond:
            idx = self._target()
            self._cond.wait_for(lambda: self._leases[idx] == 0)
            self._snaps[idx] = None
            buf = self._bufs[idx]
            if nbytes is not None and (buf is None or buf.numel() < nbytes):
                # Allocated once per size change; never shrunk, so steady state allocates nothing.
                buf = self._bufs[idx] = torch.empty(nbytes, dtype=torch.uint8)
            return idx, buf

    def publish(self, idx: int, buf: torch.Tensor, step: int, layout: Layout, crc: int) -> Snapshot:
        snap = Snapshot(step, layout, as_memoryview(buf)[:layout.nbytes], crc)
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
        with self._cond:
            return self._snaps[self._current] if self._current >= 0 else None

    def steps(self) -> list[int]:
        with self._cond:
            return sorted(s.step for s in self._snaps if s is not None)

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
        try:
            yield snap
        finally:
            if snap is not None:
                with self._cond:
                    self._leases[idx] -= 1
                    self._cond.notify_all()

    def discard(self, snap: Snapshot) -> None:
        """Forget a snapshot found corrupt, so it is not offered again."""
        with self._cond:
            for i, s in enumerate(self._snaps):
                if s is snap:
                    self._snaps[i] = None
                    if self._current == i:
                        other = 1 - i
                        self._current = other if self._snaps[other] is not None else -1


class SnapshotStore:
    """This rank's own snapshots of `state`."""

    def __init__(self, state: TrainState, scopes: tuple[Scope, ...] = ("shared", "rank")):
        self.state = state
        self.scopes = scopes
        self.slots = DoubleBuffer()

    def commit(self, step: int) -> Snapshot:
        """Capture the state after `step` into the spare slot, checksum it, then make it current."""
        idx, buf = self.slots.acquire_target()
        try:
            layout, buf = self.state.capture_into(buf, self.scopes)
        except BaseException:
            self.slots.abandon(idx)
            raise
        data = as_memoryview(buf)[:layout.nbytes]
        return self.slots.publish(idx, buf, step, layout, checksum(data))

    def latest(self) -> Snapshot | None:
        return self.slots.latest()

    def lease(self, step: int | None = None) -> contextlib.AbstractContextManager[Snapshot | None]:
        return self.slots.lease(step)


class ReplicaStore:
    """Replicas of other ranks' snapshots, each rank double-buffered."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._ranks: dict[int, DoubleBuffer] = {}

    def _slots(self, rank: int) -> DoubleBuffer:
        with self._lock:
            return self._ranks.setdefault(rank, DoubleBuffer())

    def ranks(self) -> list[int]:
        with self._lock:
            return sorted(r for r, db in self._ranks.items() if db.latest() is not None)

    def begin(self, rank: int, nbytes: int) -> tuple[int, torch.Tensor]:
        """A writable slot of at least `nbytes` for an incoming replica of `rank`."""
        idx, buf = self._slots(rank).acquire_target(nbytes)
        assert buf is not None
        return idx, buf

    def finish(self, rank: int, idx: int, buf: torch.Tensor, step: int, layout: Layout,
               crc: int) -> Snapshot:
        """Make a received replica current, only if its bytes match `crc`."""
        got = checksum(as_memoryview(buf)[:layout.nbytes])
        if got != crc:
            self.abandon(rank, idx)
            raise HpctError(f"replica of rank {rank} at step {step}: checksum {got:#010x} does not "
                            f"match the sender's {crc:#010x}; kept the previous replica")
        return self._slots(rank).publish(idx, buf, step, layout, crc)

    def abandon(self, rank: int, idx: int) -> None:
        self._slots(rank).abandon(idx)

    def latest(self, rank: int) -> Snapshot | None:
        return self._slots(rank).latest()

    def lease(self, rank: int, step: int | None = None) -> contextlib.AbstractContextManager[Snapshot | None]:
        return self._slots(rank).lease(step)

    def discard(self, rank: int, snap: Snapshot) -> None:
        self._slots(rank).discard(snap)


# --- placement (pure) --------------------------------------------------------------------------

def replica_peer(node_index: int, num_nodes: int) -> int:
    """The node that holds replicas of `node_index`'s ranks: the next one on the ring."""
    if num_nodes < 2:
        raise HpctError(f"replicas need at least 2 nodes, got num_nodes={num_nodes}")
    if not 0 <= node_index < num_nodes:
        raise HpctError(f"node_index {node_index} is outside 0..{num_nodes - 1}")
    return (node_index + 1) % num_nodes


def replica_source_node(node_index: int, num_nodes: int) -> int:
    """The node whose ranks' replicas `node_index` holds (the previous one on the ring)."""
    replica_peer(node_index, num_nodes)
    return (node_index - 1) % num_nodes


def replica_peer_rank(rank: int, num_nodes: int, tasks_per_node: int) -> int:
    """The rank that holds `rank`'s replica: same local rank on the ring-next node."""
    node, local = divmod(rank, tasks_per_node)
    return replica_peer(node, num_nodes) * tasks_per_node + local


def ranks_held_by(node_index: int, num_nodes: int, tasks_per_node: int) -> list[int]:
    """Ranks whose replicas live on node `node_index` (one per local rank)."""
    src = replica_source_node(node_index, num_nodes)
    return [src * tasks_per_node + local for local in range(tasks_per_node)]


def choose_mode(state: TrainState, force: Mode | None = None) -> Mode:
    """`jit` when every rank holds the whole model+optimizer state (plain DDP); else `replicated`.

    In `jit` mode nothing big is copied in steady state: a replacement takes the `shared` state
    from any survivor at fault time, and only the small `rank` scope (RNG, sampler) is replicated.
    Sharded setups (FSDP, ZeRO, DTensor parameters) hold state no peer has, so they replicate.
    """
    if force is not None:
        if force not in ("jit", "replicated"):
            raise HpctError(f"recovery mode {force!r} is not 'jit' or 'replicated'")
        return force
    model, optimizer = state.get("model"), state.get("optimizer")
    if model is None or optimizer is None:
        return "replicated"
    if not isinstance(model, torch.nn.parallel.DistributedDataParallel):
        return "replicated"
    if type(optimizer).__name__ == "ZeroRedundancyOptimizer":
        return "replicated"
    if any(type(p).__name__ == "DTensor" for p in model.parameters()):
        return "replicated"
    return "jit"

