"""Steady-state cost of recovery state for sharded jobs: FSDP2 on a 1-D mesh of 4 ranks, HSDP
on a 2 x 2 mesh, and the tensor-parallel layouts of the largest jobs: FSDP2 + TP on
(dp_shard 2, tp 2) (FSDP2's strided shards) and HSDP + TP on (dp_replicate 2, dp_shard 1,
tp 2); real torch.distributed (gloo) in 4 processes on this machine. (Pipeline stages add no
state of their own: each stage's is an FSDP layout of its layers.)

Variants alternate in blocks of steps, in a rotating order, so every variant sees the same
machine; a block's time runs until the group finished it (a barrier), and pays for what it
started (the last commit's copy and push). Per variant:
- `off`: no recovery state;
- `overlap`: what `Job` does by default on GPU: commit every step; parameters and optimizer state
  are copied on a background thread during the next step's forward and backward, and the next
  optimizer step waits for that copy only if it is not done; 1-D FSDP (one holder per shard)
  pushes the snapshot to its ring peer after the copy, on the same thread;
- `sync`: the same copy and push before the step returns (`Job`'s default on CPU, where the
  step keeps every core busy);
- `lazy`: what `Job` does by default where every shard has two holders or more (HSDP) and no
  per-rank state is registered: a full commit every LAZY_FULL_EVERY (64) of its steps, and
  each step in between held where it lies, copied only if a fault comes before the next
  optimizer step; its blocks are whole cycles of that many steps.
Overheads are per block, against the `off` block of the same round; the figure is their
median, with the lowest and highest next to it.
"""
from __future__ import annotations

import multiprocessing as mp
import queue
import secrets
import statistics
import tempfile
import time
from typing import Any

JOB = "bench"
MESHES = {"fsdp": ((4,), ("shard",), ()),
          "hsdp": ((2, 2), ("replicate", "shard"), ("replicate",)),
          "fsdp_tp": ((2, 2), ("dp_shard", "tp"), ()),
          "hsdp_tp": ((2, 1, 2), ("dp_replicate", "dp_shard", "tp"), ("dp_replicate",))}
VARIANTS = ("off", "overlap", "sync", "lazy")
WORLD = 4  # both meshes


def _rank(rank: int, tmp: str, parallels: tuple[str, ...], cfg: dict, secret: bytes,
          q: Any) -> None:
    """One of the 4 processes: every mesh of `parallels` measured in turn in one group (each
    spawn imports torch anew: a group per mesh cost the smoke run 8 s more)."""
    import torch
    import torch.distributed as dist

    try:
        torch.set_num_threads(1)
        dist.init_process_group("gloo", init_method=f"file://{tmp}/store", rank=rank,
                                world_size=WORLD)
        for parallel in parallels:
            q.put((rank, parallel, _measure_rank(rank, parallel, cfg, secret)))
        dist.destroy_process_group()
    except BaseException as exc:  # noqa: BLE001 - reported to the parent
        q.put((rank, None, {"error": f"{type(exc).__name__}: {exc}"}))


def _measure_rank(rank: int, parallel: str, cfg: dict, secret: bytes) -> dict:
    """This rank's blocks of every variant on the mesh of `parallel`, in the formed group."""
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from .. import protocol as P
    from ..recovery.layout_rules import MeshSpec
    from ..recovery.replicas import ReplicaStore
    from ..recovery.ring import replica_peer_rank
    from ..recovery.snapshot import SnapshotStore
    from ..recovery.snapshot_policy import LAZY_FULL_EVERY
    from ..recovery.state import TrainState
    from ..recovery.transfer import ReplicaPusher, TransferServer

    shape, names, replicate = MESHES[parallel]
    spec = MeshSpec(shape, names, replicate)
    world = spec.world_size
    mesh = init_device_mesh("cpu", shape, mesh_dim_names=names)
    torch.manual_seed(0)
    width, depth = cfg["width"], cfg["depth"]
    model = torch.nn.Sequential(*[torch.nn.Linear(width, width) for _ in range(depth)])
    dp = mesh
    if "tp" in names:  # Megatron's pairs: column-parallel, then row-parallel
        from torch.distributed.tensor.parallel import (ColwiseParallel, RowwiseParallel,
                                                       parallelize_module)
        parallelize_module(model, mesh["tp"], {str(i): ColwiseParallel() if i % 2 == 0
                                               else RowwiseParallel() for i in range(depth)})
        dp = mesh[tuple(n for n in names if n != "tp")]
    for layer in model:
        fully_shard(layer, mesh=dp)
    fully_shard(model, mesh=dp)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    state = TrainState(model=model, optimizer=opt)
    state.mesh, state.replicate = mesh, spec.replicate
    ring = spec.replicas < 2  # no other holder of this shard: a ring copy, as Job does
    store = SnapshotStore(state, ("shared", "rank") if ring else ("shared",), every=1)
    server = TransferServer(secret, JOB, rank, replicas=ReplicaStore())
    addrs: list[Any] = [None] * world
    dist.all_gather_object(addrs, server.address)
    pusher = (ReplicaPusher(store, rank, tuple(addrs[replica_peer_rank(rank, world, 1)]),
                            secret, JOB) if ring else None)
    active = {"variant": "off"}
    phases: dict[str, list[float]] = {"wait": [], "commit_call": [], "push": []}

    def prehook(*_: Any) -> None:
        if active["variant"] in ("overlap", "lazy"):
            t0 = time.perf_counter()
            store.before_optimizer_step()
            phases["wait"].append(time.perf_counter() - t0)

    opt.register_step_pre_hook(prehook)

    def follow_up(snap: Any) -> None:
        if pusher is not None:
            t0 = time.perf_counter()
            pusher.after_commit(snap.step)
            pusher.flush()
            phases["push"].append(time.perf_counter() - t0)

    x = torch.randn(cfg["batch"], width)

    def train_step() -> None:
        loss = model(x).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()

    step = 0
    train_step()
    for _ in range(2):  # both slots and the peer's buffers allocated before timing
        step += 1
        follow_up(store.commit(step))
    times: dict[str, list[float]] = {v: [] for v in VARIANTS}
    lazy_steps = 0  # the lazy variant's own steps: its full commits fall on them
    for rnd in range(cfg["rounds"] + 1):  # round 0 warms up, not recorded
        order = VARIANTS[rnd % len(VARIANTS):] + VARIANTS[:rnd % len(VARIANTS)]
        for variant in order:
            active["variant"] = variant
            # a lazy block is a whole cycle, one full commit (`cycles`: not in the smoke run)
            steps = LAZY_FULL_EVERY if variant == "lazy" and cfg["cycles"] else cfg["block"]
            dist.barrier()
            t_block = time.perf_counter()
            for _ in range(steps):
                train_step()
                step += 1
                lazy_steps += variant == "lazy"
                if variant == "overlap":
                    t0 = time.perf_counter()
                    store.commit_async(step, then=follow_up)
                    phases["commit_call"].append(time.perf_counter() - t0)
                elif variant == "sync" or (variant == "lazy"
                                           and lazy_steps % LAZY_FULL_EVERY == 0):
                    follow_up(store.commit(step))
                elif variant == "lazy":
                    t0 = time.perf_counter()
                    store.prepare_lazy(step)
                    phases.setdefault("lazy_hold", []).append(time.perf_counter() - t0)
            store.wait()
            store.drop_pending()
            dist.barrier()
            if rnd:
                times[variant].append((time.perf_counter() - t_block) / steps)
    # the phases on their own, on a quiet group: one copy, one digest of this rank's state
    dist.barrier()
    t0 = time.perf_counter()
    snap = store.commit(step + 1)
    copy_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    P.part_digest(snap.data)
    digest_s = time.perf_counter() - t0
    nbytes = snap.layout.nbytes
    if pusher is not None:
        pusher.close()
    server.close()
    dist.barrier()
    return {"times": times, "copy_s": copy_s, "digest_s": digest_s,
            "nbytes": nbytes, "ring": ring,
            "phases": {k: statistics.median(v) if v else 0.0 for k, v in phases.items()}}


def measure(parallels: tuple[str, ...], cfg: dict) -> dict[str, dict]:
    """Run the 4-process group through every mesh of `parallels` and summarise each:
    overhead % per variant (median of the per-block overheads, with min and max), step times,
    and the phases of rank 0."""
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    secret = secrets.token_bytes(32)
    with tempfile.TemporaryDirectory() as tmp:
        procs = [ctx.Process(target=_rank, args=(r, tmp, tuple(parallels), cfg, secret, q))
                 for r in range(WORLD)]
        for p in procs:
            p.start()
        got: dict[str, dict[int, dict]] = {p: {} for p in parallels}
        errors: dict[int, str] = {}
        deadline = time.monotonic() + cfg.get("timeout", 900)
        try:
            while sum(map(len, got.values())) < WORLD * len(parallels) and not errors:
                try:
                    rank, parallel, res = q.get(timeout=1.0)
                except queue.Empty:
                    # a rank that died without a word (killed, crashed) never reports
                    dead = {r: p.exitcode for r, p in enumerate(procs) if p.exitcode}
                    if dead or time.monotonic() > deadline:
                        errors.update({r: f"exited with {c}" for r, c in dead.items()}
                                      or {-1: "no result within the timeout"})
                    continue
                if "error" in res:
                    errors[rank] = res["error"]
                else:
                    got[parallel][rank] = res
        finally:
            for p in procs:
                p.join(30 if not errors else 0)
                if p.is_alive():
                    p.kill()
    if errors:
        raise RuntimeError(f"bench replication {'/'.join(parallels)}: {errors}")
    return {p: _summary(got[p]) for p in parallels}


def _summary(got: dict[int, dict]) -> dict:
    r0 = got[0]
    times = r0["times"]
    out: dict[str, Any] = {"step_ms": {v: round(statistics.median(t) * 1e3, 2)
                                       for v, t in times.items()},
                           "state_mb_per_rank": round(r0["nbytes"] / 1e6, 1),
                           "state_mb_total": round(sum(g["nbytes"] for g in got.values()) / 1e6, 1),
                           "ring_push": r0["ring"], "blocks": len(times["off"])}
    # the default of `Job` on CPU: lazy where a shard has another holder (no ring push), else
    # a full commit every step before it returns (overlap is the default on GPU)
    out["default_variant"] = "sync" if r0["ring"] else "lazy"
    for v in VARIANTS[1:]:
        per_block = [(a / b - 1) * 100 for a, b in zip(times[v], times["off"])]
        out[f"overhead_pct_{v}"] = round(statistics.median(per_block), 1)
        out[f"overhead_spread_{v}"] = [round(min(per_block), 1), round(max(per_block), 1)]
    out["phases_ms"] = {"copy": round(r0["copy_s"] * 1e3, 2),
                        "digest": round(r0["digest_s"] * 1e3, 2),
                        **{k: round(v * 1e3, 2) for k, v in r0["phases"].items()}}
    out["per_block_step_s"] = times
    return out
