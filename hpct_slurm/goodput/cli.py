"""`hpct-slurm goodput`: checkpoint-restart vs hpct-slurm goodput for one size, or a sweep."""
from __future__ import annotations

import argparse
import json
import math
from dataclasses import asdict
from pathlib import Path
from typing import Callable

# flag -> the key of defaults.json's failslow section it sets
FAILSLOW_FLAGS = {"failslow_per_node_hour": "per_node_hour", "failslow_slowdown": "slowdown",
                  "failslow_undetected_hours": "undetected_hours", "step_s": "step_s",
                  "failslow_window_steps": "window_steps",
                  "failslow_threshold": "threshold", "move_pause_s": "move_pause_s"}


def _bounded(lo: float, strict: bool, why: str, integer: bool = False) -> Callable[[str], float]:
    """An argparse type: a finite number >= lo (> lo if strict). argparse prefixes the flag to
    the message, so a bad value reads `argument --flag: 'value' must be ...: why`."""
    def parse(text: str) -> float:
        try:
            value = int(text) if integer else float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(
                f"{text!r} is not {'a whole number' if integer else 'a number'}") from None
        if not math.isfinite(value) or value < lo or (strict and value == lo):
            raise argparse.ArgumentTypeError(
                f"{text!r} must be a finite number {'>' if strict else '>='} {lo:g}: {why}")
        return value
    return parse


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
    fs = p.add_argument_group("fail-slow", "a node that keeps working but paces the whole job")
    fs.add_argument("--failslow-per-node-hour", type=_bounded(0, False, "a rate of episodes"),
                    default=None, help="fail-slow episodes per node-hour (0: no fail-slow term)")
    fs.add_argument("--failslow-slowdown",
                    type=_bounded(1, False, "the job's step time x this while a node is slow"),
                    default=None, help="the job's step time x this during an episode (>= 1)")
    fs.add_argument("--failslow-undetected-hours",
                    type=_bounded(0, True, "an episode lasts some time"), default=None,
                    help="how long an episode lasts when nothing moves the node out")
    fs.add_argument("--step-s", type=_bounded(0, True, "a step takes some time"), default=None,
                    help="the job's healthy step time, seconds (sets the detection time)")
    fs.add_argument("--failslow-window-steps", default=None,
                    type=_bounded(1, False, "the detector needs a step", integer=True),
                    help="steps the detector watches before it moves a node")
    fs.add_argument("--failslow-threshold",
                    type=_bounded(1, False, "a ratio to the job's median"), default=None,
                    help="the detector's ratio to the job's median")
    fs.add_argument("--move-pause-s", type=_bounded(0, False, "a pause is never negative"),
                    default=None, help="the planned move's pause, seconds")
    p.add_argument("--phases", action="append", default=[], metavar="FILE",
                   help="measured costs laid over the defaults, in order: a file shaped "
                        "like defaults.json, or `bench rendezvous` / `bench replication` / "
                        "`bench recovery` / `bench scale` / `bench move` output (repeatable)")
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
        hpct_ckpt_interval_min=args.hpct_ckpt_interval_min,
        failslow={key: getattr(args, flag) for flag, key in FAILSLOW_FLAGS.items()})
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
                         "ckpt_interval_min": params.ckpt_interval_min,
                         "failslow": asdict(params.failslow)}
        print(json.dumps(doc))
        return 0
    # slow: the fraction of wall time fail-slow episodes cost each scheme
    print(f"{'GPUs':>7} {'fail/h':>7} {'ckpt-restart':>12} {'recov':>8} {'slow':>6} "
          f"{'hpct':>7} {'recov':>7} {'slow':>6} {'spares':>6} {'fallback':>8}")
    for r in results:
        print(f"{r.gpus:>7} {r.failures_per_hour:>7.3f} {r.ckpt_restart_goodput:>12.1%} "
              f"{r.ckpt_restart_recovery_s / 60:>6.1f} m {r.ckpt_restart_failslow_loss:>6.2%} "
              f"{r.hpct_goodput:>7.1%} {r.hpct_recovery_s:>5.0f} s {r.hpct_failslow_loss:>6.2%} "
              f"{r.hpct_spares:>6} {r.hpct_fallback_fraction:>8.2%}")
    print(_failslow_line(params))
    if args.gpus is not None:
        print(f"hpct-slurm recovery at {args.gpus} GPUs, term by term:")
        for t in recovery_budget(args.gpus, params):
            print(f"  {t['term']:<16} {t['s']:>8.2f} s  {t['source']}")
    if args.plot is not None:
        print(f"plot: {args.plot}")
    return 0


def _failslow_line(params) -> str:
    """One line saying what a fail-slow episode costs each scheme, and why."""
    fs = params.failslow
    if fs.per_node_hour == 0:
        return "fail-slow: off (--failslow-per-node-hour 0)"
    head = (f"fail-slow: {fs.per_node_hour:g}/node-hour at {fs.slowdown:g}x; per episode "
            f"ckpt-restart loses {fs.undetected_lost_s():.0f} s ({fs.undetected_hours:g} h "
            f"until noticed), hpct-slurm ")
    if not fs.moved():
        return head + (f"the same: not moved (slowdown <= threshold {fs.threshold:g}, or over "
                       f"before {2 * fs.window_steps} steps)")
    src = params.measured.get("failslow.move_pause_s", "defaults.json")
    return head + (f"{fs.moved_lost_s():.1f} s with a spare (found in {fs.window_steps} + "
                   f"{fs.window_steps} steps = {fs.detect_s():.0f} s, move {fs.move_pause_s:g} "
                   f"s from {src})")
