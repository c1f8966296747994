"""Script shapes people write, each adopted the way docs/adoption.md says (the loop inline in
`main()`, `Job.main(main)`, the drop-in DistributedDataParallel), for the tests and `hpct-slurm
bench zoo`: every shape must come back from a node crash and from an in-place fault
bit-identical to its run without one, with nothing recomputed.

    sbatch --nodes=5 job.sbatch python -m hpct_slurm.examples.zoo --shape bn_cnn

- `bn_cnn`: a small CNN with BatchNorm (running statistics that each rank's forward moves),
  SGD with momentum and a StepLR schedule;
- `ema_lion`: a BatchNorm MLP, a hand-written Lion optimizer and an `AveragedModel` EMA that
  averages the buffers too (`use_buffers=True`), updated after every step;
- `compile_lm`: a causal LM whose head shares the embedding's weight, compiled
  (`torch.compile`, nanoGPT's way: the raw model registered and given to the optimizer, the
  compiled one in DDP), AdamW with two parameter groups (no decay for norms and biases), a
  warm-up then cosine `SequentialLR`, clipping.

Each rank writes results/rank<N>.json: a digest of every registered object's whole state
(parameters, buffers, optimizer moments, the EMA), so a buffer that came back different shows.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import signal
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.optim.swa_utils import AveragedModel, get_ema_multi_avg_fn
from torch.utils.data import DataLoader, TensorDataset

from hpct_slurm.examples.adopted_ddp import VOCAB, TinyLM, token_data
from hpct_slurm.recovery import DistributedDataParallel as DDP, DistributedSampler, Job

SHAPES = ("bn_cnn", "ema_lion", "compile_lm")


class Lion(torch.optim.Optimizer):
    """Lion (Chen et al. 2023) as people paste it into their scripts: the sign of an
    interpolated momentum, decoupled weight decay."""

    def __init__(self, params: Any, lr: float = 1e-4, betas: tuple[float, float] = (0.9, 0.99),
                 weight_decay: float = 0.0) -> None:
        super().__init__(params, {"lr": lr, "betas": betas, "weight_decay": weight_decay})

    @torch.no_grad()
    def step(self, closure: Any = None) -> None:
        for group in self.param_groups:
            b1, b2 = group["betas"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if "exp_avg" not in state:
                    state["exp_avg"] = torch.zeros_like(p)
                m = state["exp_avg"]
                p.mul_(1 - group["lr"] * group["weight_decay"])
                p.add_(torch.sign(m * b1 + p.grad * (1 - b1)), alpha=-group["lr"])
                m.mul_(b2).add_(p.grad, alpha=1 - b2)


def images(n: int = 512) -> TensorDataset:
    """8x8 one-channel images of 4 classes: a class's blob at its own corner, and noise."""
    g = torch.Generator().manual_seed(0)
    y = torch.randint(0, 4, (n,), generator=g)
    x = 0.5 * torch.randn(n, 1, 8, 8, generator=g)
    for c in range(4):
        r, k = divmod(c, 2)
        x[y == c, 0, 4 * r:4 * r + 4, 4 * k:4 * k + 4] += 1.0
    return TensorDataset(x, y)


class TiedLM(TinyLM):
    """adopted_ddp's causal LM with its head sharing the embedding's weight, as in GPT-2 and
    nanoGPT (one parameter, two uses: the gradient sums both)."""

    def __init__(self, dim: int = 32) -> None:
        super().__init__(dim)
        self.head = torch.nn.Linear(dim, VOCAB, bias=False)
        self.head.weight = self.embed.weight


def build(shape: str, steps: int) -> tuple[torch.nn.Module, Any, Any, dict]:
    """The shape's model, optimizer, scheduler and other registered state."""
    torch.manual_seed(1234)  # every rank starts from the same weights
    if shape == "bn_cnn":
        model = torch.nn.Sequential(
            torch.nn.Conv2d(1, 8, 3, padding=1), torch.nn.BatchNorm2d(8), torch.nn.ReLU(),
            torch.nn.Conv2d(8, 8, 3, padding=1), torch.nn.BatchNorm2d(8), torch.nn.ReLU(),
            torch.nn.AdaptiveAvgPool2d(2), torch.nn.Flatten(), torch.nn.Linear(32, 4))
        opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
        return model, opt, torch.optim.lr_scheduler.StepLR(opt, 8, 0.7), {}
    if shape == "ema_lion":
        model = torch.nn.Sequential(
            torch.nn.Flatten(), torch.nn.Linear(64, 32), torch.nn.BatchNorm1d(32),
            torch.nn.ReLU(), torch.nn.Linear(32, 4))
        opt = Lion(model.parameters(), lr=3e-4, weight_decay=0.1)
        ema = AveragedModel(model, multi_avg_fn=get_ema_multi_avg_fn(0.9), use_buffers=True)
        return model, opt, torch.optim.lr_scheduler.CosineAnnealingLR(opt, steps), {"ema": ema}
    model = TiedLM()
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1},
                             {"params": no_decay, "weight_decay": 0.0}], lr=3e-3)
    warm = torch.optim.lr_scheduler.LinearLR(opt, start_factor=0.1, total_iters=4)
    cos = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=max(1, steps - 4))
    sched = torch.optim.lr_scheduler.SequentialLR(opt, [warm, cos], milestones=[4])
    return model, opt, sched, {}


def loss_of(shape: str, ddp: torch.nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    out = ddp(x)
    if shape == "compile_lm":
        return F.cross_entropy(out.flatten(0, 1), y.flatten())
    return F.cross_entropy(out, y)


def digest(*objs: Any) -> str:
    """Every tensor of each object's state_dict (an optimizer's moments too), in order."""
    h = hashlib.sha256()

    def walk(v: Any) -> None:
        if isinstance(v, torch.Tensor):
            h.update(v.detach().contiguous().numpy().tobytes())
        elif isinstance(v, dict):
            for k in sorted(v, key=str):
                walk(v[k])
        elif isinstance(v, (list, tuple)):
            for x in v:
                walk(x)

    for o in objs:
        walk(o.state_dict())
    return h.hexdigest()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", choices=SHAPES, default="bn_cnn")
    ap.add_argument("--epochs", type=int, default=4)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--step-sleep", type=float, default=0.0, help="seconds per step")
    ap.add_argument("--workers", type=int, default=0, help="the DataLoader's worker processes")
    ap.add_argument("--compile-backend", default="aot_eager",
                    help="compile_lm's torch.compile backend (inductor: a C++ compile per "
                         "process, about a minute on a small CPU)")
    ap.add_argument("--out", default=".", help="where results/rank<N>.json go")
    # Faults, in generation 0 only, on --fault-rank: an exception in the step's backward
    # (its peers are then in the gradient all-reduce, waiting for it) or a SIGKILL
    ap.add_argument("--fault-rank", type=int, default=1)
    ap.add_argument("--fail-at", type=int, default=None, metavar="STEP")
    ap.add_argument("--die-at", type=int, default=None, metavar="STEP")
    ap.add_argument("--type-error-at", type=int, default=None, metavar="STEP",
                    help="a bug of the script's: a TypeError there, in every generation")
    args = ap.parse_args()
    torch.set_num_threads(1)
    torch.use_deterministic_algorithms(True)
    data = token_data() if args.shape == "compile_lm" else images()
    sampler = DistributedSampler(data, shuffle=True, seed=0)  # the job's world size, known
    loader = DataLoader(data, batch_size=args.batch, sampler=sampler, num_workers=args.workers)
    model, opt, sched, extra = build(args.shape, args.epochs * len(loader))
    ddp = DDP(torch.compile(model, backend=args.compile_backend)
              if args.shape == "compile_lm" else model)
    job = Job(model, opt, sched, seed=0, **extra)
    ema = extra.get("ema")

    def fault() -> None:
        if job.rank == args.fault_rank and job.step == args.type_error_at:
            raise TypeError("unsupported operand type(s) for +: 'Tensor' and 'NoneType'")
        if job.generation != 0 or job.rank != args.fault_rank:
            return
        if job.step == args.fail_at:
            raise RuntimeError(f"injected failure in step {job.step}")
        if job.step == args.die_at:
            os.kill(os.getpid(), signal.SIGKILL)

    for epoch in job.epochs(args.epochs):
        sampler.set_epoch(epoch)
        for x, y in job.steps(loader):
            loss = loss_of(args.shape, ddp, x, y)
            opt.zero_grad()
            fault()  # after the forward: the others reach their all-reduce and wait there
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm=1.0)
            opt.step()
            sched.step()
            if ema is not None:
                ema.update_parameters(model)
            job.losses[job.step] = loss.item()
            time.sleep(args.step_sleep)
    rank = dist.get_rank()
    path = Path(args.out) / "results" / f"rank{rank}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({
        "rank": rank, "shape": args.shape, "state_sha256": digest(model, opt, *extra.values()),
        "steps": len(job.losses)}))


if __name__ == "__main__":
    Job.main(main)  # main() runs again after a fault
