"""A plain torchrun FSDP2 script with its loop inline in `main()`: the model, data and schedule
of `torchrun_ddp.py`, each encoder layer and the whole model wrapped with `fully_shard` on a
1-D mesh (`--parallel fsdp`) or a 2-D replicate x shard mesh (`--parallel hsdp`, HSDP). At the
end every rank gathers the whole model (`full_tensor()`, a collective) and writes its hash.
`adopted_fsdp.py` is this script adopted for hpct-slurm; docs/adoption.md shows the diff.

    torchrun --nproc-per-node 4 -m hpct_slurm.examples.torchrun_fsdp --parallel hsdp
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
from torch.utils.data import DataLoader, DistributedSampler

from hpct_slurm.examples.torchrun_ddp import TinyLM, token_data



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
    dist.init_process_group("gloo")
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
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        for x, y in loader:
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
    main()
