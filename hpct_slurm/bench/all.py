"""`hpct-slurm bench all`: every benchmark of issue 8 in one go, then a table.

Each benchmark writes its own `<out>/<name>.json` (with the machine it ran on) and PNG; this
one adds `<out>/all.json` with every summary and how long each took. One benchmark failing
does not stop the others: its error is recorded, the table shows it, and the command exits 1.
"""
from __future__ import annotations

import datetime
import importlib
import time
import traceback
from pathlib import Path

from .common import write_result
from .recovery import BENCH_ROOT

NAME = "all"
# (benchmark, quick even in a full `bench all`): the rendezvous sweep's full mode goes to 64
# ranks, which on a small machine measures memory pressure more than rendezvous.
SUITE = (("rendezvous", True), ("replication", False), ("transfer", False), ("teardown", False),
         ("gradients", False), ("cache", False), ("proof", False), ("recovery", False))
CLUSTER = {"recovery"}


def table(results: dict[str, dict]) -> str:
    """One line per benchmark: its summary's numbers (or its error) and how long it took."""
    lines = [f"{'benchmark':12} {'wall s':>7}  summary"]
    for name, r in results.items():
        if "error" in r:
            body = f"FAILED: {r['error']}"
        else:
            body = "  ".join(f"{k}={v}" for k, v in r["summary"].items()
                             if k != "bench" and not isinstance(v, (dict, list)))
        lines.append(f"{name:12} {r['wall_s']:7.1f}  {body}")
    return "\n".join(lines)


def exit_code(summary: dict) -> int:
    """`hpct-slurm bench all`'s exit status: 1 when any benchmark failed (its error is in the
    table and all.json), else 0."""
    return 1 if summary.get("failed") else 0


def _goodput(out_dir: Path) -> dict:
    """The goodput model fed with this run's own measurements (rendezvous re-form curve,
    replication overhead, recovery phases): results/goodput.json and goodput.png."""
    from ..goodput.model import load_params, sweep
    from ..goodput.plot import plot_goodput

    t0 = time.monotonic()
    files = [str(out_dir / f"{n}.json") for n in ("rendezvous", "replication", "recovery")
             if (out_dir / f"{n}.json").exists()]
    try:
        points = sweep(load_params(files))
        plot_goodput(out_dir / "goodput.png", points, mark=2304)
        at = next((r for r in points if r.gpus == 2304), points[-1])
        summary = {"bench": "goodput", "gpus": at.gpus, "hpct_goodput": at.hpct_goodput,
                   "ckpt_restart_goodput": at.ckpt_restart_goodput, "measured_from": files}
        write_result(out_dir, "goodput", {"summary": summary,
                                          "sweep": [r.to_dict() for r in points]})
        return {"summary": summary, "quick": False, "wall_s": time.monotonic() - t0}
    except Exception as exc:  # noqa: BLE001 — reported like any failed benchmark
        return {"error": f"{type(exc).__name__}: {exc}", "traceback": traceback.format_exc(),
                "wall_s": time.monotonic() - t0}


def run(out_dir: Path, quick: bool = False, root: Path = BENCH_ROOT,
        down: bool = False) -> dict:
    """Run the suite into `out_dir`; `root`/`down` go to the cluster benchmarks (the cluster is
    taken down after the last of them when `down`). Prints the table; returns every summary."""
    out_dir = Path(out_dir)
    results: dict[str, dict] = {}
    for name, always_quick in SUITE:
        module = importlib.import_module(f"hpct_slurm.bench.{name}")
        kwargs = {"root": root, "down": down} if name in CLUSTER else {}
        t0 = time.monotonic()
        try:
            summary = module.run(out_dir, quick=quick or always_quick, **kwargs)
            results[name] = {"summary": summary, "quick": quick or always_quick}
        except Exception as exc:  # noqa: BLE001 — one failure must not hide the other results
            results[name] = {"error": f"{type(exc).__name__}: {exc}",
                             "traceback": traceback.format_exc()}
        results[name]["wall_s"] = time.monotonic() - t0
    results["goodput"] = _goodput(out_dir)
    print(table(results), flush=True)
    write_result(out_dir, NAME, {
        "results": results, "quick": quick,
        "when": datetime.datetime.now(datetime.timezone.utc).isoformat()})
    return {"bench": NAME,
            "ok": [n for n, r in results.items() if "error" not in r],
            "failed": [n for n, r in results.items() if "error" in r],
            "summaries": {n: r["summary"] for n, r in results.items() if "summary" in r}}
