"""What a survivor's time from fault to ready is made of (issue 15, item 1), measured in
`WORLD` local processes of a real gloo group (no Slurm): each builds the benchmark's model
(`--quick`: a small one) and Adam, the last rank is SIGKILLed between two allreduces, and each
survivor times, after its collective failed, the parts of the old `Job._recover`:
capture (copy the live state into the snapshot slot), gc.collect, destroy the group,
gc.collect again, the health check, and one part digest of the state. Twice: as before, and with
what existed at startup frozen out of the collector's sight (`gc.freeze()`, what `Job._start`
does now). The summary: the median over survivors of each part, per mode.
"""
from __future__ import annotations

import datetime
import gc
import multiprocessing as mp
import os
import signal
import statistics
import time
from pathlib import Path
from typing import Any

from .common import free_port, plot_bars, write_result

NAME = "teardown"
WORLD = 4
PARTS = ("capture_s", "gc_before_destroy_s", "destroy_s", "gc_after_destroy_s", "health_s",
         "hash_state_s")


def _rank(rank: int, port: int, hidden: int, layers: int, freeze: bool, q: Any) -> None:
    import torch
    import torch.distributed as dist

    from ..examples.train import build
    from ..recovery.health import health_check
    from ..recovery.snapshot import SnapshotStore
    from ..recovery.state import TrainState

    torch.set_num_threads(1)
    model, opt = build(hidden, layers)
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    opt.step()  # Adam's moments exist
    snaps = SnapshotStore(TrainState(model=model, optimizer=opt), scopes=("shared",))
    snaps.commit(0)
    if freeze:
        gc.freeze()
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=WORLD, timeout=datetime.timedelta(seconds=10))
    x = torch.ones(1 << 16)
    dist.all_reduce(x)
    if rank == WORLD - 1:
        os.kill(os.getpid(), signal.SIGKILL)
    try:
        for _ in range(1000):
            dist.all_reduce(x)
        q.put((rank, "the collective never failed", {}))
        return
    except RuntimeError:
        pass
    t: dict[str, float] = {}

    def timed(name: str, fn: Any) -> None:
        t0 = time.perf_counter()
        fn()
        t[name] = time.perf_counter() - t0

    timed("capture_s", lambda: (snaps.prepare_lazy(1), snaps.finish_pending()))
    timed("gc_before_destroy_s", gc.collect)
    timed("destroy_s", dist.destroy_process_group)
    timed("gc_after_destroy_s", gc.collect)
    timed("health_s", health_check)
    with snaps.lease(1) as snap:
        timed("hash_state_s", snap.digest)
    q.put((rank, "", t))



def _once(hidden: int, layers: int, freeze: bool) -> list[dict[str, float]]:
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_rank, args=(r, port, hidden, layers, freeze, q), daemon=True)
             for r in range(WORLD)]
    for p in procs:
        p.start()
    try:
        got = [q.get(timeout=300) for _ in range(WORLD - 1)]
    finally:
        for p in procs:
            p.join(30)
            if p.is_alive():
                p.kill()
    errors = [e for _, e, _ in got if e]
    if errors:
        from ..errors import HpctError
        raise HpctError(f"teardown benchmark: {errors[0]}")
    return [t for _, _, t in got]


def run(out_dir: Path, quick: bool = False, smoke: bool = False) -> dict:
    """`quick`/`smoke`: a 256-wide model (the parts then mean little; gc's share is the same
    order, since it scans torch's objects, not the model's bytes)."""
    from .recovery import FULL, QUICK

    cfg = QUICK if (quick or smoke) else FULL
    per_mode = {mode: _once(cfg.hidden, cfg.layers, freeze=mode == "frozen")
                for mode in ("as_before", "frozen")}
    med = {mode: {p: round(statistics.median(r[p] for r in rows), 4) for p in PARTS}
           for mode, rows in per_mode.items()}
    gc_s = {mode: round(m["gc_before_destroy_s"] + m["gc_after_destroy_s"], 4)
            for mode, m in med.items()}
    summary = {"bench": NAME, "world": WORLD, "hidden": cfg.hidden, "layers": cfg.layers,
               "gc_s": gc_s,
               "old_ready_path_s": {mode: round(sum(m[p] for p in PARTS[:5]), 4)
                                    for mode, m in med.items()},
               "parts": med}
    write_result(out_dir, NAME, {**summary, "quick": quick, "smoke": smoke,
                                 "per_survivor": per_mode, "method": __doc__})
    labels = [f"{p.removesuffix('_s')}\n{mode}" for p in PARTS for mode in med]
    plot_bars(Path(out_dir) / f"{NAME}.png", labels, [med[mode][p] for p in PARTS for mode in med],
              "seconds (median over survivors)",
              f"survivor fault -> ready, {WORLD} gloo ranks, one SIGKILLed")
    return summary
