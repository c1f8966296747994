"""The same training job the way most Slurm users run it today: one `srun` step across all
nodes, MASTER_ADDR/PORT set from the first node, a TCPStore on rank 0, a checkpoint on disk
every K steps, and on any failure the whole step dies and is relaunched from the checkpoint.
Used only as the baseline that `hpct-slurm demo` and `bench recovery` measure against."""
from __future__ import annotations

import argparse
import datetime
import os
import time
from pathlib import Path

import torch
import torch.distributed as dist

from hpct_slurm.events import Ev, EventLog
from hpct_slurm.examples.train import build, one_step, write_result
from hpct_slurm.recovery.gradients import average_gradients, parameter_gradients
from hpct_slurm.recovery.job import seed_everything, step_seed
from hpct_slurm.slurm.env import SlurmEnv

SEED = 7  # the same seed as the hpct job, so the two runs are comparable bit for bit


def main() -> None:  # noqa: C901 - one flat script, as users write it
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--layers", type=int, default=1)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--step-sleep", type=float, default=0.0)
    ap.add_argument("--ckpt-every", type=int, default=10)
    ap.add_argument("--run-dir", required=True)
    ap.add_argument("--port", type=int, default=29400)
    ap.add_argument("--parallel", choices=["ddp", "fsdp", "hsdp", "3d"], default="ddp")
    ap.add_argument("--epochs", type=int, default=2, help="3d: epochs of torchrun_3d's data")
    args = ap.parse_args()
    torch.set_num_threads(1)
    torch.use_deterministic_algorithms(True)
    env = SlurmEnv.from_environ()
    rank, world = env.procid, env.ntasks
    run_dir = Path(args.run_dir)
    events = EventLog(run_dir / "events" / f"baseline-{rank}.jsonl", source=f"baseline/{rank}")
    # process started and torch imported: what a relaunch costs before any rendezvous
    events.emit(Ev.BASELINE_IMPORTED, rank=rank)
    master = (env.step_nodelist or env.job_nodelist)[0]
    store = dist.TCPStore(master, args.port, world, is_master=rank == 0,
                          timeout=datetime.timedelta(seconds=120))
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=120))
    events.emit(Ev.BASELINE_PG_READY, rank=rank)
    if args.parallel == "3d":
        return three_d(args, rank, run_dir, events)
    if args.parallel != "ddp":
        return sharded(args, rank, run_dir, events)
    model, opt = build(args.hidden, args.layers)
    ckpt = run_dir / "ckpt.pt"
    start = 0
    if ckpt.exists():
        state = torch.load(ckpt, weights_only=False)
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["optimizer"])
        start = state["step"] + 1
    events.emit(Ev.BASELINE_START, rank=rank, start_step=start)
    losses: dict[int, float] = {}

    def allreduce() -> None:
        average_gradients(parameter_gradients(model), world)

    for step in range(start, args.steps):
        seed_everything(step_seed(SEED, rank, step))
        losses[step] = one_step(model, opt, args.batch, allreduce, args.step_sleep)
        events.emit(Ev.RANK_STEP, rank=rank, step=step, loss=losses[step])
        if rank == 0 and (step + 1) % args.ckpt_every == 0:
            tmp = ckpt.with_suffix(".tmp")
            torch.save({"model": model.state_dict(), "optimizer": opt.state_dict(),
                        "step": step}, tmp)
            os.replace(tmp, ckpt)
    write_result(run_dir, rank, model, losses)
    dist.destroy_process_group()


def sharded(args: argparse.Namespace, rank: int, run_dir: Path, events: EventLog) -> None:
    """The sharded demo job (examples/sharded_train.py) as users checkpoint it today: torch's
    distributed checkpoint (every rank writes its shards) every K steps, reloaded after a
    restart of every rank."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
    from torch.distributed.device_mesh import init_device_mesh

    from hpct_slurm.examples import sharded_train as st
    from hpct_slurm.recovery.layout_rules import resolve_shape

    shape, names = st.MESHES[args.parallel]
    shape = resolve_shape(shape, dist.get_world_size())  # the -1: the rest of the world
    mesh = init_device_mesh("cpu", shape, mesh_dim_names=names)
    seed_everything(st.SEED)
    model, opt, sched = st.build_for(args.hidden, args.layers, args.steps)(mesh)
    ckpt = run_dir / "dcp"
    start = 0
    if (ckpt / "step.txt").exists():
        msd, osd = get_state_dict(model, opt)
        state = {"model": msd, "optimizer": osd}
        dcp.load(state, checkpoint_id=str(ckpt / "state"))
        set_state_dict(model, opt, model_state_dict=state["model"],
                       optim_state_dict=state["optimizer"])
        start = int((ckpt / "step.txt").read_text()) + 1
        sched.load_state_dict(torch.load(ckpt / f"sched{rank}.pt"))
    events.emit(Ev.BASELINE_START, rank=rank, start_step=start)
    losses: dict[int, float] = {}
    for step in range(start, args.steps):
        seed_everything(step_seed(st.SEED, rank, step))
        losses[step] = st.one_step(model, opt, sched, args.batch, args.step_sleep)
        events.emit(Ev.RANK_STEP, rank=rank, step=step, loss=losses[step])
        if (step + 1) % args.ckpt_every == 0:
            msd, osd = get_state_dict(model, opt)
            dcp.save({"model": msd, "optimizer": osd}, checkpoint_id=str(ckpt / "state"))
            torch.save(sched.state_dict(), ckpt / f"sched{rank}.pt")
            commit_step(ckpt, rank, step)
    write_result(run_dir, rank, st.LocalShards(model), losses)
    dist.destroy_process_group()


def commit_step(ckpt: Path, rank: int, step: int) -> None:
    """Once every rank saved its part of step `step`'s checkpoint, rank 0 names it the one to
    restart from (`step.txt`, replaced whole: a crash amid a save leaves the last one)."""
    dist.barrier()
    if rank == 0:
        tmp = ckpt / "step.tmp"
        tmp.write_text(str(step))
        os.replace(tmp, ckpt / "step.txt")


def three_d(args: argparse.Namespace, rank: int, run_dir: Path, events: EventLog) -> None:
    """The 3-D job (examples/torchrun_3d.py: pipeline 2 x FSDP2 x TP 2) as users checkpoint it
    today: every rank saves its own shards (parameters, AdamW's state, the scheduler) every K
    steps, and after a restart of every rank loads them back and skips the batches of the
    epoch done before. (torch's distributed checkpoint fails to load an AdamW's state across
    pipeline stages here: KeyError 'betas', torch 2.13.)"""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor
    from torch.utils.data import DataLoader, DistributedSampler

    from hpct_slurm.examples import model_3d as t3
    from hpct_slurm.examples.torchrun_ddp import token_data
    from hpct_slurm.examples.torchrun_fsdp import save_full_result

    names = t3.LAYOUTS["3d"]
    mesh = init_device_mesh("cpu", t3.mesh_shape("3d", dist.get_world_size()),
                            mesh_dim_names=names)
    torch.manual_seed(1234)
    pp = mesh["pp"]
    model = t3.parallelize(t3.TokenMLP().stage(pp.get_local_rank(), pp.size()), mesh, names)
    schedule = t3.schedule_for(model, pp)
    dp = mesh[("dp_shard",)]
    data = token_data()
    sampler = DistributedSampler(data, num_replicas=dp.size(), rank=t3.flat_rank(dp),
                                 shuffle=True, seed=0)
    loader = DataLoader(data, batch_size=args.batch, sampler=sampler)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.01)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=args.epochs * len(loader))
    ckpt = run_dir / "dcp"
    start = 0
    params = dict(model.named_parameters())
    if (ckpt / "step.txt").exists():
        start = int((ckpt / "step.txt").read_text()) + 1
        # a file per step: a crash amid the next save leaves this one whole
        saved = torch.load(ckpt / f"rank{rank}-step{start - 1}.pt", weights_only=False)
        with torch.no_grad():
            for name, p in params.items():
                p.to_local().copy_(saved["model"][name])
                opt.state[p] = {k: DTensor.from_local(v, p.device_mesh, p.placements,
                                                      run_check=False, shape=p.shape,
                                                      stride=p.stride()) if v.dim() else v
                                for k, v in saved["optimizer"][name].items()}
        sched.load_state_dict(saved["sched"])
        for group, lr in zip(opt.param_groups, saved["lr"]):  # the schedule's position
            group["lr"] = lr
    events.emit(Ev.BASELINE_START, rank=rank, start_step=start)
    step = 0
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        for x, y in loader:
            if step >= start:
                t3.step(model, schedule, x, y, opt)
                sched.step()
                if args.step_sleep:
                    time.sleep(args.step_sleep)
                events.emit(Ev.RANK_STEP, rank=rank, step=step, loss=None)
                if (step + 1) % args.ckpt_every == 0:
                    ckpt.mkdir(parents=True, exist_ok=True)
                    local = {n: {k: (v.to_local() if isinstance(v, DTensor) else v).clone()
                                 for k, v in opt.state[p].items()} for n, p in params.items()}
                    torch.save({"model": {n: p.to_local().clone() for n, p in params.items()},
                                "optimizer": local, "sched": sched.state_dict(),
                                "lr": [g["lr"] for g in opt.param_groups]},
                               ckpt / f"rank{rank}-step{step}.pt")
                    commit_step(ckpt, rank, step)
            step += 1
    save_full_result(str(run_dir), rank, model)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
