"""`torchrun_inline.py` adopted for torchft 0.2.0, the way torchft's train_ddp.py does it: one
replica group per node (here one process each), a Manager talking to the Lighthouse, torchft's
DistributedDataParallel and Optimizer wrappers, the data sharded by replica group. When a group
dies the others go on at a smaller world size; the relaunched group heals from a live peer's
memory (model, optimizer and schedule). Lines ending in `# bench` are the benchmark's.

    torchft_lighthouse --min_replicas 1 --quorum_tick_ms 100 --join_timeout_ms 10000 &
    REPLICA_GROUP_ID=0 NUM_REPLICA_GROUPS=2 TORCHFT_LIGHTHOUSE=http://localhost:29510 \
        MASTER_ADDR=localhost MASTER_PORT=29600 RANK=0 WORLD_SIZE=1 \
        python -m hpct_slurm.examples.peers.torchft_ddp --epochs 2      # and group 1
"""
from __future__ import annotations

import argparse
import os
import time
from datetime import timedelta

import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader
from torchft import DistributedDataParallel as DDP, DistributedSampler, Manager, Optimizer
from torchft import ProcessGroupGloo

from hpct_slurm.bench.peer_hooks import log_step, start_barrier  # bench
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
    group, groups = int(os.environ["REPLICA_GROUP_ID"]), int(os.environ["NUM_REPLICA_GROUPS"])
    torch.manual_seed(1234)  # every rank starts from the same weights
    model = TinyLM()
    data = token_data()
    sampler = DistributedSampler(data, replica_rank=group, num_replica_groups=groups,
                                 group_rank=0, num_replicas=1, shuffle=True, seed=0)
    loader = DataLoader(data, batch_size=args.batch, sampler=sampler)
    inner = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.01)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(inner, T_max=args.epochs * len(loader))

    def load_state_dict(sd):
        model.load_state_dict(sd["model"])
        inner.load_state_dict(sd["optim"])
        sched.load_state_dict(sd["sched"])

    def state_dict():
        return {"model": model.state_dict(), "optim": inner.state_dict(),
                "sched": sched.state_dict()}

    manager = Manager(pg=ProcessGroupGloo(timeout=timedelta(seconds=10)), min_replica_size=1,
                      load_state_dict=load_state_dict, state_dict=state_dict,
                      replica_id=f"train_ddp_{group}", timeout=timedelta(seconds=10))
    ddp = DDP(manager, model)
    opt = Optimizer(manager, inner)
    start_barrier(group, groups)  # bench
    epoch, total = 0, args.epochs * len(loader)
    while manager.current_step() < total:
        sampler.set_epoch(epoch)
        for x, y in loader:
            opt.zero_grad()
            loss = F.cross_entropy(ddp(x).flatten(0, 1), y.flatten())
            loss.backward()
            torch.nn.utils.clip_grad_norm_(ddp.parameters(), max_norm=1.0)
            before = manager.current_step()  # bench
            opt.step()
            sched.step()
            log_step(group, manager.current_step() - 1, loss.item(),  # bench
                     manager.num_participants(), manager.current_step() > before)  # bench
            time.sleep(args.step_sleep)  # stands in for a bigger model's compute time
            if manager.current_step() >= total:
                break
        if group == 0:
            print(f"epoch {epoch}: loss {loss.item():.4f} lr {sched.get_last_lr()[0]:.2e}")
        epoch += 1
    save_result(args.out, group, model)
    manager.shutdown(wait=False)


if __name__ == "__main__":
    main()
