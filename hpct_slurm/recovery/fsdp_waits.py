"""A sharded (FSDP2) job's waits on its peers, for its own time per step (own_time.py, issue 47).

FSDP2 runs its all-gathers and reduce-scatters itself, inside its hooks, where hpct-slurm's
collective marker (generation._collective) never was: every rank's own time was its whole step,
and no slow node could be told apart. FSDP2's public `set_custom_all_gather` and
`set_custom_reduce_scatter` take the collectives' callables: each FSDP module whose callables
are still FSDP's own defaults gets the same defaults (subclasses: FSDP's checks of its default
comms still pass) run inside the marker. So a rank's wait in them is subtracted from its own
time, and a rank stuck in one reads "collective" (waiting on someone else) to the controller's
no-progress check, as under DDP.

Only a collective FSDP runs synchronously on the host is timed here (gloo on CPU: every
one). One it issues asynchronously (on a GPU, on its own stream) is waited for elsewhere, by a
stream: it is left as it is. A module with the script's own comm, or with several parameter
groups (a per-parameter mesh: FSDP refuses a custom comm there), keeps what it has.
"""
from __future__ import annotations

import contextlib
from typing import Any, Callable

ContextFactory = Callable[[], "contextlib.AbstractContextManager[Any]"]


def time_fsdp_waits(model: Any, waiting: ContextFactory) -> int:
    """Install the timed collectives on `model`'s FSDP modules; how many modules got them."""
    try:
        from torch.distributed.fsdp import FSDPModule
        from torch.distributed.fsdp._fully_shard._fsdp_collectives import (
            DefaultAllGather, DefaultReduceScatter)
    except ImportError:  # a torch without FSDP2's comm classes: nothing is timed
        return 0

    class TimedAllGather(DefaultAllGather):
        def __call__(self, output_tensor, input_tensor, group, async_op: bool = False):
            if async_op:
                return super().__call__(output_tensor, input_tensor, group, async_op)
            with waiting():
                return super().__call__(output_tensor, input_tensor, group, async_op)

    class TimedReduceScatter(DefaultReduceScatter):
        def __call__(self, output_tensor, input_tensor, group, op, async_op: bool = False):
            if async_op:
                return super().__call__(output_tensor, input_tensor, group, op, async_op)
            with waiting():
                return super().__call__(output_tensor, input_tensor, group, op, async_op)

    timed = 0
    for m in model.modules():
        if not isinstance(m, FSDPModule):
            continue
        groups = getattr(m._get_fsdp_state(), "_fsdp_param_groups", [])
        if len(groups) != 1:
            continue
        g = groups[0]
        if type(g._all_gather_comm) is DefaultAllGather:
            m.set_custom_all_gather(TimedAllGather())
        if type(g._reduce_scatter_comm) is DefaultReduceScatter:
            m.set_custom_reduce_scatter(TimedReduceScatter())
        timed += 1
    return timed
