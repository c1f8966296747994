"""A drop-in for torch's DistributedDataParallel, for a script whose loop sits in main().

    from hpct_slurm.recovery import DistributedDataParallel as DDP
    ddp = DDP(model)                      # where the script made torch's; no group needed yet

torch's DDP needs a process group when it is made, and is bound to that group for good; under
hpct-slurm the group forms in `Job(...)` (later in main()) and is formed again after every
fault. This module stands where the script keeps its DDP: each forward runs the DDP of the
current generation, which `Job` makes for the registered model with a comm hook that reduces
each parameter's gradient on its own, in a fixed order (generation.py: DDP's rebuilt buckets
would make a recovered run drift from an uninterrupted one). A second registered model (a
GAN's discriminator) gets a DDP of its own the same way. The module it wraps may be the
registered one or what torch.compile made of it (either way round): the DDP then runs the
compiled forward. Its parameters, `module`,
`train()`/`eval()` and `state_dict()` (keys prefixed `module.`) are those of torch's DDP.
"""
from __future__ import annotations

import contextlib
from typing import Any, Iterator

import torch

from ..errors import HpctError, UsageError
from .state import same_model


class DistributedDataParallel(torch.nn.Module):
    """`DistributedDataParallel(model, **torch_ddp_options)`: see the module docstring."""

    def __init__(self, module: torch.nn.Module, **options: Any) -> None:
        super().__init__()
        self.module = module
        self._options = options

    def _current(self) -> "torch.nn.parallel.DistributedDataParallel":
        from .job import Job  # job.py imports this package's modules: not at import time

        job = Job._main
        if job is None or job.rank < 0:
            raise HpctError("hpct_slurm.recovery.DistributedDataParallel runs inside "
                            "Job.main(main), after the script's Job(...) took a rank")
        if same_model(job.model, self.module):
            return job._group.ddp(wrapping=self.module, **self._options)
        if not any(same_model(job.state.get(n), self.module) for n in job.state.names()):
            # the script's mistake, the same at every run: not a fault to restart in place
            raise UsageError("DistributedDataParallel wraps a model that is not registered: "
                             "register the model it wraps (or the module torch.compile "
                             "made of it), the main one with Job(model, ...), a second one "
                             "(a discriminator) as shared state beside it: "
                             "Job(model, opt, sched, disc=disc, disc_opt=disc_opt)")
        return job._group.ddp_for(self.module, self._options)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self._current()(*args, **kwargs)

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """As torch's: gradients accumulate locally until a forward and backward outside it."""
        with self._current().no_sync():
            yield
