"""`hpct-slurm bench NAME`: run one benchmark and print its summary as the last line (JSON).

Exit status: 0 on success; non-zero when the benchmark failed (it raises), and 1 when
`bench all` recorded a failed benchmark."""
from __future__ import annotations

import argparse
import importlib
import json
from pathlib import Path

from ..errors import HpctError

# Each name is a module `hpct_slurm.bench.<name>` exposing `run(out_dir, quick=False) -> dict`.
BENCHMARKS = ["rendezvous", "replication", "transfer", "teardown", "gradients", "cache", "proof",
              "recovery", "zoo", "move", "failslow",
              "stress", "second_fault", "scale", "store_scale", "gpu", "peers",
              "all"]
# These run on a local Slurm cluster: their `run` also takes `root` and `down`.
CLUSTER_BENCHMARKS = {"recovery", "zoo", "move", "failslow", "stress", "second_fault", "peers", "all"}
# These need no cluster; their `run` also takes `smoke` (smallest sizes, to check the command).
SMOKE_BENCHMARKS = {"rendezvous", "replication", "transfer", "teardown", "gradients", "cache",
                    "proof"}
# These need a CUDA device (scripts/gpu-check.sh runs them); `--smoke` applies to them too.
GPU_BENCHMARKS = {"gpu"}
DEFAULT_CLUSTER_ROOT = "/tmp/hpct-bench-cluster"


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("bench", help="run a benchmark and print its summary")
    p.add_argument("name", metavar="NAME", help=f"one of: {', '.join(BENCHMARKS)}")
    p.add_argument("--out", default="results", help="directory for <NAME>.json and plots")
    p.add_argument("--quick", action="store_true", help="smaller sizes, fewer repetitions")
    p.add_argument("--root", default=DEFAULT_CLUSTER_ROOT,
                   help=f"local cluster root for {', '.join(sorted(CLUSTER_BENCHMARKS))} "
                        f"(brought up if needed; default {DEFAULT_CLUSTER_ROOT})")
    p.add_argument("--down", action="store_true",
                   help="take that cluster down at the end (default: leave it up)")
    p.add_argument("--smoke", action="store_true",
                   help=f"{', '.join(sorted(SMOKE_BENCHMARKS))} only: the smallest sizes, "
                        f"one repetition; checks the command works, its numbers mean nothing")
    p.add_argument("--sizes", type=_sizes, default=None, metavar="N,N,...",
                   help="rendezvous only: rank counts to sweep (default 4,16 with --quick, "
                        "else 4,16,32,64)")
    p.add_argument("--reps", type=int, default=None, metavar="R",
                   help="rendezvous: formations per size and store (default 3; below 16 "
                        "ranks, times 16 // ranks); replication: rounds of every variant's "
                        "blocks (default 5)")
    p.add_argument("--ranks", type=_ranks, default=None, metavar="N,N,...",
                   help="scale only: simulated rank counts, multiples of 8 (default 2304; "
                        "256 with --quick)")
    p.add_argument("--step-s", type=float, default=None, metavar="S",
                   help="scale only: the simulated ranks' step time (default 1.0)")
    p.set_defaults(func=main)


def _sizes(text: str) -> list[int]:
    try:
        sizes = [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a comma-separated list of rank "
                                         f"counts") from None
    if not sizes or min(sizes) < 2:
        raise argparse.ArgumentTypeError(f"{text!r}: every size must be at least 2 ranks")
    return sizes


def _ranks(text: str) -> list[int]:
    try:
        ranks = [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a comma-separated list of rank "
                                         f"counts") from None
    if not ranks or any(n < 8 or n % 8 for n in ranks):
        raise argparse.ArgumentTypeError(f"{text!r}: every rank count must be a positive "
                                         f"multiple of 8 (simulated nodes of 8)")
    return ranks


def main(args: argparse.Namespace) -> int:
    if args.name not in BENCHMARKS:
        raise HpctError(f"benchmark '{args.name}' is unknown; choose one of {', '.join(BENCHMARKS)}")
    sweep = {k: v for k, v in (("sizes", getattr(args, "sizes", None)),
                               ("reps", getattr(args, "reps", None))) if v is not None}
    if "sizes" in sweep and args.name != "rendezvous":
        raise HpctError("--sizes only applies to the rendezvous benchmark")
    if "reps" in sweep and args.name not in ("rendezvous", "replication"):
        raise HpctError("--reps only applies to the rendezvous and replication benchmarks")
    if sweep.get("reps", 1) < 1:
        raise HpctError(f"--reps {sweep['reps']} must be at least 1")
    scale = {k: v for k, v in (("ranks", getattr(args, "ranks", None)),
                               ("step_s", getattr(args, "step_s", None))) if v is not None}
    if scale and args.name != "scale":
        raise HpctError("--ranks/--step-s only apply to the scale benchmark")
    if scale.get("step_s", 1.0) <= 0:
        raise HpctError(f"--step-s {scale['step_s']} must be a positive number of seconds")
    sweep.update(scale)
    smoke = getattr(args, "smoke", False)
    if smoke and args.name not in SMOKE_BENCHMARKS | GPU_BENCHMARKS:
        raise HpctError(f"--smoke only applies to "
                        f"{', '.join(sorted(SMOKE_BENCHMARKS | GPU_BENCHMARKS))}")
    module = importlib.import_module(f"hpct_slurm.bench.{args.name}")
    extra = {"root": Path(args.root), "down": args.down} if args.name in CLUSTER_BENCHMARKS \
        else {}
    extra.update(sweep)
    if smoke:
        extra["smoke"] = True
    summary = module.run(Path(args.out), quick=args.quick, **extra)
    print(json.dumps(summary))
    # A benchmark that fails raises; `all` records failures and carries on, so it says how
    # the suite went through its exit status.
    exit_code = getattr(module, "exit_code", None)
    return exit_code(summary) if exit_code is not None else 0
