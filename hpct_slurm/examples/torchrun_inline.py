"""A plain torchrun DDP script with its training loop inline in `main()`, as most scripts keep
it: the model, data and schedule of `torchrun_ddp.py`. `adopted_inline.py` is this script
adopted for hpct-slurm without moving the loop; docs/adoption.md shows the diff
(tests/test_adoption.py holds it to 10 changed lines, whitespace counted).

    torchrun --nproc-per-node 2 -m hpct_slurm.examples.torchrun_inline --epochs 2
"""
from __future__ import annotations

import argparse
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler

from hpct_slurm.examples.torchrun_ddp import TinyLM, save_result, token_data


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--epochs", type=int, default=5)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--step-sleep", type=float, default=0.0, help="seconds per step")
    ap.add_argument("--out", default=".", help="where results/rank<N>.json go")
    args = ap.parse_args()
    torch.set_num_threads(1)
    torch.use_deterministic_algorithms(True)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(1234)  # every rank starts from the same weights
    model = TinyLM()
    ddp = DDP(model)
    data = token_data()
    sampler = DistributedSampler(data, num_replicas=world, rank=rank, shuffle=True, seed=0)
    loader = DataLoader(data, batch_size=args.batch, sampler=sampler)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.01)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=args.epochs * len(loader))
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        for x, y in loader:
            loss = F.cross_entropy(ddp(x).flatten(0, 1), y.flatten())
            opt.zero_grad()
            loss.backward()
            torch.nn.utils.clip_grad_norm_(ddp.parameters(), max_norm=1.0)
            opt.step()
            sched.step()
            time.sleep(args.step_sleep)  # stands in for a bigger model's compute time
        if rank == 0:
            print(f"epoch {epoch}: loss {loss.item():.4f} lr {sched.get_last_lr()[0]:.2e}")
    save_result(args.out, rank, model)


if __name__ == "__main__":
    main()
