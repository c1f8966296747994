"""`hpct-slurm hostlist expand|compress ...` and `hpct-slurm env [--json]`."""
from __future__ import annotations

import argparse
import dataclasses
import json

from .env import SlurmEnv
from .hostlist import compress, expand


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("hostlist", help="expand or compress Slurm hostlists (pure Python)")
    p.add_argument("action", choices=["expand", "compress"])
    p.add_argument("hostlists", nargs="+", metavar="HOSTLIST",
                   help="expand: hostlists, one host per output line; "
                        "compress: host names or hostlists, one hostlist out")
    p.set_defaults(func=_hostlist)

    p = sub.add_parser("env", help="show this process's SLURM_* environment, parsed and checked")
    p.add_argument("--json", action="store_true", help="one JSON object")
    p.set_defaults(func=_env)


def _hostlist(args: argparse.Namespace) -> int:
    hosts = [h for hl in args.hostlists for h in expand(hl)]
    if args.action == "expand":
        print("\n".join(hosts))
    else:
        print(compress(hosts))
    return 0


def _env(args: argparse.Namespace) -> int:
    env = SlurmEnv.from_environ()
    data = dataclasses.asdict(env)
    if args.json:
        print(json.dumps(data))
    else:
        for key, value in data.items():
            if isinstance(value, list) and value and isinstance(value[0], str):
                value = compress(value)
            print(f"{key}: {value}")
    return 0
