"""Batch-script driver of the restart-all baseline: what users do today without hpct-slurm.

One `srun` step spans all active nodes; when anything fails, the whole step dies (`-K1`), the
driver finds the dead node, marks it DOWN, swaps in the spare and relaunches every rank, which
reload the last disk checkpoint and recompute the steps since.
Usage (as the batch script): python -m hpct_slurm.examples.restart_all --run-dir D -- ARGS...
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

from ..controller.controller import slurmd_reachable
from ..events import Ev, EventLog
from ..slurm.client import SlurmClient, SlurmCommandError
from ..slurm.env import SlurmEnv

MAX_ATTEMPTS = 4


def batch_script(run_dir: Path, tasks_per_node: int = 1) -> Path:
    """Write the sbatch script that runs this driver for `run_dir`; submit it with the
    training arguments (`--steps ... --ckpt-every K`) as the script's arguments."""
    run_dir.mkdir(parents=True, exist_ok=True)
    script = run_dir / "baseline.sbatch"
    script.write_text("#!/bin/bash\n#SBATCH --exclusive\n#SBATCH --no-kill\n"
                      f'exec "{sys.executable}" -m hpct_slurm.examples.restart_all '
                      f'--run-dir "{run_dir}" --tasks-per-node {int(tasks_per_node)} '
                      f'-- "$@"\n')
    return script


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--run-dir", required=True)
    ap.add_argument("--spares", type=int, default=1)
    ap.add_argument("--tasks-per-node", type=int, default=1)
    ap.add_argument("train_args", nargs=argparse.REMAINDER)
    args = ap.parse_args()
    train_args = args.train_args[1:] if args.train_args[:1] == ["--"] else args.train_args
    env = SlurmEnv.from_environ()
    run_dir = Path(args.run_dir)
    events = EventLog(run_dir / "controller.jsonl", source="restart_all")
    slurm = SlurmClient()
    nodes = list(env.job_nodelist)
    active, spares = nodes[:len(nodes) - args.spares], nodes[len(nodes) - args.spares:]
    for attempt in range(MAX_ATTEMPTS):
        events.emit(Ev.BASELINE_LAUNCH, attempt=attempt, nodes=active)
        rc = slurm.run_step(active, [sys.executable, "-m", "hpct_slurm.examples.baseline_train",
                                     "--run-dir", str(run_dir), "--port", str(29400 + attempt),
                                     *train_args], options=["-K1", "--overlap", "-u"],
                             tasks_per_node=args.tasks_per_node)
        done = all((run_dir / "results" / f"rank{r}.json").exists()
                   for r in range(len(active) * args.tasks_per_node))
        events.emit(Ev.BASELINE_STEP_EXIT, attempt=attempt, code=rc, done=done)
        if done:
            return 0
        dead = [n for n in active if not slurmd_reachable(slurm, n)]
        events.emit(Ev.BASELINE_RESTART_ALL, dead=dead)
        for node in dead:
            try:
                slurm.update_node(node, "DOWN", f"hpct baseline: node lost (job {env.job_id})")
            except SlurmCommandError as exc:
                events.emit(Ev.SLURM_ERROR, error=exc.message)
            if not spares:
                events.emit(Ev.BASELINE_NO_SPARE)
                return 1
            active[active.index(node)] = spares.pop(0)
    return 1


if __name__ == "__main__":
    sys.exit(main())
