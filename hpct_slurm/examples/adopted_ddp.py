"""`torchrun_ddp.py` adopted for hpct-slurm: the same loop, restarted in place after a fault
and bit-identical to a run without one. docs/adoption.md shows the diff.

    hpct-slurm template train > job.sbatch        # 4 active nodes + 1 warm spare
    sbatch --nodes=5 job.sbatch python -m hpct_slurm.examples.adopted_ddp --epochs 5
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
from torch.utils.data import DataLoader, TensorDataset

from hpct_slurm.recovery import DistributedSampler, Job

VOCAB, SEQ = 64, 16


class TinyLM(torch.nn.Module):
    """Next-token prediction: embeddings, a two-layer causal transformer encoder, a linear head."""

    def __init__(self, dim: int = 32) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(VOCAB, dim)
        self.pos = torch.nn.Parameter(torch.zeros(SEQ, dim))
        layer = torch.nn.TransformerEncoderLayer(dim, nhead=4, dim_feedforward=64, dropout=0.1,
                                                 batch_first=True)
        self.encoder = torch.nn.TransformerEncoder(layer, num_layers=2,
                                                   enable_nested_tensor=False)
        self.head = torch.nn.Linear(dim, VOCAB)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        mask = torch.nn.Transformer.generate_square_subsequent_mask(x.shape[1])
        return self.head(self.encoder(self.embed(x) + self.pos, mask=mask, is_causal=True))


def token_data(n: int = 512) -> TensorDataset:
    """Sequences that count up from a random token by a random stride (learnable)."""
    g = torch.Generator().manual_seed(0)
    start = torch.randint(0, VOCAB, (n, 1), generator=g)
    stride = torch.randint(1, 4, (n, 1), generator=g)
    seq = (start + stride * torch.arange(SEQ + 1)) % VOCAB
    return TensorDataset(seq[:, :-1], seq[:, 1:])


def train(job: Job, model: torch.nn.Module, ddp: torch.nn.Module, sampler: DistributedSampler,
          loader: DataLoader, opt: torch.optim.Optimizer,
          sched: torch.optim.lr_scheduler.LRScheduler, args: argparse.Namespace) -> None:
    for epoch in job.epochs(args.epochs):
        sampler.set_epoch(epoch)
        for x, y in job.steps(loader):
            loss = F.cross_entropy(ddp(x).flatten(0, 1), y.flatten())
            opt.zero_grad()
            loss.backward()
            torch.nn.utils.clip_grad_norm_(ddp.parameters(), max_norm=1.0)
            opt.step()
            sched.step()
            time.sleep(args.step_sleep)  # stands in for a bigger model's compute time
        if dist.get_rank() == 0:
            print(f"epoch {epoch}: loss {loss.item():.4f} lr {sched.get_last_lr()[0]:.2e}")
    save_result(args.out, dist.get_rank(), model)


def save_result(out: str, rank: int, model: torch.nn.Module) -> None:
    """results/rank<N>.json: a hash of the final parameters, to compare runs bit for bit."""
    digest = hashlib.sha256()
    for p in model.parameters():
        digest.update(p.detach().numpy().tobytes())
    path = Path(out) / "results" / f"rank{rank}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"rank": rank, "params_sha256": digest.hexdigest()}))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--epochs", type=int, default=5)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--step-sleep", type=float, default=0.0, help="seconds per step")
    ap.add_argument("--out", default=".", help="where results/rank<N>.json go")
    args = ap.parse_args()
    torch.set_num_threads(1)
    torch.use_deterministic_algorithms(True)
    torch.manual_seed(1234)  # every rank starts from the same weights
    model = TinyLM()
    data = token_data()
    sampler = DistributedSampler(data, shuffle=True, seed=0)
    loader = DataLoader(data, batch_size=args.batch, sampler=sampler)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.01)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=args.epochs * len(loader))
    job = Job(model, opt, sched, seed=0)
    job.run(lambda: train(job, model, job.ddp, sampler, loader, opt, sched, args))


if __name__ == "__main__":
    main()
