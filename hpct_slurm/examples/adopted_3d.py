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
from torch.distributed.device_mesh import init_device_mesh
from torch.utils.data import DataLoader

from hpct_slurm.examples.model_3d import (LAYOUTS, TokenMLP, flat_rank, mesh_shape,
                                          parallelize, schedule_for, step)
from hpct_slurm.examples.torchrun_ddp import token_data
from hpct_slurm.examples.torchrun_fsdp import save_full_result
from hpct_slurm.recovery import DistributedSampler, Job


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
