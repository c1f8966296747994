"""`torchrun_fsdp.py` adopted for hpct-slurm: its loop stays inline in `main()`. `Job` takes
the rank and forms the group where the script formed its own; the script makes its mesh and
builds its sharded model on it as before, and registers it (`job.register`); after a fault
the survivors run `main()` again and continue right after the restored step, bit-identical
to a run without a fault. docs/adoption.md shows the diff.

    hpct-slurm template train > job.sbatch        # 4 active nodes + 1 warm spare
    sbatch --nodes=5 job.sbatch python -m hpct_slurm.examples.adopted_fsdp --parallel hsdp
"""
from __future__ import annotations

import argparse
import hashlib
import json
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.utils.data import DataLoader

from hpct_slurm.examples.torchrun_ddp import TinyLM, token_data
from hpct_slurm.recovery import DistributedSampler, Job



def mesh_layout(parallel: str, world: int) -> tuple[tuple[int, ...], tuple[str, ...]]:
    """FSDP: one dimension over every rank; HSDP: 2 replicas, each sharded over half."""
    return ((world,), ("shard",)) if parallel == "fsdp" else ((2, world // 2),
                                                              ("replicate", "shard"))


def save_full_result(out: str, rank: int, model: torch.nn.Module) -> None:
    """results/rank<N>.json: a hash of the whole model's parameters, gathered from the shards."""
    digest = hashlib.sha256()
    for p in model.parameters():
        digest.update(p.full_tensor().detach().numpy().tobytes())
    path = Path(out) / "results" / f"rank{rank}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"rank": rank, "params_sha256": digest.hexdigest()}))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--parallel", choices=("fsdp", "hsdp"), default="fsdp")
    ap.add_argument("--epochs", type=int, default=5)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--step-sleep", type=float, default=0.0, help="seconds per step")
    ap.add_argument("--out", default=".", help="where results/rank<N>.json go")
    args = ap.parse_args()
    torch.set_num_threads(1)
    torch.use_deterministic_algorithms(True)
    job = Job(seed=0)  # takes the rank (a spare waits here) and forms the group
    shape, names = mesh_layout(args.parallel, dist.get_world_size())
    mesh = init_device_mesh("cpu", shape, mesh_dim_names=names)
    torch.manual_seed(1234)  # every rank starts from the same weights
    model = TinyLM()
    for layer in model.encoder.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    data = token_data()
    sampler = DistributedSampler(data, shuffle=True, seed=0)
    loader = DataLoader(data, batch_size=args.batch, sampler=sampler)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.01)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=args.epochs * len(loader))
    job.register(model, opt, sched)  # restores their state
    for epoch in job.epochs(args.epochs):
        sampler.set_epoch(epoch)
        for x, y in job.steps(loader):
            loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten())
            opt.zero_grad()
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm=1.0)
            opt.step()
            sched.step()
            time.sleep(args.step_sleep)  # stands in for a bigger model's compute time
        if dist.get_rank() == 0:
            print(f"epoch {epoch}: loss {loss.item():.4f} lr {sched.get_last_lr()[0]:.2e}")
    save_full_result(args.out, dist.get_rank(), model)


if __name__ == "__main__":
    Job.main(main)  # main() runs again after a fault
