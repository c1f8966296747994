"""What the gradient all-reduce costs a DDP step, in `WORLD` local processes of a real gloo
group (no Slurm): the model, data and optimizer of the shipped DDP examples (TinyLM, AdamW,
batch 16, one thread per rank), forward + backward + clip + step, steps alternating between
three ways of reducing the gradients, blocks of `BLOCK` steps per way, rotated every round:

- `torch_ddp`: torch's own DDP, no hook (its buckets; not bit-stable across generations, the
  yardstick the peers run);
- `per_parameter`: the fixed-order DDP as it was before (one all_reduce per gradient);
- `canonical`: the fixed-order DDP now (`recovery.gradients`: every gradient in parameter
  order, flattened in fixed chunks, one all_reduce per chunk, once the last bucket is ready).

The summary: each way's median step time over all blocks and ranks, and its ratio to
`torch_ddp`'s, measured side by side in the same processes; also the number of all_reduce
calls one step issues.
"""
from __future__ import annotations

import datetime
import multiprocessing as mp
import statistics
import time
from pathlib import Path
from typing import Any

from .common import free_port, plot_bars, write_result

NAME = "gradients"
WORLD = 4
WAYS = ("torch_ddp", "per_parameter", "canonical")


def _per_parameter_hook(_state, bucket):  # DDP checks hook annotations: leave them off
    """The fixed-order DDP's hook before issue 26's follow-up, kept here as the yardstick."""
    import torch
    import torch.distributed as dist

    grads = bucket.gradients()
    for work in [dist.all_reduce(g, async_op=True) for g in grads]:
        work.wait()
    for g in grads:
        g.div_(dist.get_world_size())
    fut: torch.futures.Future = torch.futures.Future()
    fut.set_result(bucket.buffer())
    return fut


def _rank(rank: int, port: int, rounds: int, block: int, q: Any) -> None:
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F

    from ..examples.torchrun_ddp import TinyLM, token_data
    from ..recovery.generation import _canonical_allreduce, _CanonicalReduce
    from ..recovery.own_time import OwnTime

    class _Client:  # what the hook uses of a rank's CoordinationClient
        state = "running"
        own = OwnTime(50)

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=WORLD, timeout=datetime.timedelta(seconds=60))
    torch.manual_seed(1234)
    model = TinyLM()
    ddps = {"torch_ddp": torch.nn.parallel.DistributedDataParallel(model)}
    ddps["per_parameter"] = torch.nn.parallel.DistributedDataParallel(model)
    ddps["per_parameter"].register_comm_hook(None, _per_parameter_hook)
    ddps["canonical"] = torch.nn.parallel.DistributedDataParallel(model)
    ddps["canonical"].register_comm_hook(_CanonicalReduce(_Client(), model),
                                         _canonical_allreduce)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.01)
    data = token_data()
    calls = {"n": 0}
    real = dist.all_reduce

    def counting(*a: Any, **k: Any) -> Any:
        calls["n"] += 1
        return real(*a, **k)

    dist.all_reduce = counting  # type: ignore[assignment]
    per_step_calls: dict[str, int] = {}
    times: dict[str, list[float]] = {w: [] for w in WAYS}
    i = 0
    for rnd in range(rounds + 1):  # round 0 warms every way up (and rebuilds DDP's buckets)
        order = WAYS[rnd % len(WAYS):] + WAYS[:rnd % len(WAYS)]
        for way in order:
            dist.barrier()
            t0 = time.perf_counter()
            n0 = calls["n"]
            for _ in range(block):
                x, y = data[(i * 16) % (len(data) - 16):(i * 16) % (len(data) - 16) + 16]
                i += 1
                loss = F.cross_entropy(ddps[way](x).flatten(0, 1), y.flatten())
                opt.zero_grad()
                loss.backward()
                torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm=1.0)
                opt.step()
            per_step_calls[way] = (calls["n"] - n0) // block
            if rnd:
                times[way].append((time.perf_counter() - t0) / block)
    dist.all_reduce = real  # type: ignore[assignment]
    n_grads = sum(1 for p in model.parameters() if p.requires_grad)
    dist.destroy_process_group()
    q.put((rank, times, per_step_calls, n_grads))



def run(out_dir: Path, quick: bool = False, smoke: bool = False) -> dict:
    rounds, block = (1, 2) if smoke else (3, 5) if quick else (5, 10)
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_rank, args=(r, port, rounds, block, q), daemon=True)
             for r in range(WORLD)]
    for p in procs:
        p.start()
    try:
        got = [q.get(timeout=600) for _ in range(WORLD)]
    finally:
        for p in procs:
            p.join(30)
            if p.is_alive():
                p.kill()
    step_s = {w: round(statistics.median(t for _, times, _, _ in got for t in times[w]), 5)
              for w in WAYS}
    calls = got[0][2]
    summary = {"bench": NAME, "world": WORLD, "gradients": got[0][3],
               "step_s": step_s,
               "vs_torch_ddp": {w: round(step_s[w] / step_s["torch_ddp"], 2) for w in WAYS},
               "all_reduce_calls_per_step": calls}
    write_result(out_dir, NAME, {**summary, "quick": quick, "smoke": smoke,
                                 "rounds": rounds, "block": block, "method": __doc__,
                                 "per_rank": {r: t for r, t, _, _ in got}})
    plot_bars(Path(out_dir) / f"{NAME}.png", list(WAYS), [step_s[w] for w in WAYS],
              "seconds per step (median over blocks and ranks)",
              f"DDP step by gradient reduction, {WORLD} gloo ranks, TinyLM")
    return summary
