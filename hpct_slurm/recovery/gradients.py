"""The gradient all-reduce, written once: `Job.allreduce_gradients`, the accumulating step of an
elastic shrink, the fixed-order DDP comm hook and the baseline example all average gradients
with it.

A sum must depend only on what is summed, never on how the tensors happened to be grouped:
a group re-formed after a fault then reduces bit for bit as the old one did. gloo's (and
NCCL's) ring splits a buffer among the ranks by offset, so an element's order of summation
depends on where it sits in the buffer it is reduced in. DDP's buckets are not that: a fresh
DDP (every generation makes one) reduces its first step in its initial buckets and later steps
in buckets rebuilt from the order gradients became ready. So the gradients are reduced in a
layout of our own, the same on every rank and in every generation: in the order given
(parameter order), consecutive gradients of one dtype and device flattened together, cut at
`CHUNK_BYTES`. One all_reduce per chunk instead of one per gradient: a gloo all_reduce costs a
round of messages whatever its size, and a model's hundreds of small tensors made that the
step's largest cost (4 loopback ranks, a 28-tensor model: 130 ms a DDP step reduced per
tensor, 20.6 ms in one buffer, 22.0 ms for torch's own DDP; `hpct-slurm bench gradients`)."""
from __future__ import annotations

from typing import TYPE_CHECKING, Iterable

import torch
import torch.distributed as dist

# The most bytes flattened into one all_reduce: bounds the extra memory (a copy of the chunk)
# while keeping the count of collectives small. Part of the layout: every rank and generation
# must use the same value (a setting would let two ranks differ).
CHUNK_BYTES = 32 << 20

if TYPE_CHECKING:
    from .carry import Carry


def chunk_layout(tensors: list[torch.Tensor], chunk_bytes: int = CHUNK_BYTES
                 ) -> list[list[int]]:
    """Indices of `tensors`, in order, grouped into the chunks they are reduced in: a chunk
    holds consecutive dense tensors of one dtype and device and at most `chunk_bytes` (a larger
    tensor, or a sparse one, alone). Pure: depends on the tensors' kinds and sizes only."""
    chunks: list[list[int]] = []
    kind: tuple | None = None
    size = 0
    for i, t in enumerate(tensors):
        nbytes = t.numel() * t.element_size()
        this = (t.dtype, t.device, t.layout)
        if (kind != this or size + nbytes > chunk_bytes or t.layout != torch.strided
                or not chunks):
            chunks.append([i])
            kind, size = this, nbytes
        else:
            chunks[-1].append(i)
            size += nbytes
    return chunks


def average_gradients(grads: Iterable[torch.Tensor | None], world: int,
                      carry: Carry | None = None) -> None:
    """Sum the gradients (None ones skipped) over the process group in the fixed layout of
    `chunk_layout`, every chunk's all_reduce started before any is waited for, and divide them
    by `world` (the data-parallel world the batch was split over, which after an elastic
    shrink is not the group's size). In place.

    `carry`: every rank's own small state goes along in an all-reduce of its own, started
    first (carry.py); the gradients' buffers, and so their sums, are the same without it."""
    tensors = [g for g in grads if g is not None]
    pending: list = []
    try:
        if carry is not None:
            carry.start()
        for chunk in chunk_layout(tensors):
            members = [tensors[i] for i in chunk]
            if len(members) == 1:
                flat = members[0]
            else:
                flat = torch.cat([t.reshape(-1) for t in members])
            pending.append((dist.all_reduce(flat, async_op=True), members, flat))
        for work, members, flat in pending:
            work.wait()
            flat.div_(world)
            if len(members) > 1:  # else reduced in place
                _copy_back(flat, members)
        if carry is not None:
            carry.finish()
    except BaseException:
        # A reduction failed (a peer lost): let go of every work not waited for. Each holds
        # the group's gloo context and so this rank's connections: kept (the carry's work
        # lived on in the Carry, the chunks' in this frame under the traceback), a survivor
        # still waiting on this rank in a collective it gave up waited out the collective
        # timeout (10 s) instead of seeing the connection close at this rank's teardown
        # (measured on the cluster: one survivor in three of the fault tests).
        pending.clear()
        if carry is not None:
            carry.abandon()
        raise


def persistent_buffers(module: torch.nn.Module) -> list[torch.Tensor]:
    """`module`'s buffers that its state_dict holds (BatchNorm's running statistics and
    count; not a buffer registered with persistent=False), in state_dict order."""
    out = []
    for m in module.modules():
        for name, b in m._buffers.items():
            if b is not None and name not in m._non_persistent_buffers_set:
                out.append(b)
    return out


def share_buffers(module: torch.nn.Module) -> None:
    """Every rank takes rank 0's persistent buffers of `module`, in place: a model's buffers
    are kept as shared state (one copy restores any rank), so they must be the same on every
    rank at each step's end. BatchNorm's running statistics are not: each rank's forward
    folds its own batch into them. Called with the step's gradient reduction, after the
    forward that moved them; what torch's DDP does anyway with its default
    broadcast_buffers=True, at the next forward, so training in train mode is unchanged.
    Exact: a broadcast copies bits. In the layout of `chunk_layout`, one broadcast a chunk."""
    tensors = persistent_buffers(module)
    for chunk in chunk_layout(tensors):
        members = [tensors[i] for i in chunk]
        if len(members) == 1:
            dist.broadcast(members[0], src=0)
            continue
        flat = torch.cat([t.reshape(-1) for t in members])
        dist.broadcast(flat, src=0)
        _copy_back(flat, members)


def _copy_back(flat: torch.Tensor, members: list[torch.Tensor]) -> None:
    """`flat`'s consecutive pieces into the tensors it was concatenated from."""
    offset = 0
    for t in members:
        n = t.numel()
        t.copy_(flat[offset:offset + n].view_as(t))
        offset += n


def parameter_gradients(model: torch.nn.Module) -> list[torch.Tensor | None]:
    """`model`'s gradients in parameter order, the order every rank reduces them in."""
    return [p.grad for p in model.parameters()]
