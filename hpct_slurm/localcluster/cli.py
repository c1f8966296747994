"""`hpct-slurm localcluster ...`: bring a real local Slurm cluster up, fault it, take it down."""
from __future__ import annotations

import argparse
import json
import os
import sys

from ..errors import HpctError


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("localcluster", help="a real Slurm cluster on this machine (root)",
                       description="munged + slurmctld + N slurmd on this machine, in network "
                                   "namespaces (default) or on loopback ports.")
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--root", default=None,
                        help="state directory (default $HPCT_LOCALCLUSTER_ROOT or "
                             "/tmp/hpct-localcluster)")
    cmds = p.add_subparsers(dest="lc_command", metavar="ACTION")
    cmds.required = True
    add = cmds.add_parser

    def action(name: str, **kw) -> argparse.ArgumentParser:
        return add(name, parents=[common], **kw)
    up = action("up", help="start the cluster (idempotent)")
    up.add_argument("--nodes", type=int, default=4)
    up.add_argument("--mode", choices=["netns", "ports"], default="netns")
    up.add_argument("--json", action="store_true")
    st = action("status", help="daemons and every node's Slurm state")
    st.add_argument("--json", action="store_true")
    action("down", help="stop every process and namespace of the cluster")
    k = action("kill-node", help="hard crash: SIGKILL slurmd, slurmstepd, tasks")
    k.add_argument("node")
    r = action("revive-node", help="boot a killed node again")
    r.add_argument("node")
    r.add_argument("--resume", action="store_true", help="also scontrol State=RESUME")
    c = action("cut-link", help="take a node's network link down (netns mode)")
    c.add_argument("node")
    c.add_argument("--restore", action="store_true", help="bring the link back up")
    e = action("exec", help="run a command against the cluster: exec -- sinfo")
    e.add_argument("--node", default=None, help="run inside this node's namespaces")
    e.add_argument("argv", nargs=argparse.REMAINDER)
    p.set_defaults(func=run)


def _cluster(args, nodes: int = 4, mode: str = "netns"):
    from .cluster import DEFAULT_ROOT, LocalCluster

    return LocalCluster(args.root or DEFAULT_ROOT, nodes=nodes, mode=mode)


def run(args: argparse.Namespace) -> int:
    action = args.lc_command
    if action == "up":
        cluster = _cluster(args, args.nodes, args.mode)
        if cluster.state() and (cluster.mode != args.mode or len(cluster.nodes) != args.nodes):
            raise HpctError(f"a {cluster.mode} cluster of {len(cluster.nodes)} nodes is up "
                            f"under {cluster.root}; `down` it first or use another --root")
        return _print_status(cluster.up(), args.json)
    cluster = _cluster(args)
    if action == "status":
        return _print_status(cluster.status(), args.json)
    if action == "down":
        print(json.dumps(cluster.down()))
        return 0
    if action == "kill-node":
        pids = cluster.kill_node(args.node)
        print(json.dumps({"node": args.node, "killed_pids": pids}))
        return 0
    if action == "revive-node":
        booted = cluster.revive_node(args.node, resume=args.resume)
        out = {"node": args.node, "revived": booted, "resumed": args.resume}
        if not args.resume:
            out["note"] = (f"Slurm keeps {args.node} DOWN until it is resumed: "
                           f"hpct-slurm localcluster revive-node {args.node} --resume")
        print(json.dumps(out))
        return 0
    if action == "cut-link":
        cluster.cut_link(args.node, up=args.restore)
        print(json.dumps({"node": args.node, "link": "up" if args.restore else "down"}))
        return 0
    if action == "exec":
        argv = args.argv[1:] if args.argv[:1] == ["--"] else args.argv
        if not argv:
            raise HpctError("localcluster exec needs a command: exec -- sinfo")
        cluster.state() or cluster._require_state()
        sys.stdout.flush()
        env = cluster.env()
        full = cluster.command(argv, args.node)
        os.execvpe(full[0], full, env)
    raise HpctError(f"unknown localcluster action {action!r}")


def _print_status(status: dict, as_json: bool) -> int:
    if as_json:
        print(json.dumps(status))
        return 0
    if not status.get("nodes"):
        print(f"no cluster under {status['root']}")
        return 1
    # In netns mode slurmctld listens inside its own network namespace: SLURM_CONF alone
    # reaches some other address from here (squeue: "Insane message length"), so say how.
    how = (f"Slurm commands: hpct-slurm localcluster exec -- squeue (SLURM_CONF="
           f"{status['slurm_conf']}, inside the cluster's network namespace)"
           if status["mode"] == "netns" else f"SLURM_CONF={status['slurm_conf']}")
    print(f"cluster {status['cluster']} ({status['mode']}) under {status['root']}: "
          f"{'up' if status['up'] else 'DEGRADED'}  {how}")
    for n in status["nodes"]:
        print(f"  {n['name']:6} {n['addr']:15} {n['state']:10} "
              f"slurmd={'alive' if n['slurmd_alive'] else 'dead'}")
    return 0
