"""`hpct-slurm template NAME`: print a shipped sbatch template."""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

from ..errors import HpctError

TEMPLATES = Path(__file__).parent


def names() -> list[str]:
    return sorted(p.stem for p in TEMPLATES.glob("*.sbatch"))


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("template", help="print a shipped sbatch template")
    p.add_argument("name", nargs="?", default="train", help=f"one of: {', '.join(names())}")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    if args.name not in names():
        raise HpctError(f"template {args.name!r} is not one of {', '.join(names())}")
    sys.stdout.write((TEMPLATES / f"{args.name}.sbatch").read_text())
    return 0
