"""A second fault in every phase of a recovery, on the real local Slurm cluster (issue 30).

A job of 3 active nodes and 2 spares trains the demo model with a per-rank data position; at
step 8 node n2 crashes (`kill_node`), and the spare that takes its position dies inside a
named phase of its adoption (`HPCT_FAULT_TAKER_DIES_AT`, recovery/inject.py): right after the
assignment, with its shard up, in the pair connects after the address exchange, mid-pull,
at its first step. The second spare takes over. Runs cycle through the phases (20 runs by
default, 5 with --quick: one per phase). Each run must end bit-identical to an uninterrupted
run with no healthy survivor fenced and no escalation; the record per run: the phase, the
time from the crash to the end of the recovery that brought the last spare in, the survivors'
longest wait from a STOP to their ready report, and the fenced nodes.
"""
from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path

from ..localcluster.jobs import (TEMPLATE, bitwise_equal, collect, controller_events,
                                 fresh_work_dir, rank_events, ready_cluster, submit, wait_job,
                                 wait_step)
from ..recovery.inject import PHASES
from .common import plot_bars, write_result
from .recovery import BENCH_ROOT

ACTIVE, SPARES, STEPS = 3, 2, 24
TRAIN = [sys.executable, "-m", "hpct_slurm.examples.train", "--steps", str(STEPS),
         "--step-sleep", "0.05", "--position"]


def _submit(cluster, run_dir: Path, env: dict[str, str]) -> int:
    return submit(cluster, run_dir, TEMPLATE, TRAIN, nodes=ACTIVE + SPARES,
                  env={"HPCT_ACTIVE_NODES": str(ACTIVE), "HPCT_SPARE_NODES": str(SPARES),
                       **env})


def survivor_waits(controller: list[dict], ranks: list[dict], lost: set[str]) -> float:
    """The longest time from a STOP to a survivor's ready report (pure): what a healthy node
    spent getting out of the generation the STOP named."""
    stops = sorted(e["t"] for e in controller if e["event"] == "fault.stop_sent")
    worst = 0.0
    for e in ranks:
        node = str(e.get("source", "")).split("/")[0]
        if e["event"] != "rank.ready" or node in lost:
            continue
        before = [t for t in stops if t <= e["t"]]
        if before:
            worst = max(worst, e["t"] - before[-1])
    return round(worst, 3)


def one_run(cluster, run_dir: Path, phase: str, reference: dict) -> dict:
    jid = _submit(cluster, run_dir, {"HPCT_FAULT_TAKER_DIES_AT": phase})
    wait_step(run_dir, 8)
    t_kill = time.time()
    cluster.kill_node("n2")
    wait_job(cluster, jid, run_dir, 300, label=f"second-fault-{phase}")
    ctl, ranks = controller_events(run_dir), rank_events(run_dir)
    injected = [e for e in ranks if e["event"] == "fault.injected"]
    taker = str(injected[0]["source"]).split("/")[0] if injected else None
    fenced = sorted({e["node"] for e in ctl if e["event"] == "fault.fenced"})
    done = [e["t"] for e in ctl if e["event"] == "recovery.done"]
    return {"phase": phase, "injected": bool(injected), "taker": taker, "fenced": fenced,
            "healthy_fenced": sorted(set(fenced) - {"n2", taker}),
            "escalated": any(e["event"].startswith("escalate.") for e in ctl),
            "crash_to_recovered_s": round(max(done) - t_kill, 3) if done else None,
            "survivor_max_wait_s": survivor_waits(ctl, ranks, {"n2", taker or ""}),
            "bit_identical": bitwise_equal(reference, collect(run_dir, ACTIVE), run_dir)}


def run(out: Path, quick: bool = False, root: Path = BENCH_ROOT, down: bool = False) -> dict:
    from ..localcluster.jobs import NODES

    runs_n = len(PHASES) if quick else 20
    cluster = ready_cluster(root, NODES, who="bench second_fault")
    work = fresh_work_dir(root, "bench-second-fault")
    try:
        ref_dir = work / "reference"
        wait_job(cluster, submit(cluster, ref_dir, TEMPLATE, TRAIN, nodes=ACTIVE,
                                 env={"HPCT_ACTIVE_NODES": str(ACTIVE),
                                      "HPCT_SPARE_NODES": "0"}),
                 ref_dir, 300, label="reference")
        reference = collect(ref_dir, ACTIVE)
        runs = []
        for i in range(runs_n):
            cluster.heal()
            runs.append(one_run(cluster, work / f"run{i}", PHASES[i % len(PHASES)], reference))
        cluster.heal()
    finally:
        if down:
            cluster.down()
    per_phase = {p: [r for r in runs if r["phase"] == p] for p in PHASES}
    waits = {p: max((r["survivor_max_wait_s"] for r in rs), default=None)
             for p, rs in per_phase.items()}
    summary = {"bench": "second_fault", "runs": runs_n,
               "all_bit_identical": all(r["bit_identical"] for r in runs),
               "healthy_fenced": sum(len(r["healthy_fenced"]) for r in runs),
               "escalated": sum(r["escalated"] for r in runs),
               "survivor_max_wait_s_per_phase": waits,
               "crash_to_recovered_s_median": statistics.median(
                   r["crash_to_recovered_s"] for r in runs if r["crash_to_recovered_s"])}
    write_result(out, "second_fault", {"summary": summary, "runs": runs})
    plot_bars(out / "second_fault.png", list(waits), [w or 0.0 for w in waits.values()],
              "s", "survivors' longest wait from a STOP to ready, per phase of the second fault")
    return summary
