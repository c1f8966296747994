"""A sharded job's layout checked before its first step, never found wrong at a fault.

Two things can make a layout unrecoverable, and both are visible as soon as the model is
built: a parameter whose placement a snapshot cannot hold (`placement_code` names what is
supported), and ranks of one shard key (which must hold the same state, layout_rules.py) that
hold state of different structures — in practice a pipeline-stage dimension taken for a
replica. The first is checked on every rank from its own parameters; the second needs every
rank's view, so it is one all-gather of a short digest over the world group, run at the job's
first formation only (every rank of generation 0 runs it, so the collective matches).
"""
from __future__ import annotations

import hashlib
from typing import Any

import torch

from ..errors import UsageError
from .encoding import is_dtensor
from .layout_rules import MeshSpec, disagreeing, placement_code


def check_placements(model: torch.nn.Module) -> None:
    """Every DTensor parameter's placements are ones a snapshot holds: a UsageError naming
    the first that is not (before the first step; a snapshot would refuse it at the fault)."""
    for name, p in model.named_parameters():
        if is_dtensor(p):
            try:
                for placement in p.placements:
                    placement_code(placement, f"model.{name}")
            except Exception as exc:  # noqa: BLE001 - the placement's own error, re-said
                raise UsageError(f"this job's layout cannot be recovered: {exc}") from None


def structure(model: torch.nn.Module) -> tuple[str, str]:
    """A digest of the model's parameters' names, global shapes, dtypes and placements, and a
    short description of its first one (for a message)."""
    h = hashlib.blake2b(digest_size=16)
    first = ""
    for name, p in model.named_parameters():
        place = ",".join(placement_code(x, name) for x in p.placements) \
            if is_dtensor(p) else "local"
        line = f"{name}:{tuple(p.shape)}:{p.dtype}:{place}"
        first = first or line
        h.update(line.encode() + b"\n")
    return h.hexdigest(), first or "no parameters"


def check_replicas_agree(spec: MeshSpec, model: torch.nn.Module, group: Any = None) -> None:
    """Ranks of one shard key hold state of one structure (a collective over `group`, the
    world group by default): a UsageError on every rank alike where they do not."""
    import torch.distributed as dist

    digests: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(digests, structure(model), group=group)
    wrong = disagreeing(spec, [tuple(d) for d in digests])
    if wrong is not None:
        raise UsageError(f"this job's layout cannot be recovered: {wrong}")
