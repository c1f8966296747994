"""`torchrun_3d.py` adopted for hpct-slurm: its loop stays inline in `main()`, its mesh, TP
plan, `fully_shard` calls, pipeline stage and schedule are its own. `Job` takes the rank and
forms the group where the script formed its own and is told which mesh dimension is a pipeline
stage; after a fault the survivors run `main()` again (rebuilding the stage and schedule on the
new group) and continue right after the restored step, bit-identical to a run without a fault.
docs/adoption.md shows the diff.

    hpct-slurm template train > job.sbatch        # 4 active nodes of 2 ranks + 1 warm spare
    HPCT_TASKS_PER_NODE=2 sbatch --nodes=5 --ntasks-per-node=2 job.sbatch \
        python -m hpct_slurm.examples.adopted_3d --layout 3d
"""
from __future__ import annotations

import argparse
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.pipelining import PipelineStage, Schedule1F1B
from torch.distributed.tensor import Replicate
from torch.distributed.tensor.parallel import (ColwiseParallel, RowwiseParallel,
                                               parallelize_module)
from torch.utils.data import DataLoader

from hpct_slurm.examples.torchrun_ddp import VOCAB, token_data
from hpct_slurm.examples.torchrun_fsdp import save_full_result
from hpct_slurm.recovery import DistributedSampler, Job

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


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--layout", choices=sorted(LAYOUTS), default="3d")
    ap.add_argument("--epochs", type=int, default=2)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--step-sleep", type=float, default=0.0, help="seconds per step")
    ap.add_argument("--out", default=".", help="where results/rank<N>.json go")
    args = ap.parse_args()
    torch.set_num_threads(1)
    torch.use_deterministic_algorithms(True)
    job = Job(seed=0, stages=("pp",))  # takes the rank, forms the group; "pp" holds stages
    names = LAYOUTS[args.layout]
    mesh = init_device_mesh("cpu", mesh_shape(args.layout, dist.get_world_size()),
                            mesh_dim_names=names)
    dp = mesh[tuple(n for n in names if n.startswith("dp"))]
    torch.manual_seed(1234)  # every rank builds the same whole model, then keeps its stage
    model = TokenMLP()
    schedule = None
    if "pp" in names:
        pp = mesh["pp"]
        model = model.stage(pp.get_local_rank(), pp.size())
    model = parallelize(model, mesh, names)
    if "pp" in names:
        schedule = schedule_for(model, pp)
    data = token_data()
    sampler = DistributedSampler(data, num_replicas=dp.size(), rank=flat_rank(dp),
                                 shuffle=True, seed=0)
    loader = DataLoader(data, batch_size=args.batch, sampler=sampler)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.01)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=args.epochs * len(loader))
    job.register(model, opt, sched)  # restores their state
    for epoch in job.epochs(args.epochs):
        sampler.set_epoch(epoch)
        for x, y in job.steps(loader):
            loss = step(model, schedule, x, y, opt)
            sched.step()
            time.sleep(args.step_sleep)  # stands in for a bigger model's compute time
        if dist.get_rank() == dist.get_world_size() - 1:
            print(f"epoch {epoch}: loss {loss.item():.4f} lr {sched.get_last_lr()[0]:.2e}")
    save_full_result(args.out, dist.get_rank(), model)


if __name__ == "__main__":
    Job.main(main)  # main() runs again after a fault
