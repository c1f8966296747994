"""`hpct-slurm demo`: the main job on an embedded default.

Brings up a real local Slurm cluster (4 active nodes + 1 spare), then runs the same small
training job three times through the shipped sbatch template and compares them:
  reference  — no fault;
  hpct       — node n3 hard-crashed at step K: a warm spare takes over from peers' memory;
  baseline   — the same crash, recovered the way users do today: restart every rank from the
               last disk checkpoint and recompute.
The last line is one JSON object with recovery_s, lost_steps, bitwise_equal, baseline_restart_s.
"""
from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

from .localcluster import DEFAULT_ROOT
from .localcluster.jobs import (NODES, TEMPLATE, VICTIM, RunResult, back_to_speed,
                                baseline_recomputed, bitwise_equal, collect, fresh_work_dir,
                                ready_cluster, recomputed_steps, submit, submit_baseline, wait_job)


def _say(msg: str) -> None:
    print(msg, flush=True)


def print_timeline(run: RunResult) -> dict:
    evs = run.controller_events()
    done = [e for e in evs if e["event"] == "recovery.done"]
    t0 = run.t_kill or 0.0
    _say("  timeline (seconds after the crash at t=0):")
    for e in evs:
        if e["event"].startswith(("fault.", "recovery.", "escalate.", "generation.")):
            detail = {k: v for k, v in e.items() if k in ("node", "reason", "how", "restore_step",
                                                         "taken", "generation")}
            _say(f"    {e['t'] - t0:+7.3f}  {e['event']:18} {json.dumps(detail)}")
    return done[-1] if done else {}


def run_demo(root: Path = DEFAULT_ROOT, steps: int = 60, kill_at: int = 20,
             step_sleep: float = 0.1, timeout: float = 300, keep: bool = False,
             parallel: str = "ddp") -> dict:
    _say(f"[1/4] local Slurm cluster: {NODES} nodes (4 active + 1 spare) under {root}")
    cluster = ready_cluster(root, NODES, who="the demo")
    work = fresh_work_dir(root, "demo")
    # ddp: the demo MLP, data parallel; fsdp / hsdp: the sharded job (FSDP2 fully_shard on a
    # 1-D mesh, or HSDP on a 2 x 2 replicate x shard mesh); 3d: pipeline 2 x FSDP2 2 x TP 2 on
    # 4 nodes of 2 ranks (adopted_3d.py, TP inside the node). The same faults and yardsticks.
    sharded = [] if parallel == "ddp" else ["--parallel", parallel]
    tpn, env = (2, {"HPCT_TASKS_PER_NODE": "2"}) if parallel == "3d" else (1, {})
    if parallel == "3d":  # 16 steps an epoch (512 sequences, batches of 16, 2 data shards)
        epochs = max(1, -(-steps // 16))
        train = [sys.executable, "-m", "hpct_slurm.examples.adopted_3d", "--layout", "3d",
                 "--epochs", str(epochs), "--batch", "16", "--step-sleep", str(step_sleep)]
        baseline_args = [*sharded, "--epochs", str(epochs), "--batch", "16"]
        kill_at = min(kill_at, epochs * 16 - 4)
    else:
        example = "train" if parallel == "ddp" else "sharded_train"
        train = [sys.executable, "-m", f"hpct_slurm.examples.{example}", *sharded,
                 "--steps", str(steps), "--step-sleep", str(step_sleep)]
        baseline_args = [*sharded, "--steps", str(steps)]
    world = 4 * tpn
    runs: dict[str, RunResult] = {}

    _say(f"[2/4] reference run ({parallel}), no fault")
    d = work / "reference"
    jid = submit(cluster, d, TEMPLATE, train, env=env)
    runs["reference"] = RunResult("reference", d, jid, wait_job(cluster, jid, d, timeout,
                                                                label="reference"),
                                  collect(d, world))

    _say(f"[3/4] hpct-slurm run: crash {VICTIM} at step {kill_at}; a warm spare takes over")
    d = work / "hpct"
    jid = submit(cluster, d, TEMPLATE, train, env=env)
    t_kill = wait_job(cluster, jid, d, timeout, kill_at=kill_at, label="hpct")
    runs["hpct"] = RunResult("hpct", d, jid, t_kill, collect(d, world))
    done = print_timeline(runs["hpct"])
    cluster.heal()

    _say("[4/4] baseline run: the same crash, restart-all from the last disk checkpoint")
    d = work / "baseline"
    jid = submit_baseline(cluster, d, [*baseline_args, "--step-sleep", str(step_sleep)],
                          ckpt_every=10, tasks_per_node=tpn)
    t_kill_b = wait_job(cluster, jid, d, timeout, kill_at=kill_at, label="baseline")
    runs["baseline"] = RunResult("baseline", d, jid, t_kill_b, collect(d, world))
    cluster.heal()

    hpct_s, hpct_last = back_to_speed(runs["hpct"].run_dir, runs["hpct"].t_kill)
    base_s, base_last = back_to_speed(runs["baseline"].run_dir, runs["baseline"].t_kill)
    restore = done.get("restore_step", -1)
    recomputed = recomputed_steps(runs["hpct"].run_dir)
    summary = {
        "recovery_s": round(hpct_s, 3),
        # steps rolled back by the restore, or computed twice by any rank (from the events)
        "lost_steps": max(hpct_last - restore, recomputed) if done else None,
        "bitwise_equal": bitwise_equal(runs["reference"].results, runs["hpct"].results,
                                       runs["hpct"].run_dir),
        "recomputed_steps": recomputed,
        "baseline_restart_s": round(base_s, 3),
        "baseline_lost_steps": baseline_recomputed(runs["baseline"].run_dir, base_last),
        "baseline_bitwise_equal": bitwise_equal(runs["reference"].results,
                                                runs["baseline"].results,
                                                runs["baseline"].run_dir),
        "ratio": round(hpct_s / base_s, 4) if base_s > 0 else None,
        "controller_recovery_s": round(done.get("recovery_s", float("nan")), 3),
        "phases": done.get("phases"),
        "replacement": done.get("taken"),
        "run_dir": str(work),
        "parallel": parallel,
    }
    _say(f"hpct-slurm recovered in {summary['recovery_s']} s with {summary['lost_steps']} "
         f"recomputed step(s); restart-all took {summary['baseline_restart_s']} s; "
         f"bit-identical to the uninterrupted run: {summary['bitwise_equal']}")
    if not keep:
        shutil.rmtree(work / "reference" / "events", ignore_errors=True)
    return summary
