"""`hpct-slurm spares list|add|remove|check|return`: the cluster's hot-spare pool.

Runs plain `scontrol`/`sinfo`/`squeue`/`srun` with the caller's SLURM_CONF, so the same command
works on a real cluster and inside `hpct-slurm localcluster exec -- hpct-slurm spares ...`.
"""
from __future__ import annotations

import argparse
import json
from dataclasses import asdict

from .. import config as C
from ..slurm.hostlist import expand


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("spares", help="the cluster's hot-spare node pool (admin)",
                       description="A pool of hot-spare nodes kept in Slurm: the reservation "
                                   "hpct_spares plus the node feature hpct_spare.")
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--json", action="store_true", help="one JSON document on stdout")
    cmds = p.add_subparsers(dest="spares_command", metavar="ACTION")
    cmds.required = True
    cmds.add_parser("list", parents=[common], help="pool members with state, reason, record")
    cmds.add_parser("loop", parents=[common],
                    help="every node off service or in the pool: where it is in the lifecycle "
                         "(drain, move, fence, reboot, health check, spare) and what is next")
    add = cmds.add_parser("add", parents=[common],
                          help="put idle nodes in the pool (refuses nodes running jobs)")
    add.add_argument("nodes", nargs="+", help="node names or hostlists (n[1-2])")
    add.add_argument("--users", default=C.read(None, C.SPARE_USERS),
                     help="users allowed to draw from the pool, when the reservation is "
                          "created (default $HPCT_SPARE_USERS or root)")
    rm = cmds.add_parser("remove", parents=[common], help="take nodes out of the pool")
    rm.add_argument("nodes", nargs="+")
    chk = cmds.add_parser("check", parents=[common],
                          help="health-check nodes hpct-slurm drained; return healthy ones")
    ret = cmds.add_parser("return", parents=[common],
                          help="health-check one drained node and return it")
    ret.add_argument("node")
    for q in (chk, ret):
        q.add_argument("--to-pool", action="store_true",
                       help="return healthy nodes into the pool rather than to service")
    p.set_defaults(func=run)


def _names(items: list[str]) -> list[str]:
    names: list[str] = []
    for item in items:
        names += [n for n in expand(item) if n not in names]
    return names


def run(args: argparse.Namespace) -> int:
    from ..slurm.client import SlurmClient
    from .pool import SparePool, outcomes_json

    pool = SparePool(SlurmClient(), users=getattr(args, "users", "root"))
    action = args.spares_command
    if action == "list":
        members = pool.list()
        if args.json:
            print(json.dumps({"pool": [asdict(m) for m in members]}))
        else:
            print(f"{'NODE':8} {'STATE':10} {'LABEL':5} REASON / RECORD")
            for m in members:
                print(f"{m.name:8} {m.state:10} {'yes' if m.labelled else 'NO':5} "
                      f"{m.reason or m.comment or ''}")
        return 0
    if action == "loop":
        from .pool import loop_stage

        nodes, _ = pool.snapshot()
        members = set(pool.members())
        rows = [{"node": n.name, "state": n.summary, "reason": n.reason,
                 "stage": st, "next": nxt}
                for n in nodes for st, nxt in [loop_stage(n, n.name in members)]
                if st != "in service"]
        if args.json:
            print(json.dumps({"loop": rows}))
        else:
            print(f"{'NODE':8} {'STAGE':30} NEXT")
            for r in rows:
                print(f"{r['node']:8} {r['stage']:30} {r['next']}")
            if not rows:
                print("every node is in service")
        return 0
    if action == "add":
        outcomes = pool.add(_names(args.nodes))
    elif action == "remove":
        outcomes = pool.remove(_names(args.nodes))
    elif action == "check":
        outcomes = pool.check(to_pool=args.to_pool)
    else:
        outcomes = [pool.return_node(args.node, to_pool=args.to_pool)]
    if args.json:
        print(json.dumps({"action": action, "nodes": outcomes_json(outcomes)}))
    else:
        for o in outcomes:
            print(f"{o.node}: {o.action}{' (' + o.detail + ')' if o.detail else ''}")
        if not outcomes:
            print("nothing to do")
    return 1 if any(o.action == "unhealthy" for o in outcomes) else 0
