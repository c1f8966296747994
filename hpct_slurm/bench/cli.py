"""`hpct-slurm bench NAME`: run one benchmark and print its summary as the last line (JSON)."""
from __future__ import annotations

import argparse
import importlib
import json
from pathlib import Path

from ..errors import HpctError

# Each name is a module `hpct_slurm.bench.<name>` exposing `run(out_dir, quick=False) -> dict`.
BENCHMARKS = ["replication", "transfer"]


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("bench", help="run a benchmark and print its summary")
    p.add_argument("name", metavar="NAME", help=f"one of: {', '.join(BENCHMARKS)}")
    p.add_argument("--out", default="results", help="directory for <NAME>.json and plots")
    p.add_argument("--quick", action="store_true", help="smaller sizes, fewer repetitions")
    p.set_defaults(func=main)


def main(args: argparse.Namespace) -> int:
    if args.name not in BENCHMARKS:
        raise HpctError(f"benchmark '{args.name}' is unknown; choose one of {', '.join(BENCHMARKS)}")
    module = importlib.import_module(f"hpct_slurm.bench.{args.name}")
    summary = module.run(Path(args.out), quick=args.quick)
    print(json.dumps(summary))
    return 0
