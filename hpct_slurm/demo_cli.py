"""`hpct-slurm demo`: the README's main job."""
from __future__ import annotations

import argparse
import json
from pathlib import Path


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("demo", help="bring up a local Slurm cluster and train through a node "
                                    "failure (reference vs hpct-slurm vs restart-all)")
    p.add_argument("--root", default=None, help="local cluster root "
                                                "(default /tmp/hpct-localcluster)")
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--kill-at", type=int, default=20, help="crash the node at this step")
    p.add_argument("--step-sleep", type=float, default=0.1)
    p.add_argument("--parallel", choices=["ddp", "fsdp", "hsdp", "3d"], default="ddp",
                   help="the job's parallelism: plain data parallel (default), FSDP2 "
                        "fully_shard on a 1-D mesh of 4, HSDP on a 2 x 2 mesh, or 3d: "
                        "pipeline 2 x FSDP2 2 x tensor parallel 2 on 4 nodes of 2 ranks")
    p.add_argument("--down", action="store_true", help="take the cluster down afterwards")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from .demo import run_demo
    from .localcluster import DEFAULT_ROOT, LocalCluster

    root = Path(args.root) if args.root else DEFAULT_ROOT
    try:
        summary = run_demo(root, steps=args.steps, kill_at=args.kill_at,
                           step_sleep=args.step_sleep, parallel=args.parallel)
    finally:
        if args.down:
            LocalCluster(root).down()
    print(json.dumps(summary))
    return 0 if summary["bitwise_equal"] and summary["lost_steps"] is not None else 1
