"""A script nobody here wrote for hpct-slurm, adopted the way docs/adoption.md says: a GAN
whose generator and discriminator are stepped alternately by two optimizers, each in the
drop-in DistributedDataParallel, and an EMA of the generator updated after every step; the
loop inline in `main()`. The tests crash it in every phase of a step and compare every rank's
generator, discriminator and EMA with a run that never failed (tests/test_extra_state_cluster.py).

    hpct-slurm template train > job.sbatch        # 4 active nodes + 1 warm spare
    sbatch --nodes=5 job.sbatch python -m hpct_slurm.examples.adopted_gan --epochs 3

`--register job` passes the EMA and the discriminator to `Job(...)` (docs/adoption.md's one way
that works everywhere); `--register after` registers them with `job.state.register` after
`Job(...)`, the way a script that grows extra state later tends to.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import signal
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.optim.swa_utils import AveragedModel, get_ema_multi_avg_fn
from torch.utils.data import DataLoader, TensorDataset

from hpct_slurm.recovery import DistributedDataParallel as DDP, DistributedSampler, Job

Z = 8  # the generator's noise


def real_data(n: int = 512) -> TensorDataset:
    """Samples of a fixed 16-dimensional distribution the generator learns to imitate."""
    g = torch.Generator().manual_seed(7)
    centers = torch.randn(4, 16, generator=g) * 3
    x = centers[torch.randint(0, 4, (n,), generator=g)] + 0.3 * torch.randn(n, 16, generator=g)
    return TensorDataset(x)


def models() -> tuple[torch.nn.Module, torch.nn.Module]:
    torch.manual_seed(1234)  # every rank starts from the same weights
    gen = torch.nn.Sequential(torch.nn.Linear(Z, 64), torch.nn.ReLU(), torch.nn.Linear(64, 16))
    disc = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.LeakyReLU(0.2),
                               torch.nn.Linear(64, 1))
    return gen, disc


def digest(*mods: torch.nn.Module) -> str:
    h = hashlib.sha256()
    for m in mods:
        for t in m.state_dict().values():
            h.update(t.detach().numpy().tobytes())
    return h.hexdigest()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--epochs", type=int, default=3)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--step-sleep", type=float, default=0.0, help="seconds per step")
    ap.add_argument("--out", default=".", help="where results/rank<N>.json go")
    ap.add_argument("--register", choices=("job", "after"), default="job")
    # Faults, in generation 0 only, on --fault-rank: an exception (an in-place fault) or a
    # SIGKILL of this process, at the step's start or right after the discriminator's update
    # (inside the update window: the generator's gradients are still to be reduced)
    ap.add_argument("--fault-rank", type=int, default=1)
    ap.add_argument("--fail-at", type=int, default=None, metavar="STEP")
    ap.add_argument("--die-at", type=int, default=None, metavar="STEP")
    ap.add_argument("--phase", choices=("start", "window"), default="start")
    ap.add_argument("--reset-ema", action="store_true",
                    help="test: a script bug, the EMA started again from the generator after "
                         "every restore (Job(...) restored it): the restore's proof catches it")
    args = ap.parse_args()
    torch.set_num_threads(1)
    torch.use_deterministic_algorithms(True)
    gen, disc = models()
    gen_ddp, disc_ddp = DDP(gen), DDP(disc)
    gopt = torch.optim.Adam(gen.parameters(), lr=2e-3, betas=(0.5, 0.9))
    dopt = torch.optim.Adam(disc.parameters(), lr=2e-3, betas=(0.5, 0.9))
    ema = AveragedModel(gen, multi_avg_fn=get_ema_multi_avg_fn(0.95))
    data = real_data()
    sampler = DistributedSampler(data, shuffle=True, seed=0)
    loader = DataLoader(data, batch_size=args.batch, sampler=sampler)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(gopt, T_max=args.epochs * len(loader))
    if args.register == "job":
        job = Job(gen, gopt, sched, seed=0, ema=ema, disc=disc, disc_opt=dopt)
    else:
        job = Job(gen, gopt, sched, seed=0)
        job.state.register(scope="shared", ema=ema, disc=disc, disc_opt=dopt)
    if args.reset_ema and job.generation > 0:
        ema.module.load_state_dict(gen.state_dict())

    def fault(phase: str) -> None:
        if job.generation != 0 or job.rank != args.fault_rank or phase != args.phase:
            return
        if job.step == args.fail_at:
            raise RuntimeError(f"injected failure in step {job.step} ({phase})")
        if job.step == args.die_at:
            os.kill(os.getpid(), signal.SIGKILL)

    for epoch in job.epochs(args.epochs):
        sampler.set_epoch(epoch)
        for (x,) in job.steps(loader):
            fault("start")
            z = torch.randn(x.shape[0], Z)
            fake = gen_ddp(z)
            # the discriminator's step: real against fake, one forward
            logits = disc_ddp(torch.cat([x, fake.detach()]))
            target = torch.cat([torch.ones(len(x), 1), torch.zeros(len(x), 1)])
            d_loss = F.binary_cross_entropy_with_logits(logits, target)
            dopt.zero_grad()
            d_loss.backward()
            dopt.step()
            fault("window")
            # the generator's step, through the discriminator just updated
            g_loss = F.binary_cross_entropy_with_logits(disc_ddp(fake), torch.ones(len(x), 1))
            gopt.zero_grad()
            g_loss.backward()
            gopt.step()
            sched.step()
            ema.update_parameters(gen)
            job.losses[job.step] = g_loss.item()
            time.sleep(args.step_sleep)
    path = Path(args.out) / "results" / f"rank{dist.get_rank()}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"rank": dist.get_rank(), "params_sha256": digest(gen, disc, ema),
                                "ema_sha256": digest(ema), "steps": len(job.losses)}))


if __name__ == "__main__":
    Job.main(main)  # main() runs again after a fault
