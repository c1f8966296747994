"""`torchrun_inline.py` adopted for nvidia-resiliency-ext 0.4.1's in-job restart, the way its
examples/fault_tolerance/train_ddp_heartbeats_api.py does it: run under `ft_launcher`, a
RankMonitorClient sends a heartbeat every step; when a rank (or its node) dies the launcher
restarts every rank on the same allocation, and each resumes from the last checkpoint, which
therefore carries the model, the optimizer, the schedule, the RNG and the data position. It is
saved every step by default (~8 ms against a ~300 ms step here), so a restart recomputes at
most the step in flight. The bench also runs NVRx's in-process restart (nvrx_inprocess.py).
Lines ending in `# bench` are the benchmark's.

    ft_launcher --nnodes=1 --nproc-per-node=2 --max-restarts=3 \
        -m hpct_slurm.examples.peers.nvrx_ddp --epochs 2 --ckpt-dir ckpt
"""
from __future__ import annotations

import argparse
import os
import time
from pathlib import Path

import nvidia_resiliency_ext.fault_tolerance as fault_tolerance
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler

from hpct_slurm.bench.steplog import log_step  # bench
from hpct_slurm.examples.torchrun_ddp import TinyLM, save_result, token_data


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--epochs", type=int, default=5)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--step-sleep", type=float, default=0.0, help="seconds per step")
    ap.add_argument("--out", default=".", help="where results/rank<N>.json go")
    ap.add_argument("--ckpt-dir", default="ckpt")
    ap.add_argument("--ckpt-every", type=int, default=1, help="steps between checkpoints")
    args = ap.parse_args()
    torch.set_num_threads(1)
    torch.use_deterministic_algorithms(True)
    dist.init_process_group("gloo")
    ft = fault_tolerance.RankMonitorClient()
    ft.init_workload_monitoring()
    torch.manual_seed(1234)  # every rank starts from the same weights
    model = TinyLM()
    ddp = DDP(model)
    data = token_data()
    sampler = DistributedSampler(data, shuffle=True, seed=0)
    loader = DataLoader(data, batch_size=args.batch, sampler=sampler)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.01)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=args.epochs * len(loader))
    path = Path(args.ckpt_dir) / "ckpt.pt"
    ck = torch.load(path) if path.exists() else None
    if ck:
        model.load_state_dict(ck["model"])
        opt.load_state_dict(ck["opt"])
        sched.load_state_dict(ck["sched"])
    start = ck["step"] if ck else 0
    step = start - start % len(loader)
    for epoch in range(start // len(loader), args.epochs):
        sampler.set_epoch(epoch)
        for x, y in loader:
            step += 1
            if step <= start:
                continue
            if ck and step == start + 1:
                torch.set_rng_state(ck["rng"])
            elif (step - 1) % args.ckpt_every == 0 and step > 1 and dist.get_rank() == 0:
                path.parent.mkdir(parents=True, exist_ok=True)
                torch.save({"model": model.state_dict(), "opt": opt.state_dict(),
                            "sched": sched.state_dict(), "rng": torch.get_rng_state(),
                            "step": step - 1}, path.with_suffix(".tmp"))
                os.replace(path.with_suffix(".tmp"), path)
            loss = F.cross_entropy(ddp(x).flatten(0, 1), y.flatten())
            opt.zero_grad()
            loss.backward()
            torch.nn.utils.clip_grad_norm_(ddp.parameters(), max_norm=1.0)
            opt.step()
            log_step(dist.get_rank(), step - 1, loss.item(), dist.get_world_size())  # bench
            sched.step()
            ft.send_heartbeat()
            time.sleep(args.step_sleep)  # stands in for a bigger model's compute time
        if dist.get_rank() == 0:
            print(f"epoch {epoch}: loss {loss.item():.4f} lr {sched.get_last_lr()[0]:.2e}")
    save_result(args.out, dist.get_rank(), model)
    ft.shutdown_workload_monitoring()


if __name__ == "__main__":
    main()
