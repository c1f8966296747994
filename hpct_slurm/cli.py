"""`hpct-slurm` command line: one subcommand per concern.

Each concern keeps its own small `cli.py` with `register(subparsers)`; the modules listed here
must import quickly (no torch at import time) so `hpct-slurm --help` stays instant.
"""
from __future__ import annotations

import argparse
import importlib
import os
import sys

from .errors import HpctError

# Order is the order shown in --help.
COMMAND_MODULES = [
    "hpct_slurm.demo_cli",
    "hpct_slurm.localcluster.cli",
    "hpct_slurm.slurm.cli",
    "hpct_slurm.hooks.cli",
    "hpct_slurm.controller.cli",
    "hpct_slurm.templates.cli",
    "hpct_slurm.bench.cli",
    "hpct_slurm.rendezvous.cli",
    "hpct_slurm.report.cli",
    "hpct_slurm.spares.cli",
    "hpct_slurm.goodput.cli",
    "hpct_slurm.config",
]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="hpct-slurm",
        description="Checkpointless training on plain Slurm clusters.",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True
    for name in COMMAND_MODULES:
        importlib.import_module(name).register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        rc = args.func(args)
    except HpctError as exc:
        print(str(exc), file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:
        # `hpct-slurm settings | head`: the reader left; say nothing more, as a Unix tool
        # would (stdout is pointed at /dev/null so the interpreter's final flush is quiet)
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 141
    return int(rc or 0)


if __name__ == "__main__":
    sys.exit(main())
