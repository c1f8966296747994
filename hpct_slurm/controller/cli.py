"""`hpct-slurm controller [options] -- CMD ...` (run by the sbatch templates)."""
from __future__ import annotations

import argparse
import os

from .. import config as C
from ..errors import HpctError
from .options import RULES


# Flags that mirror a setting (flag -> the table's entry; Options checks its field by the same
# entry, options.RULES, so a value given from Python meets the flag's rule). The entry gives
# the flag its type (the table's parser and bounds: a flag takes nothing the variable refuses),
# the allowed
# values and default in its help, and its default: tests/test_settings_numbers.py parses an
# empty command line against the table, so the two cannot drift apart again.
MIRRORS: dict[str, str] = {
    "--spares": C.SPARES, "--store": C.STORE, "--progress-timeout": C.PROGRESS_TIMEOUT_S,
    "--persist-every": C.PERSIST_EVERY, "--pool-spares": C.POOL_SPARES,
    "--pool-reservation": C.POOL_RESERVATION, "--on-no-spare": C.ON_NO_SPARE,
    "--on-few-spares": C.ON_FEW_SPARES,
    "--active": C.ACTIVE_NODES, "--want-spares": C.SPARE_NODES,
    "--tasks-per-node": C.TASKS_PER_NODE,
    "--collective-timeout": C.COLLECTIVE_TIMEOUT_S, "--init-timeout": C.INIT_TIMEOUT_S,
}
# ... whose default on the command line is None: `run` reads the variable, then the table
# (config.py's precedence rule: the flag, the sbatch option the SPANK plugin exports, the table)
FROM_ENVIRON = ("--spares", "--store", "--progress-timeout", "--persist-every")
# ... range-checked by their entry, with a default of their own: the templates always pass
# them, and left out by hand they mean what no template value does (no fixed number of active
# nodes, no spares expected; tasks: the table's unset is "the step's own" to the rendezvous,
# but the controller launches the steps and must give a number). Flag -> (default, in words).
OWN_DEFAULT: dict[str, tuple[int | None, str]] = {
    "--active": (None, "none: every node that is not a spare"),
    "--want-spares": (None, "none expected"), "--tasks-per-node": (1, "1")}


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("controller", help="run a training command with warm spares and "
                                          "in-memory recovery (inside an sbatch job)")

    def mirror(flag: str, lead: str | None = None) -> None:
        kw: dict = {}
        setting = C.BY_NAME[MIRRORS[flag]]
        if setting.kind == "choice":
            kw["choices"] = list(setting.choices)
        elif setting.kind != "str":
            kw["type"] = C.arg_type(setting.name)
        environ = flag in FROM_ENVIRON
        default, words = OWN_DEFAULT.get(flag, (setting.default, None))
        kw["default"] = None if environ else default
        p.add_argument(flag, help=C.flag_help(setting.name, lead, environ, words), **kw)

    mirror("--spares", "nodes of the allocation kept as warm spares; the SPANK option "
                       "--hpct-spares sets $HPCT_SPARES")
    mirror("--active", "fixed number of active nodes; every other node is a spare: use with "
                       "sbatch --nodes=A-(A+S) so a requeued job keeps its world size")
    mirror("--persist-every", "steps between asynchronous disk snapshots, what a requeued job "
                              "resumes from; 0: none, a requeued job starts over")
    mirror("--pool-spares", "warm spares the job may borrow from the cluster spare pool (a "
                            "companion job in the pool reservation) once its own are used up")
    mirror("--pool-reservation")
    mirror("--tasks-per-node", "tasks (ranks) on each node")
    p.add_argument("--run-dir", default=None, help="events, logs, secret, persisted "
                                                   "snapshots (default $SLURM_SUBMIT_DIR/hpct-JOBID)")
    mirror("--store", "rendezvous store; the SPANK option --hpct-rendezvous sets "
                      "$HPCT_STORE")
    p.add_argument("--heartbeat-timeout", type=C.setting_type(RULES["heartbeat_timeout_s"]),
                   default=3.0,
                   help="seconds without a heartbeat before a rank counts as hung (default 3)")
    mirror("--progress-timeout", "seconds a running rank may go without completing a step "
                                 "before it counts as hung (its heartbeats go on from a healthy "
                                 "thread)")
    mirror("--on-no-spare", "no warm spare left: requeue (restart from the disk snapshot), "
                            "shrink (survivors take over the lost data shards; needs "
                            "Job.run(micro_step=)), or fail")
    mirror("--want-spares", "warm spares expected from the allocation (with --active); fewer "
                            "is an event and a status line, or the end of the job with "
                            "--on-few-spares refuse")
    mirror("--on-few-spares", "fewer spares than --want-spares on a first start: warn, or "
                              "refuse to start (a requeued job always starts)")
    mirror("--collective-timeout", "seconds before a collective whose peer is gone fails, "
                                   "on every rank")
    mirror("--init-timeout", "seconds a generation's process group may take to form before "
                             "the round gives up (raise it for thousands of ranks)")
    p.add_argument("command", nargs=argparse.REMAINDER)
    p.set_defaults(func=run)

    m = sub.add_parser("move", help="move a running job's ranks off one of its nodes to a "
                                    "warm spare at the next step boundary (no fault, no "
                                    "lost step)")
    m.add_argument("node", help="the active node to leave")
    m.add_argument("job_id", nargs="?", type=_job_id, default=None, metavar="JOBID",
                   help="the job (its run dir is WorkDir/hpct-JOBID unless --run-dir)")
    m.add_argument("--run-dir", default=None, help="the job's run dir (default: $HPCT_RUN_DIR, "
                                                   "else the job's WorkDir/hpct-JOBID)")
    m.add_argument("--reason", default="asked by the user")
    m.set_defaults(func=run_move)


def _job_id(text: str) -> int:
    from ..slurm.env import check_job_id  # the one rule for job ids from outside

    try:
        return check_job_id(text)
    except HpctError as exc:
        raise argparse.ArgumentTypeError(exc.message) from None


def run_move(args: argparse.Namespace) -> int:
    from pathlib import Path

    from ..slurm.client import SlurmClient
    from ..move_requests import ask_move

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
    # `HPCT_PERSIST_EVERY=0 sbatch train.sbatch ...`: the templates pass no flag of their own
    persist_every = args.persist_every
    if persist_every is None:
        persist_every = C.read(os.environ, C.PERSIST_EVERY)
    return main_from_env(cmd, args.run_dir, spares=spares, tasks_per_node=args.tasks_per_node,
                         store=store, heartbeat_timeout_s=args.heartbeat_timeout,
                         on_no_spare=args.on_no_spare, active=args.active,
                         persist_every=persist_every, pool_spares=args.pool_spares,
                         pool_reservation=args.pool_reservation,
                         progress_timeout_s=progress_timeout,
                         want_spares=args.want_spares, on_few_spares=args.on_few_spares,
                         collective_timeout_s=args.collective_timeout,
                         init_timeout_s=args.init_timeout)


def defaults_from_spank(spares: int | None, store: str | None,
                        environ: dict[str, str] | os._Environ) -> tuple[int, str]:
    """Command-line values win; else what the SPANK plugin exported from `sbatch --hpct-*`
    (HPCT_SPARES, HPCT_STORE); else the table's defaults (config.py's precedence rule)."""
    if spares is None:
        spares = C.read(environ, C.SPARES)
    if store is None:
        store = C.read(environ, C.STORE)
    return spares, store
