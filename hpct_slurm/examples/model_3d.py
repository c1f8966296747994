"""The model and parallel plan of the 3-D examples (`torchrun_3d.py`, `adopted_3d.py`, and the
restart-all baseline's `baseline_train.three_d`), laid out the way torchtitan lays out large
jobs: a token MLP whose blocks are tensor-parallel pairs (`parallelize_module` with
ColwiseParallel / RowwiseParallel) inside a node, FSDP2 (`fully_shard`) or HSDP across nodes, and
pipeline stages (`torch.distributed.pipelining`: one `PipelineStage` per stage, a 1F1B schedule
over micro-batches) split from one whole model, as torchtitan splits it.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.distributed.fsdp import fully_shard
from torch.distributed.pipelining import PipelineStage, Schedule1F1B
from torch.distributed.tensor import Replicate
from torch.distributed.tensor.parallel import (ColwiseParallel, RowwiseParallel,
                                               parallelize_module)

from hpct_slurm.examples.torchrun_ddp import VOCAB

LAYOUTS = {"fsdp_tp": ("dp_shard", "tp"), "hsdp_tp": ("dp_replicate", "dp_shard", "tp"),
           "pp_dp": ("pp", "dp_shard"), "3d": ("pp", "dp_shard", "tp")}
TP = PP = REPLICAS = 2


class Block(torch.nn.Module):
    """An MLP block with a residual: `up` column-parallel, `down` row-parallel under TP."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.up, self.down = torch.nn.Linear(dim, 4 * dim), torch.nn.Linear(4 * dim, dim)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return h + self.down(F.gelu(self.up(h)))


class TokenMLP(torch.nn.Module):
    """Embeddings, blocks, a head. A pipeline stage keeps its own blocks (a ModuleDict keeps
    their names, as torchtitan's split does) and drops the embeddings or head it lacks."""

    def __init__(self, dim: int = 32, blocks: int = 4) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(VOCAB, dim)
        self.blocks = torch.nn.ModuleDict({str(i): Block(dim) for i in range(blocks)})
        self.head = torch.nn.Linear(dim, VOCAB)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embed(x) if self.embed is not None else x
        for block in self.blocks.values():
            h = block(h)
        return self.head(h) if self.head is not None else h

    def stage(self, index: int, stages: int) -> "TokenMLP":
        per = len(self.blocks) // stages
        for i in list(self.blocks):
            if not index * per <= int(i) < (index + 1) * per:
                del self.blocks[i]
        self.embed = self.embed if index == 0 else None
        self.head = self.head if index == stages - 1 else None
        return self


def mesh_shape(layout: str, world: int) -> tuple[int, ...]:
    names = LAYOUTS[layout]
    fixed = {"tp": TP, "pp": PP, "dp_replicate": REPLICAS}
    rest = world // max(1, int(torch.tensor([fixed.get(n, 1) for n in names]).prod()))
    return tuple(fixed.get(n, rest) for n in names)


def parallelize(model: TokenMLP, mesh, names: tuple[str, ...]) -> TokenMLP:
    """TP inside the node, then FSDP2 (HSDP with dp_replicate) over the data-parallel dims."""
    if "tp" in names:
        plan = {"embed": RowwiseParallel(input_layouts=Replicate()),
                "head": ColwiseParallel(output_layouts=Replicate())}
        for i in model.blocks:
            plan[f"blocks.{i}.up"], plan[f"blocks.{i}.down"] = ColwiseParallel(), RowwiseParallel()
        parallelize_module(model, mesh["tp"], {k: v for k, v in plan.items()
                                               if getattr(model, k.split(".")[0]) is not None})
    dp = mesh[tuple(n for n in names if n.startswith("dp"))]
    for block in model.blocks.values():
        fully_shard(block, mesh=dp, reshard_after_forward=False)
    fully_shard(model, mesh=dp, reshard_after_forward=False)
    return model


def schedule_for(stage, pp) -> Schedule1F1B:
    """This rank's pipeline stage on the `pp` sub-mesh, run by a 1F1B schedule over 2
    micro-batches, the loss the model's cross-entropy."""
    return Schedule1F1B(PipelineStage(stage, pp.get_local_rank(), pp.size(), torch.device("cpu"),
                                      group=pp.get_group()),
                        n_microbatches=2,
                        loss_fn=lambda out, y: F.cross_entropy(out.flatten(0, 1), y.flatten()))


def flat_rank(mesh) -> int:
    """This rank's index on a (sub-)mesh, its dimensions taken row-major: the data-parallel
    rank on (dp_replicate, dp_shard), whose two TP (and pipeline) peers read the same batch."""
    index = 0
    for size, c in zip(mesh.shape, mesh.get_coordinate()):
        index = index * size + c
    return index


def step(model, schedule, x, y, opt) -> torch.Tensor:
    """One training step: forward and backward (through the pipeline's schedule when there is
    one), a clip, the optimizer. The loss is the last stage's (0 on the others)."""
    opt.zero_grad()
    if schedule is None:
        loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten())
        loss.backward()
    else:
        losses: list[torch.Tensor] = []
        first, last = model.embed is not None, model.head is not None
        schedule.step(*([x] if first else []), **({"target": y, "losses": losses} if last else {}))
        loss = torch.stack(losses).mean() if last else torch.zeros(())
    # clipped stage by stage (a pipeline job's norm over all stages needs a pp all-reduce)
    torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm=1.0)
    opt.step()
    return loss
