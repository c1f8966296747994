"""`hpct-slurm rendezvous env [--format export|json] [--generation G]` and
`hpct-slurm rendezvous secret PATH`.

The export form is what a TaskProlog (or the SPANK plugin) prints: Slurm reads each
`export NAME=value` line into the task's environment, taking the value literally.
"""
from __future__ import annotations

import argparse
import json

from ..errors import HpctError


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("rendezvous", help="rank layout, ports and Gloo/NCCL env of this task")
    actions = p.add_subparsers(dest="action", metavar="ACTION")
    actions.required = True
    e = actions.add_parser("env", help="print the derived rendezvous env of this task")
    e.add_argument("--format", choices=["export", "json"], default="export",
                   help="export: `export X=Y` lines (TaskProlog); json: info and env")
    e.add_argument("--generation", type=int, default=None,
                   help="generation (default: $HPCT_GENERATION or 0)")
    e.set_defaults(func=_env)
    s = actions.add_parser("secret", help="create a per-job secret file for the rootless store "
                                          "(tier 1 under plain srun: HPCT_SECRET_FILE)")
    s.add_argument("path", help="the file to create (it must not exist): 32 random bytes as "
                                "64 hex digits and a newline, mode 0600")
    s.set_defaults(func=_secret)


def _env(args: argparse.Namespace) -> int:
    from . import derive_from_environ

    info = derive_from_environ(args.generation)
    env = info.env()
    if args.format == "json":
        print(json.dumps({"info": info.to_dict(), "env": env}))
        return 0
    for name, value in env.items():
        if any(c.isspace() for c in value):
            raise HpctError(f"derived {name} {value!r} holds whitespace: it cannot be exported")
        print(f"export {name}={value}")
    return 0


def _secret(args: argparse.Namespace) -> int:
    from ..protocol import new_secret_file

    new_secret_file(args.path)
    print(args.path)
    return 0
