"""One node that drags the job, for the fail-slow tests and `hpct-slurm bench failslow`: the
ranks on `--slow-node` spend (`--slow-factor` - 1) x the step's stand-in compute longer loading
each step's data, from `--slow-from` on. A real delay in their own time, which nothing reads
as a flag (issue 47)."""
from __future__ import annotations

import argparse
import time


def add_arguments(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--slow-node", default=None, metavar="NODE",
                    help="fail-slow: the Slurm node whose ranks load their data slower; ALL: "
                         "every node (a job-wide slowdown)")
    ap.add_argument("--slow-factor", type=float, default=1.5, metavar="F")
    ap.add_argument("--slow-from", type=int, default=0, metavar="STEP")


def load_delay(args: argparse.Namespace, node: str, step: int, step_s: float) -> None:
    """The slowed node's extra data loading in `step`, for a step of `step_s` seconds."""
    if args.slow_node in (node, "ALL") and step >= args.slow_from:
        time.sleep(max(0.0, args.slow_factor - 1.0) * step_s)
