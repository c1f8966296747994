"""`torchrun_inline.py` adopted for torchft 0.2.0, the way torchft's train_ddp.py does it: one
replica group per node (here one process each), a Manager talking to the Lighthouse, torchft's
DistributedDataParallel and Optimizer wrappers. Two modes (issue 44):
  --spares 1   `WorldSizeMode.FIXED_WITH_SPARES` (torchft/manager.py): 4 groups take part and
               a fifth, live and in sync, contributes zero gradients; when a group dies the
               spare takes its place at the next quorum, with no heal;
  --spares 0   `WorldSizeMode.DYNAMIC` (the default): the survivors go on at a smaller world
               size; the lost group, relaunched, heals from a live peer's memory.
A step's batch is chosen from the step number and the data shard the group trains (its place
in the quorum with spares; its group id without), so that a relaunched group does not read
epoch 0 again and a step that was not committed is retried on the same batches; the schedule
steps only when the optimizer did. Lines ending in `# bench` are the benchmark's.

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
from torchft.manager import WorldSizeMode

from hpct_slurm.bench.steplog import log_step, start_barrier  # bench
from hpct_slurm.examples.torchrun_ddp import TinyLM, save_result, token_data


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--epochs", type=int, default=5)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--step-sleep", type=float, default=0.0, help="seconds per step")
    ap.add_argument("--out", default=".", help="where results/rank<N>.json go")
    ap.add_argument("--spares", type=int, default=0, help="replica groups kept as live spares")
    ap.add_argument("--timeout", type=float, default=10.0, help="Manager and gloo timeout (s)")
    args = ap.parse_args()
    torch.set_num_threads(1)
    torch.use_deterministic_algorithms(True)
    group, groups = int(os.environ["REPLICA_GROUP_ID"]), int(os.environ["NUM_REPLICA_GROUPS"])
    active = groups - args.spares  # the data shards: one per group taking part
    torch.manual_seed(1234)  # every rank starts from the same weights
    model = TinyLM()
    data = token_data()
    steps = len(data) // (active * args.batch)
    batches: dict[tuple[int, int], list] = {}

    def batch(step: int, shard: int):
        """The step's batch of `shard`: its epoch's DistributedSampler order, as in torchrun."""
        epoch, i = divmod(step, steps)
        if (shard, epoch) not in batches:
            sampler = DistributedSampler(data, replica_rank=shard, num_replica_groups=active,
                                         group_rank=0, num_replicas=1, shuffle=True, seed=0)
            sampler.set_epoch(epoch)
            batches[shard, epoch] = list(DataLoader(data, batch_size=args.batch,
                                                    sampler=sampler))
        return batches[shard, epoch][i]

    inner = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.01)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(inner, T_max=args.epochs * steps)

    def load_state_dict(sd):
        model.load_state_dict(sd["model"])
        inner.load_state_dict(sd["optim"])
        sched.load_state_dict(sd["sched"])

    def state_dict():
        return {"model": model.state_dict(), "optim": inner.state_dict(),
                "sched": sched.state_dict()}

    timeout = timedelta(seconds=args.timeout)
    mode = WorldSizeMode.FIXED_WITH_SPARES if args.spares else WorldSizeMode.DYNAMIC
    manager = Manager(pg=ProcessGroupGloo(timeout=timeout), min_replica_size=active
                      if args.spares else 1, world_size_mode=mode,
                      load_state_dict=load_state_dict, state_dict=state_dict,
                      replica_id=f"train_ddp_{group}", timeout=timeout)
    ddp = DDP(manager, model)
    opt = Optimizer(manager, inner)
    start_barrier(group, groups)  # bench
    total = args.epochs * steps
    while manager.current_step() < total:
        opt.zero_grad()  # starts the quorum (a relaunched group heals in it)
        part = manager.participating_rank()  # waits for the quorum; None: a spare
        shard = part if args.spares else group
        if part is None:  # a spare's (or a healing group's) gradients count zero
            shard = 0
        step = manager.current_step()
        x, y = batch(step, shard)
        loss = F.cross_entropy(ddp(x).flatten(0, 1), y.flatten())
        loss.backward()
        torch.nn.utils.clip_grad_norm_(ddp.parameters(), max_norm=1.0)
        opt.step()
        log_step(-1 if part is None else shard, step, loss.item(),  # bench
                 manager.num_participants(), manager.current_step() > step)  # bench
        if manager.current_step() > step:  # committed: the optimizer stepped
            sched.step()
        time.sleep(args.step_sleep)  # stands in for a bigger model's compute time
        if group == 0 and manager.current_step() % steps == 0 and manager.current_step() > step:
            print(f"step {step}: loss {loss.item():.4f} lr {sched.get_last_lr()[0]:.2e}")
    save_result(args.out, group, model)
    manager.shutdown(wait=False)


if __name__ == "__main__":
    main()
