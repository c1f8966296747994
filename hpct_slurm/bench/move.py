"""A planned move next to a fault recovery, measured in the same job on the real local cluster.

One job: 3 active nodes + 2 warm spares, the example MLP. At step K an admin drains n2
(`scontrol update nodename=n2 state=drain`): its ranks move to a spare (controller/lifecycle.py:
STOP at the step boundary, the spare pulls the state from the leaving ranks, no fence, no
rollback). Some steps after the move, n3 is hard-crashed (`kill_node`: slurmd, slurmstepd and
the rank SIGKILLed): an ordinary fault recovery onto the other spare. Both pauses come out of
the same job's controller log, so they ran on the same nodes, model and load:

  move pause   move.done's recovery_s: the STOP to the first step every rank completed
  fault pause  recovery.done's recovery_s (detection to the first step), and crash_to_done
               (the SIGKILL to that step: detection included, which a move does not need)

plus lost steps (steps completed before and recomputed after) for each, and whether the final
parameters are bit-identical to an uninterrupted reference run of the same job. Repeated
(`--quick`: once); medians reported.
"""
from __future__ import annotations

import statistics
import time
from pathlib import Path

from ..errors import HpctError
from ..localcluster.jobs import (TEMPLATE, bitwise_equal, cancel, collect, controller_events,
                                 crash_at, fresh_work_dir, ready_cluster, recomputed_steps, submit,
                                 wait_job, wait_step)
from .common import plot_bars, write_result

NAME = "move"
ACTIVE, SPARES = 3, 2
DRAINED, CRASHED = "n2", "n3"


def _train(steps: int) -> list[str]:
    import sys
    return [sys.executable, "-m", "hpct_slurm.examples.train", "--steps", str(steps),
            "--step-sleep", "0.1", "--hidden", "1024", "--layers", "4"]


def _submit(cluster, run_dir: Path, steps: int) -> int:
    return submit(cluster, run_dir, TEMPLATE, _train(steps), nodes=ACTIVE + SPARES,
                  env={"HPCT_ACTIVE_NODES": str(ACTIVE), "HPCT_SPARE_NODES": str(SPARES)})


def _wait_event(run_dir: Path, name: str, timeout: float) -> dict:
    deadline = time.monotonic() + timeout
    while True:
        found = [e for e in controller_events(run_dir) if e["event"] == name]
        if found:
            return found[0]
        if time.monotonic() > deadline:
            raise HpctError(f"no {name} within {timeout:.0f} s; see {run_dir}")
        time.sleep(0.1)


def one_run(cluster, run_dir: Path, steps: int, reference: dict) -> dict:
    jid = _submit(cluster, run_dir, steps)
    try:
        wait_step(run_dir, 10)
        cluster.client().update_node(DRAINED, "DRAIN", "hpct bench move: planned maintenance")
        moved = _wait_event(run_dir, "move.done", 60)
        wait_step(run_dir, moved["restore_step"] + 10)
        t_crash = crash_at(cluster, run_dir, moved["restore_step"] + 10, 60, node=CRASHED)
        recovered = _wait_event(run_dir, "recovery.done", 120)
        wait_job(cluster, jid, run_dir, 300, label="move+fault")
    except BaseException:
        cancel(cluster, jid)
        raise
    evs = controller_events(run_dir)
    return {
        "job": jid,
        "move_pause_s": moved["recovery_s"],
        "move_phases": moved["phases"],
        "move_lost_steps": moved["lost_steps"],
        "fault_pause_s": recovered["recovery_s"],
        "fault_phases": recovered["phases"],
        "fault_lost_steps": recovered["lost_steps"],
        "fault_crash_to_done_s": recovered["t"] - t_crash,
        "recomputed_steps": recomputed_steps(run_dir),
        # the move itself must raise no fault: every fault.detected comes after the crash
        "faults_before_crash": sum(1 for e in evs if e["event"] == "fault.detected"
                                   and e["t"] < t_crash),
        "bit_identical": bitwise_equal(reference, collect(run_dir, ACTIVE), run_dir),
    }


def run(out: Path, quick: bool = False, root: Path = Path("/tmp/hpct-bench-cluster"),
        down: bool = False) -> dict:
    from ..localcluster.jobs import NODES

    reps = 1 if quick else 3
    steps = 120
    cluster = ready_cluster(root, NODES, who="bench move")
    try:
        work = fresh_work_dir(root, "bench-move")
        ref_dir = work / "reference"
        wait_job(cluster, _submit(cluster, ref_dir, steps), ref_dir, 300, label="reference")
        reference = collect(ref_dir, ACTIVE)
        runs = []
        for i in range(reps):
            cluster.heal()
            runs.append(one_run(cluster, work / f"run{i}", steps, reference))
        cluster.heal()
    finally:
        if down:
            cluster.down()
    move = statistics.median(r["move_pause_s"] for r in runs)
    fault = statistics.median(r["fault_pause_s"] for r in runs)
    crash = [r["fault_crash_to_done_s"] for r in runs]
    summary = {
        "reps": reps, "active": ACTIVE, "spares": SPARES, "steps": steps,
        "move_pause_s_median": move, "fault_pause_s_median": fault,
        "fault_crash_to_done_s_median": statistics.median(crash),
        "move_over_fault": move / fault if fault else None,
        "move_lost_steps": [r["move_lost_steps"] for r in runs],
        "fault_lost_steps": [r["fault_lost_steps"] for r in runs],
        "bit_identical": all(r["bit_identical"] for r in runs),
        "runs": runs,
    }
    write_result(out, NAME, summary)
    labels = ["planned move", "fault (from detection)", "fault (from crash)"]
    values = [move, fault, statistics.median(crash)]
    plot_bars(out / f"{NAME}.png", labels, values, "pause (s)",
              f"planned move vs fault recovery, same job (median of {reps})")
    return {k: v for k, v in summary.items() if k != "runs"}
