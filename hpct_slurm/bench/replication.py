"""Steady-state cost of recoverability, as % of step time (~100 MB of model + Adam state).

An MLP with Adam trains in this process; a child process plays the ring peer (a
`TransferServer` holding replicas). Blocks of steps alternate between the variants in one run,
so all see the same machine; overheads are relative to `off` (no snapshots):

- `jit_k1`: what `Job` does by default: commit the shared state after every step (a copy; the
  digest is left to its first reader), no pushes.
- `jit_k1_sealed`: the same with `background_seal=True` (each commit hashed right away).
- `jit_kK`: the same as `jit_k1`, committing every K steps (`HPCT_SNAPSHOT_EVERY=K`).
- `replicated_k1` / `replicated_kK`: commit + push to the peer every 1 / K steps (sharded setups).

Each block pays for what it started: pushes are flushed and, with background sealing, the last
commit's seal awaited before the clock stops. The summary's `overhead_pct` is the default mode
(`jit_k1`); `min_k_for_3pct` is the smallest commit interval whose measured per-commit cost
fits in 3%.
"""
from __future__ import annotations

import math
import multiprocessing as mp
import secrets
import statistics
import time
from pathlib import Path
from typing import Any

from .common import plot_bars, write_result

JOB = "bench"
BUDGET_PCT = 3.0


def _peer(conn: Any, secret: bytes) -> None:
    from ..recovery.snapshot import ReplicaStore
    from ..recovery.transfer import TransferServer
    with TransferServer(secret, JOB, 1, replicas=ReplicaStore()) as srv:
        conn.send(srv.address)
        conn.recv()


def run(out_dir: Path, quick: bool = False, smoke: bool = False) -> dict:
    """`smoke`: the smallest run that goes through every variant (a few MB, one round), to
    check the command works; its numbers mean nothing."""
    import torch

    from ..recovery.snapshot import DEFAULT_SNAPSHOT_EVERY, Snapshot, SnapshotStore
    from ..recovery.state import TrainState
    from ..recovery.transfer import ReplicaPusher

    width, depth = (256, 2) if smoke else (1024, 2) if quick else (1440, 4)
    k, rounds = (4, 1) if smoke else (8, 2) if quick else (16, 4)
    block = k  # one commit per block at every=K, so every block does the same work
    torch.manual_seed(0)
    layers: list[torch.nn.Module] = []
    for _ in range(depth):
        layers += [torch.nn.Linear(width, width), torch.nn.ReLU()]
    model = torch.nn.Sequential(*layers)
    opt = torch.optim.Adam(model.parameters(), lr=1e-4)
    state = TrainState(model=model, optimizer=opt)
    x = torch.randn(64, width)
    # (store, push?) per variant; jit keeps the shared scope only, as `Job` does.
    stores = {"jit_k1": (SnapshotStore(state, ("shared",), every=1), False),
              "jit_k1_sealed": (SnapshotStore(state, ("shared",), every=1, background_seal=True),
                                False),
              f"jit_k{k}": (SnapshotStore(state, ("shared",), every=k), False),
              "replicated_k1": (SnapshotStore(state, every=1), True),
              f"replicated_k{k}": (SnapshotStore(state, every=k), True)}
    variants = ["off", *stores]
    default = f"jit_k{DEFAULT_SNAPSHOT_EVERY}"

    def train_step() -> None:
        opt.zero_grad()
        model(x).pow(2).mean().backward()
        opt.step()

    def settle(snap: Snapshot | None) -> None:
        while snap is not None and not snap.sealed and not snap.superseded.is_set():
            time.sleep(0.001)

    secret = secrets.token_bytes(32)
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=_peer, args=(child, secret), daemon=True)
    proc.start()
    times: dict[str, list[float]] = {v: [] for v in variants}
    commit_s: list[float] = []
    step = 0
    try:
        peer = tuple(parent.recv())
        pushers = {v: ReplicaPusher(store, 0, peer, secret, JOB)
                   for v, (store, push) in stores.items() if push}
        train_step()
        for v, (store, _) in stores.items():  # warm-up: both slots and the peer's buffers
            for _ in range(2):
                step += 1
                store.commit(step)
                if v in pushers:
                    pushers[v].after_commit(step)
                    pushers[v].flush()
        for rnd in range(rounds + 1):  # round 0 is warm-up, not recorded
            for variant in variants:
                store, push = stores.get(variant, (None, False))
                last = None
                t_block = time.perf_counter()
                for _ in range(block):
                    train_step()
                    step += 1
                    if store is not None and store.due(step):
                        t0 = time.perf_counter()
                        last = store.commit(step)
                        if variant == "jit_k1" and rnd:
                            commit_s.append(time.perf_counter() - t0)
                        if push:
                            pushers[variant].after_commit(step)
                if push:
                    pushers[variant].flush()
                if store is not None and store.background_seal:
                    settle(last)
                if rnd:
                    times[variant].append((time.perf_counter() - t_block) / block)
        acked = {v: p.acked_step for v, p in pushers.items()}
        for p in pushers.values():
            p.close()
        parent.send("stop")
    finally:
        proc.join(30)
        if proc.is_alive():
            proc.kill()
    step_s = {v: statistics.median(t) for v, t in times.items()}
    pct = {v: round((step_s[v] / step_s["off"] - 1) * 100, 1) for v in variants}
    commit_ms = statistics.median(commit_s) * 1e3
    nbytes = stores["jit_k1"][0].latest().layout.nbytes  # type: ignore[union-attr]
    summary = {"bench": "replication", "overhead_pct": pct[default], "default_mode": default,
               "overhead_pct_by_mode": pct,
               "min_k_for_3pct": max(1, math.ceil(commit_ms / (BUDGET_PCT / 100 * step_s["off"] * 1e3))),
               "commit_ms": round(commit_ms, 2),
               "step_ms": {v: round(s * 1e3, 2) for v, s in step_s.items()},
               "state_mb": round(nbytes / 1e6, 1)}
    write_result(out_dir, "replication", {**summary, "quick": quick, "smoke": smoke, "k": k,
                                          "block_steps": block,
                                          "rounds": rounds, "last_acked_step": acked,
                                          "per_block_step_s": times})
    plot_bars(Path(out_dir) / "replication.png", variants, [step_s[v] * 1e3 for v in variants],
              "ms / step", f"Step time with {nbytes / 1e6:.0f} MB of state (K={k})")
    return summary
