"""`hpct-slurm bench NAME`: run one benchmark and print its summary as the last line (JSON)."""
from __future__ import annotations

import argparse
import importlib
import json
from pathlib import Path

from ..errors import HpctError

# Each name is a module `hpct_slurm.bench.<name>` exposing `run(out_dir, quick=False) -> dict`.
BENCHMARKS = ["rendezvous", "replication", "transfer", "cache", "recovery", "stress", "all"]
# These run on a local Slurm cluster: their `run` also takes `root` and `down`.
CLUSTER_BENCHMARKS = {"recovery", "stress", "all"}
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
    p.set_defaults(func=main)


def main(args: argparse.Namespace) -> int:
    if args.name not in BENCHMARKS:
        raise HpctError(f"benchmark '{args.name}' is unknown; choose one of {', '.join(BENCHMARKS)}")
    module = importlib.import_module(f"hpct_slurm.bench.{args.name}")
    extra = {"root": Path(args.root), "down": args.down} if args.name in CLUSTER_BENCHMARKS \
        else {}
    summary = module.run(Path(args.out), quick=args.quick, **extra)
    print(json.dumps(summary))
    return 0
