"""The script's own training loop under `Job`: epochs, a DataLoader over a DistributedSampler,
one optimizer step per batch.

    def train():
        for epoch in job.epochs(n):              # from the restored epoch
            sampler.set_epoch(epoch)
            for x, y in job.steps(loader):       # from the restored batch; one step per batch
                ...                              # forward, backward, clip, opt.step(), sched.step()
    job.run(train)                               # called again after every restore

`Job.run(train)` calls the loop function, and calls it again after each restore; `epochs` and
`steps` then start where the restored step left off. The step boundary is the moment the loop
asks for its next batch (or leaves the epoch): the step before it is complete then, optimizer
and scheduler included, so that is where the snapshot is taken, and where a stop requested by
the controller is honoured.

The loop position (the epoch, and the batches of it done) is the same on every rank under data
parallelism, so it is `shared` state, like the model: a survivor restores it from its own
snapshot, a replacement pulls it from a survivor with the model. Nothing is pushed to a ring
neighbour for it and no step is recomputed for it; each rank's shard follows from its rank.
"""
from __future__ import annotations

import itertools
import math
import time
from typing import Callable, Iterable, Iterator, TypeVar

import torch

from .. import config as C
from ..errors import HpctError

WORLD_SIZE_ENV = C.WORLD_SIZE  # the job's data-parallel world size, set by the controller

T = TypeVar("T")


class LoopPosition:
    """Where the script's loop stands: the epoch, and the batches of it done."""

    def __init__(self) -> None:
        self.epoch = 0
        self.batch = 0

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "batch": self.batch}

    def load_state_dict(self, state: dict) -> None:
        self.epoch, self.batch = int(state["epoch"]), int(state["batch"])


class DistributedSampler(torch.utils.data.DistributedSampler):
    """torch's DistributedSampler (the same arguments, the same indices in the same order) for
    a script whose ranks are assigned only once it has built its data pipeline.

    `num_replicas` defaults to the job's world size, which `hpct-slurm controller` exports to
    every process it starts, warm spares included ($HPCT_WORLD_SIZE): `len(sampler)` and
    `len(loader)` — a scheduler's `T_max` — work before `job.run`. `rank` is filled in by
    `job.steps(loader)` for the loader whose `sampler` this is, which also starts it mid-epoch
    after a restore (`start`: samples of this shard to skip in the current epoch)."""

    def __init__(self, dataset: torch.utils.data.Dataset, num_replicas: int | None = None,
                 rank: int | None = None, shuffle: bool = True, seed: int = 0,
                 drop_last: bool = False) -> None:
        # Not torch's __init__: it asks the default process group, which does not exist yet.
        self.dataset = dataset
        self.shuffle, self.seed, self.drop_last = shuffle, seed, drop_last
        self.epoch = 0
        self.start = 0
        self.num_replicas: int | None = None  # type: ignore[assignment]
        self.rank: int | None = None  # type: ignore[assignment]
        # (rank, num_replicas) as the script gave them: on a device mesh the data-parallel
        # coordinate, which only the script knows (its TP and pipeline peers share a batch)
        self.given: tuple[int, int] | None = None
        if num_replicas is None:
            num_replicas = _world_size_from_env()
        if num_replicas is not None:
            self._size(num_replicas)
        if rank is not None:
            if num_replicas is None:
                raise HpctError("DistributedSampler: rank given without num_replicas, and "
                                f"${WORLD_SIZE_ENV} is not set")
            self.assign(rank, num_replicas)
            self.given = (rank, num_replicas)

    def assign(self, rank: int, num_replicas: int) -> None:
        """Take shard `rank` of `num_replicas` (`job.steps` calls it with the job's)."""
        if self.num_replicas is not None and num_replicas != self.num_replicas:
            raise HpctError(f"DistributedSampler was built for {self.num_replicas} replicas but "
                            f"the job trains {num_replicas} data shards")
        if not 0 <= rank < num_replicas:
            raise HpctError(f"DistributedSampler: rank {rank} is outside 0..{num_replicas - 1}")
        self._size(num_replicas)
        self.rank = rank

    def _size(self, num_replicas: int) -> None:
        if num_replicas < 1:
            raise HpctError(f"DistributedSampler: num_replicas={num_replicas} must be >= 1")
        n = len(self.dataset)  # type: ignore[arg-type]
        self.num_replicas = num_replicas
        # torch's arithmetic, so shards and their lengths are exactly torch's
        if self.drop_last and n % num_replicas != 0:
            self.num_samples = math.ceil((n - num_replicas) / num_replicas)
        else:
            self.num_samples = math.ceil(n / num_replicas)
        self.total_size = self.num_samples * num_replicas

    def set_epoch(self, epoch: int) -> None:
        """As torch's: the shuffle of `epoch`; the epoch starts at its first sample."""
        self.epoch, self.start = epoch, 0

    def __len__(self) -> int:
        if self.num_replicas is None:
            raise HpctError(f"DistributedSampler: the world size is not known: ${WORLD_SIZE_ENV} "
                            f"is set by `hpct-slurm controller` for the processes it starts; "
                            f"elsewhere pass num_replicas")
        return self.num_samples

    def __iter__(self) -> Iterator[int]:
        if self.rank is None:
            raise HpctError("DistributedSampler has no rank yet: iterate its loader through "
                            "job.steps(loader) (it assigns the loader's `sampler`), or pass rank=")
        return itertools.islice(super().__iter__(), self.start, None)


def _world_size_from_env() -> int | None:
    return C.read(None, C.WORLD_SIZE)


class StepLoop:
    """The step boundaries of a loop the script writes itself (see the module docstring).

    `seed(step)` seeds a step's randomness before its batch is fetched; `check()` raises when
    the controller asked this rank to stop, before a batch is handed out; `end(step)` takes
    the snapshot and reports, once the step is complete and the position is past it.
    `shard(given)` is this process's (data rank, data world); `given`: a sampler's own.

    A step ends when the loop asks for its next batch. The last step of an epoch ends only
    when the loop asks for the next epoch, so what the script does after an epoch's batches
    (a per-epoch scheduler step, an evaluation) belongs to that step: a restore never lands
    between it and the epoch's last batch, and never repeats or skips it."""

    def __init__(self, seed: Callable[[int], None], check: Callable[[], None],
                 end: Callable[[int], None],
                 shard: Callable[[tuple[int, int] | None], tuple[int, int]],
                 fetched: Callable[[float], None] = lambda seconds: None) -> None:
        self.position = LoopPosition()
        self.step = 0               # the step in progress, or the next one
        self._seed, self._check, self._end, self._shard = seed, check, end, shard
        # how long each batch took to come: the rank's own time (own_time.py), though it
        # falls after the step's collectives
        self._fetched = fetched
        self._pending: int | None = None   # a step whose batch is out and not yet ended
        self._pass_open = False            # job.steps already ran in this epoch

    def enter(self, restore_step: int) -> None:
        """Continue right after `restore_step` (-1: the start); the position was restored
        with it. A step left pending by the fault that brought us here is dropped."""
        self.step = restore_step + 1
        self._pending = None
        self._pass_open = False

    def finish(self) -> None:
        """End the step whose batch went out last, if the loop left without asking for
        another batch or epoch (`break`, `return`, or a single pass without `epochs`)."""
        if self._pending is not None:
            self.position.batch += 1
            self._end_pending()

    def _end_pending(self) -> None:
        step, self._pending = self._pending, None
        assert step is not None
        self.step = step + 1
        self._end(step)

    def epochs(self, n: int) -> Iterator[int]:
        """The epochs still to run of `n`: from the restored one (0 on a fresh start)."""
        while self.position.epoch < n:
            self._pass_open = False
            # The code at the top of an epoch (before its first batch) runs seeded as the
            # epoch's first step: after a restore at an epoch's start it then draws what it
            # drew the first time (snapshots hold no RNG states: Job reseeds instead).
            self._seed(self.step)
            yield self.position.epoch
            self.position.epoch, self.position.batch = self.position.epoch + 1, 0
            if self._pending is not None:
                self._end_pending()  # the epoch's last step, with the code after its batches

    def steps(self, loader: Iterable[T]) -> Iterator[T]:
        """The batches of `loader` still to run in this epoch, one optimizer step each."""
        if self._pass_open:
            raise HpctError("job.steps(loader) runs once per epoch of job.epochs(n): the "
                            "position it resumes from is counted per epoch")
        self._pass_open = True
        skip = self.position.batch
        sampler, batch_size = getattr(loader, "sampler", None), getattr(loader, "batch_size", None)
        if isinstance(sampler, DistributedSampler):
            sampler.assign(*self._shard(sampler.given))
            if batch_size:  # batches are consecutive runs of batch_size indices: skip them
                sampler.start, skip = skip * batch_size, 0
        batches = iter(loader)
        # Any other loader: fetch the batches already done again, and drop them.
        if skip and next(itertools.islice(batches, skip - 1, None), _END) is _END:
            return
        while True:
            self._seed(self.step if self._pending is None else self._pending + 1)
            t0 = time.monotonic()
            try:
                batch = next(batches)
            except StopIteration:
                return  # the last step stays pending: see the class docstring
            self._fetched(time.monotonic() - t0)
            if self._pending is not None:
                self.position.batch += 1
                self._end_pending()
            self._check()
            self._pending = self.step
            yield batch


_END = object()
