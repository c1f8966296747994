"""Dataset over an attached cache, a resumable sharded sampler, and a prefetching loader.

The sampler's position (epoch, offset) is part of a rank's recovery state. The loader reads
ahead in a background thread but commits the position only when a batch is handed to the
training loop, so `state_dict()` is always the exact next sample, however deep the prefetch: a
restarted rank (or a spare taking over its rank) loads it and resumes where the old one stopped.
"""
from __future__ import annotations

import queue
import threading
from dataclasses import asdict, dataclass
from typing import Callable, Iterator, Sequence

import numpy as np
import torch

from ..errors import HpctError
from .store import CacheEntry


class CachedDataset(torch.utils.data.Dataset):
    """Rows of the cache's arrays (all sharing their first dimension), as torch tensors."""

    def __init__(self, entry: CacheEntry, fields: Sequence[str] | None = None,
                 transform: Callable[..., object] | None = None):
        self.entry = entry
        self.fields = tuple(fields or entry.arrays)
        unknown = [f for f in self.fields if f not in entry.arrays]
        if unknown:
            raise HpctError(f"cache {entry.name!r} has no array {unknown[0]!r} "
                            f"(it has {', '.join(entry.arrays)})")
        lengths = {f: entry.arrays[f].shape[0] for f in self.fields}
        if len(set(lengths.values())) != 1:
            raise HpctError(f"cache {entry.name!r} arrays differ in length: {lengths}")
        self._len = next(iter(lengths.values()))
        self.transform = transform

    def __len__(self) -> int:
        return self._len

    def __getitem__(self, i: int) -> tuple[torch.Tensor, ...]:
        return self.batch(np.asarray([i]))

    def batch(self, indices: np.ndarray) -> tuple[torch.Tensor, ...]:
        """One batch by fancy indexing: a copy out of the shared pages, so the shared mapping
        stays read-only and the tensors are the training loop's own."""
        out = tuple(torch.from_numpy(np.take(self.entry.arrays[f], indices, axis=0))
                    for f in self.fields)
        return self.transform(*out) if self.transform else out


@dataclass(frozen=True)
class SamplerState:
    epoch: int
    offset: int
    seed: int
    num_samples: int
    rank: int
    world_size: int
    shuffle: bool


class ResumableSampler(torch.utils.data.Sampler[int]):
    """This rank's shard of a per-epoch permutation, from a saved position.

    Every epoch is a permutation of range(num_samples) fixed by (seed, epoch), cut to a
    multiple of world_size and dealt round-robin, so shards are disjoint and equal in length.
    The position is `epoch` and `offset`: the next sample is `epoch_indices(epoch)[offset]`.
    `rank` is this shard (None until `assign` or a restored position sets it).
    """

    def __init__(self, num_samples: int, *, rank: int | None = 0, world_size: int = 1,
                 seed: int = 0, shuffle: bool = True):
        """`rank=None`: not known yet (a warm spare builds its sampler before it is given a
        rank); the restored position, or `assign`, sets it."""
        self.num_samples, self.seed, self.shuffle = num_samples, seed, shuffle
        self.epoch = 0
        self.offset = 0
        self.rank: int | None = None
        self.world_size = world_size
        if rank is not None:
            self.assign(rank, world_size)

    def assign(self, rank: int, world_size: int) -> None:
        """Take shard `rank` of `world_size` (a spare's, once the controller gave it a rank)."""
        if self.num_samples < 1 or world_size < 1 or not 0 <= rank < world_size:
            raise HpctError(f"sampler num_samples={self.num_samples} rank={rank} "
                            f"world_size={world_size} is not a valid shard")
        if self.num_samples < world_size:
            raise HpctError(f"sampler has {self.num_samples} samples for {world_size} ranks")
        self.rank, self.world_size = rank, world_size

    def _shard(self) -> int:
        if self.rank is None:
            raise HpctError("sampler has no rank yet: restore its state or call assign()")
        return self.rank

    def __len__(self) -> int:
        return self.num_samples // self.world_size

    def epoch_indices(self, epoch: int) -> np.ndarray:
        """This rank's shard of `epoch`: `len(self)` dataset indices (numpy int64), in order."""
        if self.shuffle:
            order = np.random.default_rng([self.seed, epoch]).permutation(self.num_samples)
        else:
            order = np.arange(self.num_samples)
        return order[:len(self) * self.world_size][self._shard()::self.world_size]

    def __iter__(self) -> Iterator[int]:
        """The rest of the current epoch, one index at a time; the position advances as each
        is taken, and the next epoch starts when this one is exhausted."""
        indices = self.epoch_indices(self.epoch)
        while self.offset < len(indices):
            i = int(indices[self.offset])
            self.offset += 1
            yield i
        self.epoch, self.offset = self.epoch + 1, 0

    def set_epoch(self, epoch: int) -> None:
        """Start `epoch` at its first sample."""
        self.epoch, self.offset = epoch, 0

    def state_dict(self) -> dict:
        return asdict(SamplerState(self.epoch, self.offset, self.seed, self.num_samples,
                                   self.rank, self.world_size, self.shuffle))

    def load_state_dict(self, state: dict) -> None:
        try:
            st = SamplerState(**state)
        except TypeError as exc:
            raise HpctError(f"sampler state {state!r} is not a SamplerState ({exc})") from None
        if self.rank is None:  # a spare taking over: the position says whose shard it was
            self.assign(st.rank, st.world_size)
        mine = (self.seed, self.num_samples, self.rank, self.world_size, self.shuffle)
        theirs = (st.seed, st.num_samples, st.rank, st.world_size, st.shuffle)
        if mine != theirs:
            raise HpctError(f"sampler state (seed, num_samples, rank, world_size, shuffle) "
                            f"{theirs} does not match this sampler's {mine}")
        if not 0 <= st.offset <= len(self) or st.epoch < 0:
            raise HpctError(f"sampler state epoch={st.epoch} offset={st.offset} is outside "
                            f"0..{len(self)}")
        self.epoch, self.offset = st.epoch, st.offset


_END = object()


class PrefetchLoader:
    """Batches of one epoch (the sampler's current one, from its position), read `prefetch`
    batches ahead in a background thread. The last short batch is kept."""

    def __init__(self, dataset: CachedDataset, sampler: ResumableSampler, batch_size: int,
                 prefetch: int = 2):
        if batch_size < 1 or prefetch < 1:
            raise HpctError(f"loader batch_size={batch_size} prefetch={prefetch} must be >= 1")
        self.dataset, self.sampler = dataset, sampler
        self.batch_size, self.prefetch = batch_size, prefetch

    def __len__(self) -> int:
        return -(-(len(self.sampler) - self.sampler.offset) // self.batch_size)

    def state_dict(self) -> dict:
        return self.sampler.state_dict()

    def load_state_dict(self, state: dict) -> None:
        self.sampler.load_state_dict(state)

    def __iter__(self) -> Iterator[tuple[torch.Tensor, ...]]:
        epoch, start = self.sampler.epoch, self.sampler.offset
        indices = self.sampler.epoch_indices(epoch)
        q: queue.Queue = queue.Queue(maxsize=self.prefetch)
        stop = threading.Event()

        def put(item: object) -> bool:
            """Enqueue unless the consumer has gone (it stops reading when it stops early)."""
            while not stop.is_set():
                try:
                    q.put(item, timeout=0.1)
                    return True
                except queue.Full:
                    continue
            return False

        def produce() -> None:
            try:
                for lo in range(start, len(indices), self.batch_size):
                    hi = min(lo + self.batch_size, len(indices))
                    if not put((hi, self.dataset.batch(indices[lo:hi]))):
                        return
                put(_END)
            except BaseException as exc:  # handed to the consumer, raised there
                put(exc)

        worker = threading.Thread(target=produce, name="hpct-prefetch", daemon=True)
        worker.start()
        try:
            while True:
                item = q.get()
                if item is _END:
                    break
                if isinstance(item, BaseException):
                    raise item
                offset, batch = item
                # Commit before yielding: once the loop holds the batch it counts as consumed.
                self.sampler.offset = offset
                yield batch
            self.sampler.epoch, self.sampler.offset = epoch + 1, 0
        finally:
            stop.set()
            worker.join()
