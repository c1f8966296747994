"""What surrounds each training step on this rank.

`Stepping` is a piece of `Job` (job.py). Before a step: the controller's stop honoured and its
randomness seeded from (seed, data shard, step). After it: its loss recorded, its snapshot held
as the snapshot policy says, the controller told. `Job.run` drives steps in one of three forms
(a loop function, a whole step, or micro-steps over every data shard this rank owns), and a
rank that took over a lost one reads back the losses its predecessors recorded (`losses`).
"""
from __future__ import annotations

from typing import Any, Callable

from ..errors import HpctError
from ..events import Ev
from .background import Background
from .generation import _Stopped
from .losses import recorded_losses
from .rank_round import LOST
from .seeds import seed_everything, step_seed


class Stepping:
    """The frame of each training step (a piece of Job, job.py)."""

    # What it uses of the Job: loop, client, events, seed, rank, generation, data_ranks,
    # data_world, run_dir, optimizer, _losses, _backfill, _policy, _integrity, _group and
    # allreduce_gradients.

    @property
    def losses(self) -> dict[int, float]:
        """Step -> the loss recorded for it on this rank: by this process, and, for a process
        that took over a lost rank, by the processes that held the rank before (losses.py)."""
        backfill, self._backfill = self._backfill, None
        if backfill is not None:
            error = backfill.wait(60.0)
            if error is not None:  # a record only: the training is not affected
                self.events.emit(Ev.RANK_LOSSES_UNREAD, rank=self.rank, error=str(error))
        return self._losses

    def _read_back_losses(self, rank: int, upto: int) -> None:
        """A newcomer at `rank`: the losses its predecessors recorded up to the restored step,
        read from the run's events on a thread of its own (off the recovery's path)."""
        def read() -> None:
            for step, loss in recorded_losses(self.run_dir / "events", rank, upto).items():
                self._losses.setdefault(step, loss)
        self._backfill = Background("hpct-losses", read)

    def _run_loop(self, train: Callable[[], Any], start: int) -> int:
        """The script's loop function, continuing at step `start`; the last step it ran."""
        self.loop.enter(start - 1)
        self.client.state = "running"
        train()
        self.loop.finish()  # the last step, if the loop left without asking for more
        return self.loop.step - 1

    def _train(self, step_fn: Callable[[int], Any], start: int, total: int) -> None:
        self.client.state = "running"
        for step in range(start, total):
            self._check_stop()
            self.loop.step = step
            self._end_step(step, step_fn(step))

    def _check_stop(self) -> None:
        """Leave at this step boundary if the controller asked, or is gone."""
        self._integrity.before_step()
        if self.client.stop_event.is_set():
            raise _Stopped(self.client.stop_reason)
        if self.client.closed.is_set():
            raise _Stopped(LOST)

    def _seed_step(self, step: int) -> None:
        self._integrity.before_step()
        seed_everything(step_seed(self.seed, self._shard()[0], step))

    def _end_step(self, step: int, out: Any = None) -> None:
        """After a step: its snapshot when one is due, the report to the controller."""
        self._updating = False  # the next step's forward and backward may be abandoned again
        self._group.first_step_done()
        if isinstance(out, (int, float)):
            self._losses[step] = float(out)
        self._policy.end_step(step)
        self.client.step_done(step, len(self.data_ranks))
        self.events.emit(Ev.RANK_STEP, rank=self.rank, generation=self.generation,
                         step=step, loss=self._losses.get(step), data_ranks=self.data_ranks)
        self._integrity.after_step(step)

    def _shard(self, given: tuple[int, int] | None = None) -> tuple[int, int]:
        """This rank's data shard and the number of shards, for scripts that train one.
        `given`: the script's own for its sampler, which a job on a device mesh keeps: its
        data-parallel rank is a coordinate of the mesh (TP and pipeline peers read the same
        batch), and a mesh job never shrinks."""
        if given is not None and self.mesh_spec is not None:
            return given
        if len(self.data_ranks) != 1:
            raise HpctError("the group shrank but this script trains one data shard per rank: "
                            "pass micro_step to Job.run to allow shrinking")
        return self.data_ranks[0], self.data_world

    def _single_shard_step(self, train_step: Callable[[int], Any]) -> Callable[[int], Any]:
        def step_fn(step: int) -> Any:
            self._seed_step(step)
            return train_step(step)
        return step_fn

    def _accumulating_step(self, micro_step: Callable[[int], Any]) -> Callable[[int], Any]:
        def step_fn(step: int) -> Any:
            self.optimizer.zero_grad()
            outs = []
            for shard in self.data_ranks:
                seed_everything(step_seed(self.seed, shard, step))
                outs.append(micro_step(step))
            # sum over every shard of the original world, then average by that world: the
            # same global batch and the same update size however many ranks remain
            self.allreduce_gradients()
            self.optimizer.step()
            return outs[0]
        return step_fn
