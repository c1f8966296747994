"""`hpct-slurm controller [options] -- CMD ...` (run by the sbatch templates)."""
from __future__ import annotations

import argparse
import os

from .. import config as C
from ..errors import HpctError


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("controller", help="run a training command with warm spares and "
                                          "in-memory recovery (inside an sbatch job)")
    p.add_argument("--spares", type=int, default=None,
                   help="nodes of the allocation kept as warm spares (default: $HPCT_SPARES, "
                        "which the SPANK option --hpct-spares sets, else 1)")
    p.add_argument("--active", type=int, default=None,
                   help="fixed number of active nodes; every other node is a spare (use with "
                        "sbatch --nodes=A-(A+S) so a requeued job keeps its world size)")
    p.add_argument("--persist-every", type=int, default=10,
                   help="steps between asynchronous disk snapshots (the requeue fallback)")
    p.add_argument("--pool-spares", type=int, default=0,
                   help="warm spares the job may borrow from the cluster spare pool (a "
                        "companion job in the pool reservation) once its own are used up")
    p.add_argument("--pool-reservation", default="hpct_spares")
    p.add_argument("--tasks-per-node", type=int, default=1)
    p.add_argument("--run-dir", default=None, help="events, logs, secret, persisted "
                                                   "snapshots (default $SLURM_SUBMIT_DIR/hpct-JOBID)")
    p.add_argument("--store", choices=["rootless", "tcpstore"], default=None,
                   help="rendezvous store (default: $HPCT_STORE, which the SPANK option "
                        "--hpct-rendezvous sets, else rootless)")
    p.add_argument("--heartbeat-timeout", type=float, default=3.0,
                   help="seconds without a heartbeat before a rank counts as hung")
    p.add_argument("--progress-timeout", type=float, default=None,
                   help="seconds a running rank may go without completing a step before it "
                        "counts as hung (its heartbeats go on from a healthy thread); "
                        "default $HPCT_PROGRESS_TIMEOUT_S or 300")
    p.add_argument("--on-no-spare", choices=["requeue", "shrink", "fail"], default="requeue",
                   help="no warm spare left: requeue (restart from the disk snapshot), shrink "
                        "(survivors take over the lost data shards; needs Job.run(micro_step=))"
                        ", or fail")
    p.add_argument("--want-spares", type=int, default=None,
                   help="warm spares expected from the allocation (with --active); fewer is "
                        "an event and a status line, or the end of the job with "
                        "--on-few-spares refuse")
    p.add_argument("--on-few-spares", choices=["warn", "refuse"], default="warn",
                   help="fewer spares than --want-spares on a first start: warn, or refuse "
                        "to start (a requeued job always starts)")
    p.add_argument("command", nargs=argparse.REMAINDER)
    p.set_defaults(func=run)

    m = sub.add_parser("move", help="move a running job's ranks off one of its nodes to a "
                                    "warm spare at the next step boundary (no fault, no "
                                    "lost step)")
    m.add_argument("node", help="the active node to leave")
    m.add_argument("job_id", nargs="?", type=int, default=None, metavar="JOBID",
                   help="the job (its run dir is WorkDir/hpct-JOBID unless --run-dir)")
    m.add_argument("--run-dir", default=None, help="the job's run dir (default: $HPCT_RUN_DIR, "
                                                   "else the job's WorkDir/hpct-JOBID)")
    m.add_argument("--reason", default="asked by the user")
    m.set_defaults(func=run_move)


def run_move(args: argparse.Namespace) -> int:
    from pathlib import Path

    from ..slurm.client import SlurmClient
    from .lifecycle import ask_move

    run_dir = args.run_dir or C.read(os.environ, C.RUN_DIR)
    if run_dir is None:
        if args.job_id is None:
            raise HpctError("move needs the JOBID or --run-dir (or $HPCT_RUN_DIR)")
        work = SlurmClient().show_job(args.job_id).work_dir
        if work is None:
            raise HpctError(f"job {args.job_id} has no WorkDir in Slurm: pass --run-dir")
        run_dir = Path(work) / f"hpct-{args.job_id}"
    path = ask_move(Path(run_dir), args.node, args.reason)
    print(f"move of {args.node} requested ({path}); the controller starts it at its next "
          f"poll (see move.* in {Path(run_dir) / 'controller.jsonl'})")
    return 0


def run(args: argparse.Namespace) -> int:
    from .controller import main_from_env

    cmd = args.command[1:] if args.command[:1] == ["--"] else args.command
    spares, store = defaults_from_spank(args.spares, args.store, os.environ)
    # read here, not when the parser is built: a bad value must not break `--help`
    progress_timeout = args.progress_timeout
    if progress_timeout is None:
        progress_timeout = C.read(os.environ, C.PROGRESS_TIMEOUT_S)
    elif not progress_timeout > 0:
        raise HpctError(f"--progress-timeout {progress_timeout:g} must be positive")
    if args.want_spares is not None and args.want_spares < 0:
        raise HpctError(f"--want-spares {args.want_spares} is negative")
    return main_from_env(cmd, args.run_dir, spares, args.tasks_per_node, store,
                         args.heartbeat_timeout, args.on_no_spare, args.active,
                         args.persist_every, args.pool_spares, args.pool_reservation,
                         progress_timeout_s=progress_timeout,
                         want_spares=args.want_spares, on_few_spares=args.on_few_spares)


def defaults_from_spank(spares: int | None, store: str | None,
                        environ: dict[str, str] | os._Environ) -> tuple[int, str]:
    """Command-line values win; else what the SPANK plugin exported from `sbatch --hpct-*`
    (HPCT_SPARES, HPCT_STORE); else the table's defaults (config.py's precedence rule)."""
    if spares is None:
        spares = C.read(environ, C.SPARES)
    if store is None:
        store = C.read(environ, C.STORE)
    if spares < 0:
        raise HpctError(f"--spares {spares} is negative")
    return spares, store
