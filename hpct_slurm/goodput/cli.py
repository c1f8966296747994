"""`hpct-slurm goodput`: checkpoint-restart vs hpct-slurm goodput for one size, or a sweep."""
from __future__ import annotations

import argparse
import json
from dataclasses import asdict
from pathlib import Path


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("goodput", help="goodput model: checkpoint-restart vs hpct-slurm",
                       description="Fraction of wall time doing useful, non-recomputed "
                                   "training, for checkpoint-restart and for hpct-slurm. "
                                   "Defaults and their sources: hpct_slurm/goodput/defaults.json.")
    p.add_argument("--gpus", type=int, default=None,
                   help="GPUs of the job (default: the sweep 16..100k)")
    p.add_argument("--gpus-per-node", type=int, default=None)
    p.add_argument("--node-fail-per-hour", type=float, default=None,
                   help="probability that a given node fails within an hour")
    p.add_argument("--ckpt-interval-min", type=float, default=None,
                   help="checkpoint-restart's checkpoint interval, minutes")
    p.add_argument("--ckpt-stall-s", type=float, default=None,
                   help="training stall per checkpoint, seconds")
    p.add_argument("--spares", type=int, default=None,
                   help="spare nodes per job (default: 1%% of its nodes, at least 1)")
    p.add_argument("--spare-refill-hours", type=float, default=None,
                   help="hours until a used spare is replaced")
    p.add_argument("--replication-overhead", type=float, default=None,
                   help="hpct-slurm per-step replication cost, fraction of a step")
    p.add_argument("--hpct-ckpt-interval-min", type=float, default=None,
                   help="hpct-slurm's fallback checkpoint interval (default: Young/Daly for "
                        "the fallback rate)")
    p.add_argument("--phases", action="append", default=[], metavar="FILE",
                   help="measured costs laid over the defaults, in order: a file shaped "
                        "like defaults.json, or `bench rendezvous` / `bench replication` / "
                        "`bench recovery` / `bench scale` output (repeatable)")
    p.add_argument("--json", action="store_true", help="one JSON object on stdout")
    p.add_argument("--plot", type=Path, default=None, help="write goodput vs GPUs to a PNG")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from .model import evaluate, load_params, recovery_budget, sweep

    params = load_params(
        args.phases, gpus_per_node=args.gpus_per_node,
        node_fail_per_hour=args.node_fail_per_hour, ckpt_interval_min=args.ckpt_interval_min,
        ckpt_stall_s=args.ckpt_stall_s, spares=args.spares,
        spare_refill_hours=args.spare_refill_hours,
        replication_overhead=args.replication_overhead,
        hpct_ckpt_interval_min=args.hpct_ckpt_interval_min)
    results = [evaluate(args.gpus, params)] if args.gpus is not None else sweep(params)
    if args.plot is not None:
        from .plot import plot_goodput

        plot_goodput(args.plot, sweep(params), mark=args.gpus)
    if args.json:
        doc = results[0].to_dict() if args.gpus is not None else \
            {"sweep": [r.to_dict() for r in results]}
        if args.gpus is not None:
            budget = recovery_budget(args.gpus, params)
            doc["hpct_recovery_terms"] = budget
            doc["assumed_terms"] = [t["term"] for t in budget
                                    if not t["source"].startswith("measured")]
        doc["params"] = {"reform": asdict(params.hpct.reform),
                         "ckpt_restart_rendezvous": asdict(params.ckpt_restart.rendezvous),
                         "replication_overhead": params.replication_overhead,
                         "node_fail_per_hour": params.node_fail_per_hour,
                         "ckpt_interval_min": params.ckpt_interval_min}
        print(json.dumps(doc))
        return 0
    print(f"{'GPUs':>7} {'fail/h':>7} {'ckpt-restart':>12} {'recov':>8} "
          f"{'hpct':>7} {'recov':>7} {'spares':>6} {'fallback':>8}")
    for r in results:
        print(f"{r.gpus:>7} {r.failures_per_hour:>7.3f} {r.ckpt_restart_goodput:>12.1%} "
              f"{r.ckpt_restart_recovery_s / 60:>6.1f} m {r.hpct_goodput:>7.1%} "
              f"{r.hpct_recovery_s:>5.0f} s {r.hpct_spares:>6} {r.hpct_fallback_fraction:>8.2%}")
    if args.gpus is not None:
        print(f"hpct-slurm recovery at {args.gpus} GPUs, term by term:")
        for t in recovery_budget(args.gpus, params):
            print(f"  {t['term']:<16} {t['s']:>8.2f} s  {t['source']}")
    if args.plot is not None:
        print(f"plot: {args.plot}")
    return 0
