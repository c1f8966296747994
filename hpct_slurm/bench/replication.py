"""Steady-state cost of keeping a peer replica, as % of step time (~100 MB of state).

An MLP with Adam (params + two moments ~ 100 MB) trains in this process; a child process plays
the ring peer (a `TransferServer` holding replicas). Blocks of steps alternate between three
variants in one run, so all see the same machine: `off` (no snapshots), `snapshot` (commit into
the double-buffered store after every step) and `replicated` (commit + background push to the
peer, with its backpressure). Overheads are relative to `off`.
"""
from __future__ import annotations

import multiprocessing as mp
import secrets
import statistics
import time
from pathlib import Path
from typing import Any

from .common import plot_bars, write_result

JOB = "bench"
VARIANTS = ("off", "snapshot", "replicated")


def _peer(conn: Any, secret: bytes) -> None:
    from ..recovery.snapshot import ReplicaStore
    from ..recovery.transfer import TransferServer
    with TransferServer(secret, JOB, 1, replicas=ReplicaStore()) as srv:
        conn.send(srv.address)
        conn.recv()


def run(out_dir: Path, quick: bool = False) -> dict:
    import torch

    from ..recovery.snapshot import SnapshotStore
    from ..recovery.state import TrainState
    from ..recovery.transfer import ReplicaPusher

    width, depth = (1024, 2) if quick else (1440, 4)
    block, rounds = (5, 2) if quick else (10, 4)
    torch.manual_seed(0)
    layers: list[torch.nn.Module] = []
    for _ in range(depth):
        layers += [torch.nn.Linear(width, width), torch.nn.ReLU()]
    model = torch.nn.Sequential(*layers)
    opt = torch.optim.Adam(model.parameters(), lr=1e-4)
    state = TrainState(model=model, optimizer=opt)
    store = SnapshotStore(state)
    x = torch.randn(64, width)

    def train_step() -> None:
        opt.zero_grad()
        model(x).pow(2).mean().backward()
        opt.step()

    secret = secrets.token_bytes(32)
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=_peer, args=(child, secret), daemon=True)
    proc.start()
    times: dict[str, list[float]] = {v: [] for v in VARIANTS}
    step = 0
    try:
        pusher = ReplicaPusher(store, 0, tuple(parent.recv()), secret, JOB)
        train_step()
        step += 1
        store.commit(step)
        pusher.after_commit(step)  # warm-up: allocates both slots and the peer's replica buffers
        pusher.flush()
        for rnd in range(rounds + 1):  # round 0 is warm-up, not recorded
            for variant in VARIANTS:
                t_block = time.perf_counter()
                for _ in range(block):
                    train_step()
                    step += 1
                    if variant != "off":
                        store.commit(step)
                    if variant == "replicated":
                        pusher.after_commit(step)
                if variant == "replicated":
                    pusher.flush()  # the block pays for every push it started
                if rnd:
                    times[variant].append((time.perf_counter() - t_block) / block)
        acked = pusher.acked_step
        pusher.close()
        parent.send("stop")
    finally:
        proc.join(30)
        if proc.is_alive():
            proc.kill()
    step_s = {v: statistics.median(t) for v, t in times.items()}
    pct = {v: round((step_s[v] / step_s["off"] - 1) * 100, 1) for v in VARIANTS}
    nbytes = store.latest().layout.nbytes
    summary = {"bench": "replication", "overhead_pct": pct["replicated"],
               "snapshot_only_overhead_pct": pct["snapshot"],
               "step_ms": {v: round(s * 1e3, 2) for v, s in step_s.items()},
               "state_mb": round(nbytes / 1e6, 1)}
    write_result(out_dir, "replication", {**summary, "block_steps": block, "rounds": rounds,
                                          "last_acked_step": acked, "per_block_step_s": times})
    plot_bars(Path(out_dir) / "replication.png", list(VARIANTS),
              [step_s[v] * 1e3 for v in VARIANTS], "ms / step",
              f"Step time with {nbytes / 1e6:.0f} MB of state")
    return summary
