"""Shared-memory data cache: cold load vs warm re-attach, and host memory of per-rank loaders
vs the shared cache, measured side by side in one run.

Cold: what a rank pays without a cache (read the raw data from disk, preprocess it) plus
writing the result into the node's shm. Re-attach: a fresh process mapping the warm cache, what
a restarted rank or a spare pays. Memory: RANKS processes each loading their own copy (private
anonymous memory) against RANKS processes attaching to one cache (the cache's shm pages + each
rank's private growth), while all of them hold their data.
"""
from __future__ import annotations

import multiprocessing as mp
import shutil
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

from .common import write_result

RANKS = 4
ROW = 3072  # a 32x32x3 image


def _anon_kb() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("RssAnon:"):
            return int(line.split()[1])
    return 0


def _preprocess(raw_path: str) -> dict[str, np.ndarray]:
    raw = np.load(raw_path)
    x = raw.astype(np.float32) / np.float32(255.0)
    x -= x.mean(axis=0)
    x /= x.std(axis=0) + np.float32(1e-6)
    return {"x": x, "ids": np.arange(len(x), dtype=np.int64)}


def _du(path: Path) -> int:
    return sum(p.lstat().st_blocks * 512 for p in path.rglob("*"))


def _own_copy(raw_path: str, barrier: Any, out: Any) -> None:
    before = _anon_kb()
    data = _preprocess(raw_path)
    out.put({"anon": (_anon_kb() - before) * 1024, "checksum": float(data["x"][::97].sum())})
    barrier.wait(300)  # hold the copy while the others measure
    barrier.wait(300)


def _shared(raw_path: str, cache_dir: str, barrier: Any, out: Any) -> None:
    from ..cache.store import SharedCache

    before = _anon_kb()
    t0 = time.perf_counter()
    entry = SharedCache(cache_dir).get("train", lambda: _preprocess(raw_path))
    get_s = time.perf_counter() - t0
    checksum = float(entry.arrays["x"][::97].sum())  # touch: the rank really reads it
    out.put({"anon": (_anon_kb() - before) * 1024, "built": entry.built, "get_s": get_s,
             "checksum": checksum})
    barrier.wait(300)
    barrier.wait(300)


def _reattach(cache_dir: str, out: Any) -> None:
    from ..cache.store import SharedCache

    t0 = time.perf_counter()
    entry = SharedCache(cache_dir).get("train", lambda: (_ for _ in ()).throw(
        RuntimeError("re-attach must not rebuild")))
    out.put({"attach_s": time.perf_counter() - t0, "built": entry.built})


def _group(ctx: Any, target: Any, args: tuple, measure: Any) -> tuple[list[dict], Any]:
    barrier, out = ctx.Barrier(RANKS + 1), ctx.Queue()
    procs = [ctx.Process(target=target, args=(*args, barrier, out)) for _ in range(RANKS)]
    for p in procs:
        p.start()
    try:
        barrier.wait(600)
        measured = measure()
        reports = [out.get(timeout=60) for _ in range(RANKS)]
        barrier.wait(60)
    finally:
        for p in procs:
            p.join(60)
    return reports, measured


def _cold(ctx: Any, raw_path: str, cache_dir: Path) -> float:
    """One rank alone building a cache from nothing, in a fresh process."""
    out = ctx.Queue()
    barrier = ctx.Barrier(1)
    p = ctx.Process(target=_shared, args=(raw_path, str(cache_dir), barrier, out))
    p.start()
    report = out.get(timeout=600)
    p.join(60)
    if not report["built"]:
        raise RuntimeError(f"cold run attached to an existing cache in {cache_dir}")
    return report["get_s"]


def run(out_dir: Path, quick: bool = False, smoke: bool = False) -> dict:
    """`smoke`: 4 MB, one cold load, two re-attaches: checks the command works; its numbers
    mean nothing."""
    mb = 4 if smoke else 32 if quick else 256
    rows = (mb << 20) // (ROW * 4)
    repeats = 1 if smoke else 2 if quick else 3
    ctx = mp.get_context("fork")
    work = Path(tempfile.mkdtemp(prefix="hpct-bench-cache-"))
    shm = Path(tempfile.mkdtemp(prefix="hpct-bench-cache-", dir="/dev/shm"))
    try:
        raw_path = str(work / "raw.npy")
        np.save(raw_path, np.random.default_rng(0).integers(0, 256, (rows, ROW), np.uint8))

        cold_s = []
        for i in range(repeats):
            d = shm / f"cold{i}"
            d.mkdir()
            cold_s.append(_cold(ctx, raw_path, d))
            shutil.rmtree(d)
        reattach_s = []
        warm = shm / "warm"
        warm.mkdir()
        _cold(ctx, raw_path, warm)
        for _ in range(2 if smoke else 5 if quick else 10):
            out = ctx.Queue()
            p = ctx.Process(target=_reattach, args=(str(warm), out))
            p.start()
            r = out.get(timeout=60)
            p.join(60)
            reattach_s.append(r["attach_s"])
        shutil.rmtree(warm)

        own, _ = _group(ctx, _own_copy, (raw_path,), lambda: None)
        shared_dir = shm / "shared"
        shared_dir.mkdir()
        shared, shm_bytes = _group(ctx, _shared, (raw_path, str(shared_dir)),
                                   lambda: _du(shared_dir))
    finally:
        shutil.rmtree(work, ignore_errors=True)
        shutil.rmtree(shm, ignore_errors=True)

    nbytes = rows * ROW * 4 + rows * 8
    own_total = sum(max(0, r["anon"]) for r in own)
    # host memory for the data: shm pages + every rank's private growth (the builder's
    # includes what preprocessing left on its heap, as each per-rank loader's does)
    shared_total = shm_bytes + sum(max(0, r["anon"]) for r in shared)
    cold, reattach = statistics.median(cold_s), statistics.median(reattach_s)
    data = {
        "dataset_mb": round(nbytes / 2**20, 1), "ranks": RANKS, "quick": quick, "smoke": smoke,
        "cold_s": [round(x, 4) for x in cold_s], "reattach_s": [round(x, 6) for x in reattach_s],
        "cold_median_s": round(cold, 4), "reattach_median_s": round(reattach, 6),
        "per_rank_loaders_mb": round(own_total / 2**20, 1),
        "shared_cache_mb": round(shared_total / 2**20, 1),
        "shared_cache_shm_mb": round(shm_bytes / 2**20, 1),
        "builders": sum(bool(r["built"]) for r in shared),
        "same_data": len({r["checksum"] for r in own + shared}) == 1,
    }
    summary = {"bench": "cache", "reattach_over_cold": round(reattach / cold, 5),
               "copies_per_node": round(shared_total / nbytes, 3),
               "shm_copies_per_node": round(shm_bytes / nbytes, 3),
               "per_rank_copies_per_node": round(own_total / nbytes, 3),
               "memory_shared_over_per_rank": round(shared_total / own_total, 3),
               "goal_reattach_le_2pct": reattach / cold <= 0.02}
    write_result(out_dir, "cache", {**data, "summary": summary})
    _plot(out_dir / "cache.png", data)
    return summary


def _plot(path: Path, data: dict) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(9, 3.5))
    bars = a.bar(["cold load", "warm re-attach"],
                 [data["cold_median_s"] * 1e3, data["reattach_median_s"] * 1e3],
                 color=["#c44e52", "#55a868"])
    a.bar_label(bars, fmt="%.3g ms")
    a.set_yscale("log")
    a.set_ylabel("ms (median, log scale)")
    a.set_title(f"{data['dataset_mb']:.0f} MB dataset")
    bars = b.bar([f"{data['ranks']} per-rank loaders", "shared cache"],
                 [data["per_rank_loaders_mb"], data["shared_cache_mb"]],
                 color=["#c44e52", "#55a868"])
    b.bar_label(bars, fmt="%.0f MB")
    b.set_ylabel("host memory for the data (MB)")
    b.set_title(f"{data['ranks']} ranks on one node")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
