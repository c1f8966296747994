"""A sharded training job under hpct-slurm: FSDP2 (`fully_shard`) on a 1-D mesh, or HSDP on a
2-D (replicate x shard) mesh, with AdamW, a cosine LR schedule, grad-norm clipping on DTensor
gradients and dropout.

The lines that make it recoverable are marked `# hpct`: the model, optimizer and scheduler are
built by a function of the mesh (the wrapper builds them again for every re-formed group) and
the step uses `job.model` / `job.optimizer` / `job.lr_scheduler`. Every rank writes its
per-step losses and a hash of its final parameter shards to the run directory, so runs can be
compared bit for bit.
"""
from __future__ import annotations

import argparse
import math
import threading
import time

import torch
from torch.distributed.fsdp import fully_shard

from hpct_slurm.examples import slowdown
from hpct_slurm.examples.train import DataPosition, write_result
from hpct_slurm.recovery import Job  # hpct

SEED = 11
MESHES = {  # -1: the rest of the job's world (4 ranks on the local cluster)
    "fsdp": ((-1,), ("shard",)),
    "hsdp": ((2, -1), ("replicate", "shard")),
}


def build_for(hidden: int, layers: int, total_steps: int):
    def build(mesh):  # hpct: called with each generation's mesh
        mods: list[torch.nn.Module] = [torch.nn.Linear(32, hidden), torch.nn.GELU(),
                                       torch.nn.Dropout(0.1)]
        for _ in range(layers - 1):
            mods += [torch.nn.Linear(hidden, hidden), torch.nn.GELU(), torch.nn.Dropout(0.1)]
        model = torch.nn.Sequential(*mods, torch.nn.Linear(hidden, 1))
        for m in model:
            if isinstance(m, torch.nn.Linear):
                fully_shard(m, mesh=mesh)
        fully_shard(model, mesh=mesh)
        opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.01)
        sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=max(total_steps, 1))
        return model, opt, sched
    return build


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--parallel", choices=sorted(MESHES), default="hsdp")
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--hidden", type=int, default=128)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--step-sleep", type=float, default=0.0)
    ap.add_argument("--persist-every", type=int, default=0)
    ap.add_argument("--hang-at", type=int, default=None,
                    help="test: block rank --fault-rank's training thread in this step")
    ap.add_argument("--fault-rank", type=int, default=2)
    ap.add_argument("--position", action="store_true",
                    help="register a per-rank data position (state of the rank's own, kept "
                         "on its ring holder)")
    ap.add_argument("--shard-major", action="store_true",
                    help="hsdp: order the mesh (shard, replicate), so the two holders of a "
                         "shard are neighbours in the node order (ranks 2k and 2k+1)")
    slowdown.add_arguments(ap)
    args = ap.parse_args()
    torch.set_num_threads(1)
    torch.use_deterministic_algorithms(True)
    shape, names = MESHES[args.parallel]
    if args.shard_major and args.parallel == "hsdp":
        names = ("shard", "replicate")
    position = DataPosition()
    job = Job(build=build_for(args.hidden, args.layers, args.steps),  # hpct
              mesh_shape=shape, mesh_dim_names=names, seed=SEED,
              persist_every=args.persist_every,
              **({"sampler": position} if args.position else {}))

    def train_step(step: int) -> float:
        if step == args.hang_at and job.generation == 0 and job.rank == args.fault_rank:
            threading.Event().wait()
        position.advance(job.rank, args.batch)
        slowdown.load_delay(args, job.node, step, args.step_sleep)
        return one_step(job.model, job.optimizer, job.lr_scheduler,  # hpct
                        args.batch, args.step_sleep)

    if job.run(train_step, args.steps):  # hpct
        write_result(job.run_dir, job.rank, LocalShards(job.model), job.losses,
                     position.consumed if args.position else None)


def one_step(model: torch.nn.Module, opt: torch.optim.Optimizer, sched, batch: int,
             step_sleep: float = 0.0) -> float:
    x = torch.randn(batch, 32)  # seeded from (seed, rank, step) by the caller
    y = torch.sin(x[:, :4].sum(dim=1, keepdim=True))
    loss = torch.nn.functional.mse_loss(model(x), y)
    opt.zero_grad()
    loss.backward()
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    norm = norm.full_tensor() if hasattr(norm, "full_tensor") else norm
    if not math.isfinite(float(norm)):
        raise RuntimeError(f"gradient norm is {float(norm)}")
    opt.step()
    sched.step()
    if step_sleep:
        time.sleep(step_sleep)
    return loss.item()


class LocalShards(torch.nn.Module):
    """The parameters as this rank holds them (its shards), for the result hash."""

    def __init__(self, model: torch.nn.Module):
        super().__init__()
        self._shards = [p.to_local().detach() if hasattr(p, "to_local") else p.detach()
                        for p in model.parameters()]

    def parameters(self, recurse: bool = True):  # type: ignore[override]
        return iter(self._shards)


if __name__ == "__main__":
    main()
