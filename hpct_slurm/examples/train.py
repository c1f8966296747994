"""The demo training job: a small MLP trained data-parallel under hpct-slurm.

The lines that make it recoverable are marked `# hpct`. Every rank writes its per-step losses
and a hash of its final parameters to the run directory, so runs can be compared bit for bit.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import time
from pathlib import Path
from typing import Callable

import torch

from hpct_slurm.recovery import Job  # hpct


def build(hidden: int, layers: int = 1) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    """An MLP with `layers` hidden layers of width `hidden`; `layers` > 1 only deepens it
    (benchmarks use that for a large model state), layers=1 is the demo's model."""
    torch.manual_seed(1234)  # every rank starts from the same weights
    mods: list[torch.nn.Module] = [torch.nn.Linear(32, hidden), torch.nn.ReLU(),
                                   torch.nn.Dropout(0.1)]
    for _ in range(layers - 1):
        mods += [torch.nn.Linear(hidden, hidden), torch.nn.ReLU()]
    model = torch.nn.Sequential(*mods, torch.nn.Linear(hidden, 1))
    return model, torch.optim.Adam(model.parameters(), lr=1e-3)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--layers", type=int, default=1, help="hidden layers of width --hidden")
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--step-sleep", type=float, default=0.0,
                    help="pause per step, to stand in for a real model's compute time")
    ap.add_argument("--micro", action="store_true",
                    help="hand the wrapper forward+backward only (allows an elastic shrink)")
    ap.add_argument("--ddp", action="store_true",
                    help="train through torch DistributedDataParallel (job.ddp)")
    args = ap.parse_args()
    torch.set_num_threads(1)
    torch.use_deterministic_algorithms(True)
    model, opt = build(args.hidden, args.layers)
    job = Job(model=model, optimizer=opt, seed=7)  # hpct

    def train_step(step: int) -> float:  # hpct: one optimizer step
        if args.ddp:  # plain DDP: the wrapper re-creates it for every generation
            return one_step(job.ddp, opt, args.batch, lambda: None, args.step_sleep)
        return one_step(model, opt, args.batch, job.allreduce_gradients, args.step_sleep)

    def micro_step(step: int) -> float:  # forward + backward only: the job may shrink
        return forward_backward(model, args.batch, args.step_sleep)

    trained = (job.run(None, args.steps, micro_step=micro_step) if args.micro
               else job.run(train_step, args.steps))  # hpct
    if trained:
        write_result(job.run_dir, job.rank, model, job.losses)


def forward_backward(model: torch.nn.Module, batch: int, step_sleep: float = 0.0) -> float:
    # data for (rank, step): the caller seeded the RNG from (seed, rank, step)
    x = torch.randn(batch, 32)
    y = x[:, :4].sum(dim=1, keepdim=True)
    loss = torch.nn.functional.mse_loss(model(x), y)
    loss.backward()
    if step_sleep:
        time.sleep(step_sleep)
    return loss.item()


def one_step(model: torch.nn.Module, opt: torch.optim.Optimizer, batch: int,
             allreduce: Callable[[], None], step_sleep: float = 0.0) -> float:
    opt.zero_grad()
    loss = forward_backward(model, batch, step_sleep)
    allreduce()  # fixed-order reduction
    opt.step()
    return loss


def write_result(run_dir: Path, rank: int, model: torch.nn.Module,
                 losses: dict[int, float]) -> None:
    digest = hashlib.sha256()
    for p in model.parameters():
        digest.update(p.detach().numpy().tobytes())
    out = Path(run_dir) / "results" / f"rank{rank}.json"
    out.parent.mkdir(exist_ok=True)
    out.write_text(json.dumps({"rank": rank, "params_sha256": digest.hexdigest(),
                               "losses": {str(k): v for k, v in sorted(losses.items())},
                               "node": os.environ.get("SLURMD_NODENAME")}))


if __name__ == "__main__":
    main()
