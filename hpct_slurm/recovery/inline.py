"""The inline form: a script whose loop sits in its own `main()`, run by `Job.main(main)`.

`InlineForm` is a piece of `Job` (job.py): `Job.main` runs the script's main() and runs it again
after every fault; the `Job(...)` it makes takes the rank at once (a warm spare waits there), and
after a fault it is the same object again, the state just built registered in place of the last
run's (`_rebind`) and restored (`register`, for a sharded job whose model is built on the
script's own mesh).
"""
from __future__ import annotations

import time
from typing import Any, Callable, TypeVar

import torch

from .. import protocol as P
from ..errors import HpctError, UsageError
from ..events import Ev
from .rank_round import _FAULTS, SCRIPT_ERRORS, _describe, _where

T = TypeVar("T")
SHARED_NAMES = ("model", "optimizer", "lr_scheduler")  # what Job(...) takes positionally
LOOP_NAME = "hpct_loop"  # the loop position's registered name: Job's own, never the script's


class InlineForm:
    """The inline form of `Job` (a piece of Job, job.py)."""

    # The Job that `Job.main` runs the script's main around (one per process), and whether
    # Job.main is running now: a Job made then is the inline form's.
    _main: Any = None
    _in_main = False
    # What it uses of the Job: its state, _group, client, loop, events, _registered, _formed,
    # _next, _rerun, seed, rank and generation; _start, _adopt, _restore_adopted, _goodbye,
    # _done and _recover (rank_round.py).

    def __new__(cls, *args: Any, **kwargs: Any) -> Any:
        current = InlineForm._main
        if current is not None and current._rerun:
            return current  # main() running again after a fault: __init__ rebinds its state
        return super().__new__(cls)

    def _take_main(self) -> None:
        """A Job made inside Job.main: the one this process's main() runs around."""
        if InlineForm._main is not None:
            raise HpctError("Job.main runs one Job per process; this main() made a second")
        InlineForm._main = self
        self._enter_inline()

    def register(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                 lr_scheduler: Any = None, **extra_state: Any) -> None:
        """The inline form of a sharded job: `Job(seed=...)` inside Job.main takes the rank
        and forms the group where the script formed its own; the script makes its mesh and
        builds its model on it (fully_shard) as before, with its optimizer and scheduler,
        and registers them here, which restores their state (after a fault: the restored
        step's). The mesh and the replicated dimensions are read from the parameters
        (DTensors); a model without any is plain data parallelism. `extra_state`: more
        objects to register and restore with them, as Job(...)'s keyword arguments (an EMA,
        a second model and its optimizer)."""
        if not self._group.late or self._formed is None:
            raise HpctError("job.register(model, optimizer[, lr_scheduler]) is for a Job "
                            "made inside Job.main without a model, once per run of main(), "
                            "after Job(...)")
        given = {"model": True, "optimizer": True, "lr_scheduler": lr_scheduler is not None}
        if self._registered_once and given != {n: self._registered[n] for n in SHARED_NAMES}:
            raise HpctError("main() registered other state when it ran again after a fault: "
                            "it must register the same objects each run")
        self._registered.update(given)
        self._registered_once = True
        self.state.register(**extra_state)
        self._group.adopt_built(model, optimizer, lr_scheduler)
        formed, self._formed = self._formed, None
        self._restore_adopted(*formed)
        self.loop.enter(formed[0].restore_step)
        self.client.state = "running"

    @staticmethod
    def main(fn: Callable[[], T]) -> T | None:
        """Run the script's `main()`, whose loop sits inline (over `job.epochs(n)` and
        `job.steps(loader)`), and run it again after every fault: `Job.main(main)` in place
        of `main()`. What main() returns is returned (None where this process left without
        finishing: a spare that was never needed leaves from its `Job(...)` with exit 0).

        The `Job(...)` main() makes takes this process's rank at once: a warm spare waits
        there until it replaces a lost rank, and every process forms the group there. After
        a fault the survivors run main() again from its top: what it builds before `Job(...)`
        (the model, optimizer, data) is built again, `Job(...)` is this same Job, the new
        objects are registered in place of the last run's, the group re-forms and the state
        is restored into them; the loop then continues right after the restored step. So
        keep what main() does before `Job(...)` cheap and free of collectives: it runs again
        on every survivor in every recovery (`job.run(train)` re-enters a loop function
        instead, and keeps the objects: no rebuild). Code after the loop runs once the last
        step is done, with the group still formed (a final hash, a save); it runs again if a
        fault comes before every rank is done."""
        if InlineForm._in_main:
            raise HpctError("Job.main is already running: call it once, around the script's main")
        InlineForm._in_main = True
        try:
            while True:
                failure = where = ""
                try:
                    result = fn()
                    if InlineForm._main is not None:
                        InlineForm._main._end_inline()
                except UsageError as exc:
                    InlineForm._tell_script_failed(exc)
                    raise  # the script's mistake: running main() again would make it again
                except _FAULTS as exc:
                    job = InlineForm._main
                    if job is None or job.rank < 0:
                        raise  # no rank held yet: nothing to recover, the error is the script's
                    failure, where = _describe(exc), _where(exc)
                except SCRIPT_ERRORS as exc:
                    InlineForm._tell_script_failed(exc)
                    raise
                job = InlineForm._main
                if not failure:
                    if job is None or not job._finish_inline():
                        return result
                    continue  # a recovery after this rank finished: main() runs again
                # Outside the except block: the traceback (and the failed group) is gone.
                assert job is not None
                job._recover(failure, where)
                job._release()
        except _Left:
            return None  # left from Job(...): a spare never needed, or the job ended
        finally:
            InlineForm._in_main = False
            InlineForm._main = None

    @staticmethod
    def _tell_script_failed(exc: BaseException) -> None:
        job = InlineForm._main
        if job is not None:
            job._script_failed(exc)

    def _enter_inline(self) -> None:
        """Job(...) inside Job.main: register with the controller (once), wait for this
        process's next assignment, form the group and restore (or leave: SystemExit(0))."""
        self._start()
        msg, self._next = self._next or self.client.next_assignment(), None
        if isinstance(msg, P.Goodbye):
            self._goodbye(msg)
            raise _Left(0)
        self._trained = True
        self._adopt(msg)
        if self._formed is None:  # else job.register(...) restores (a sharded job)
            self.loop.enter(msg.restore_step)
            self.client.state = "running"

    def _end_inline(self) -> None:
        """main() returned: its last step ends (if the loop left without asking for more) and
        is checked, where a fault is still one: a disagreement of the replicas there rolls
        back, and main() runs again, its code after the loop too."""
        self.loop.finish()
        self._policy.check_last(self.loop.step - 1)

    def _finish_inline(self) -> bool:
        """main() returned and its last step was checked: this rank is done. True when main()
        must run again: the controller started another generation (a rank lost before every
        rank was done)."""
        self._done(self.loop.step - 1)
        msg = self.client.next_assignment()
        if isinstance(msg, P.Goodbye):
            self._goodbye(msg)
            return False
        self._next = msg
        self._release()
        return True

    def _release(self) -> None:
        """Let go of what this run of main() registered (the snapshots hold its state):
        main() runs again and builds its objects anew, and `Job(...)` rebinds them."""
        # Everything the script registered, however (Job's keywords, job.state.register after
        # Job(...)): the next run registers its new objects, and the restore reaches those.
        # An old object left registered would take the restore in place of the new one.
        self.state.unregister(*(n for n in self.state.names() if n != LOOP_NAME))
        self._group.forget_model()
        self.snapshots.forget_live()  # settled: _recover and _done waited for the last copy
        self._rerun = True
        self._released_at = time.time()

    def _rebind(self, model: Any, optimizer: Any, lr_scheduler: Any, extra: dict[str, Any],
                seed: int, build: Callable[[Any], Any] | None) -> None:
        """main()'s next run registers its new objects in place of the last run's."""
        self._rerun = False
        self.events.emit(Ev.RANK_MAIN_AGAIN, rank=self.rank, generation=self.generation,
                         rebuild_s=time.time() - self._released_at)
        given = {"model": model is not None, "optimizer": optimizer is not None,
                 "lr_scheduler": lr_scheduler is not None, **{n: True for n in extra}}
        if self._group.late:  # its model comes with job.register, which checks it
            given.update({n: v for n, v in self._registered.items() if n in SHARED_NAMES})
        if seed != self.seed or {n for n, v in given.items() if v} != \
                {n for n, v in self._registered.items() if v}:
            raise HpctError("main() made its Job with other state or another seed when it ran "
                            "again after a fault: it must register the same objects each run")
        self.state.register(**extra)
        self._group.bind(model, optimizer, lr_scheduler)
        if build is not None:
            self._group.rebuild_with(build)


class _Left(SystemExit):
    """This process leaves from its Job(...) inside Job.main (a spare that was never needed,
    a job that ended or escalated while it waited): Job.main returns None, and a script
    that calls its main() without Job.main exits 0 here."""


