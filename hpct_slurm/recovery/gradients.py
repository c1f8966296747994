"""The gradient all-reduce, written once: `Job.allreduce_gradients`, the accumulating step of an
elastic shrink, the fixed-order DDP comm hook and the baseline example all average gradients
with it.

Each gradient is summed with its own all_reduce, in the order given: a sum then depends only
on that tensor, never on how tensors were grouped into buckets, so a group re-formed after a
fault reduces bit for bit as the old one did (DDP's rebuilt buckets would not)."""
from __future__ import annotations

from typing import Iterable

import torch
import torch.distributed as dist


def average_gradients(grads: Iterable[torch.Tensor | None], world: int,
                      concurrent: bool = False) -> None:
    """Sum each gradient (None ones skipped) over the process group, in order, and divide it by
    `world` (the data-parallel world the batch was split over, which after an elastic shrink is
    not the group's size). `concurrent`: start every all_reduce before waiting for any."""
    tensors = [g for g in grads if g is not None]
    if concurrent:
        for work in [dist.all_reduce(g, async_op=True) for g in tensors]:
            work.wait()
    else:
        for g in tensors:
            dist.all_reduce(g)
    for g in tensors:
        g.div_(world)


def parameter_gradients(model: torch.nn.Module) -> list[torch.Tensor | None]:
    """`model`'s gradients in parameter order, the order every rank reduces them in."""
    return [p.grad for p in model.parameters()]
