"""`adopted_inline.py` as `hpct-slurm bench peers` runs it: the same lines, plus the bench's
step record right after the optimizer step (lines ending in `# bench`), the point where every
peer's script records its step too (issue 44). tests/test_bench_peers.py checks that the rest
is adopted_inline.py's code line for line.

    sbatch --nodes=5 job.sbatch python -m hpct_slurm.examples.peers.hpct_inline --epochs 5
"""
from __future__ import annotations

import argparse
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.utils.data import DataLoader

from hpct_slurm.bench.steplog import log_step  # bench
from hpct_slurm.examples.torchrun_ddp import TinyLM, save_result, token_data
from hpct_slurm.recovery import DistributedDataParallel as DDP, DistributedSampler, Job


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--epochs", type=int, default=5)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--step-sleep", type=float, default=0.0, help="seconds per step")
    ap.add_argument("--out", default=".", help="where results/rank<N>.json go")
    args = ap.parse_args()
    torch.set_num_threads(1)
    torch.use_deterministic_algorithms(True)
    job = Job(seed=0)  # takes the rank (a spare waits here) and forms the group
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(1234)  # every rank starts from the same weights
    model = TinyLM()
    ddp = DDP(model)
    data = token_data()
    sampler = DistributedSampler(data, num_replicas=world, rank=rank, shuffle=True, seed=0)
    loader = DataLoader(data, batch_size=args.batch, sampler=sampler)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.01)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=args.epochs * len(loader))
    job.register(model, opt, sched)  # restores their state
    for epoch in job.epochs(args.epochs):
        sampler.set_epoch(epoch)
        for x, y in job.steps(loader):
            loss = F.cross_entropy(ddp(x).flatten(0, 1), y.flatten())
            opt.zero_grad()
            loss.backward()
            torch.nn.utils.clip_grad_norm_(ddp.parameters(), max_norm=1.0)
            opt.step()
            log_step(rank, job.step, loss.item(), world, generation=job.generation)  # bench
            sched.step()
            time.sleep(args.step_sleep)  # stands in for a bigger model's compute time
        if rank == 0:
            print(f"epoch {epoch}: loss {loss.item():.4f} lr {sched.get_last_lr()[0]:.2e}")
    save_result(args.out, rank, model)


if __name__ == "__main__":
    Job.main(main)  # main() runs again after a fault
