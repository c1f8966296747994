"""A plain torchrun script laid out the way torchtitan lays out the largest jobs: tensor
parallelism inside a node (`parallelize_module` with ColwiseParallel / RowwiseParallel), FSDP2
(`fully_shard`) or HSDP across nodes, and pipeline stages (`torch.distributed.pipelining`: one
`PipelineStage` per stage, a 1F1B schedule over micro-batches). `--layout` picks the mesh:
fsdp_tp (dp_shard, tp), hsdp_tp (dp_replicate, dp_shard, tp), pp_dp (pp, dp_shard) or 3d
(pp, dp_shard, tp). `adopted_3d.py` is this script adopted for hpct-slurm; docs/adoption.md
shows the diff.

    torchrun --nproc-per-node 8 -m hpct_slurm.examples.torchrun_3d --layout 3d
"""
from __future__ import annotations

import argparse
import time

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.utils.data import DataLoader, DistributedSampler

from hpct_slurm.examples.model_3d import (LAYOUTS, TokenMLP, flat_rank, mesh_shape,
                                          parallelize, schedule_for, step)
from hpct_slurm.examples.torchrun_ddp import token_data
from hpct_slurm.examples.torchrun_fsdp import save_full_result


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
    dist.init_process_group("gloo")
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
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        for x, y in loader:
            loss = step(model, schedule, x, y, opt)
            sched.step()
            time.sleep(args.step_sleep)  # stands in for a bigger model's compute time
        if dist.get_rank() == dist.get_world_size() - 1:
            print(f"epoch {epoch}: loss {loss.item():.4f} lr {sched.get_last_lr()[0]:.2e}")
    save_full_result(args.out, dist.get_rank(), model)


if __name__ == "__main__":
    main()
