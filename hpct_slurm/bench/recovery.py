"""Node failure recovered two ways, side by side, on the real local Slurm cluster.

The same training job (4 active nodes + 1 spare, an MLP whose parameters + Adam moments are
>= 100 MB), the same crash (`kill_node n3`: slurmd, slurmstepd and the rank SIGKILLed) at the
same step, recovered by
  hpct      — the shipped sbatch template: survivors stay resident, a warm spare takes n3's
              rank and pulls the state from a survivor's memory;
  baseline  — restart-all (examples/restart_all.py): one srun step over all nodes dies, every rank
              is relaunched, re-forms through a TCPStore, loads the disk checkpoint written
              every K steps and recomputes the steps since;
and both compared bit for bit with one uninterrupted reference run. Repeated; medians reported.

Yardstick for both (the demo's, made robust): seconds from the crash (the first SIGKILL) until
every rank of the recovered job has completed a step after the highest step reached before
the crash (any later one: a replacement that restored the state captured at the fault starts
past the next). Each method's phases are cut from its event logs so that they add up to exactly
that time:
  hpct      detect (crash → fault.detected), stop (→ STOP sent), fence (→ node fenced),
            survivors_ready (→ ranks torn down, health-checked, ready: recovery.assign),
            reform (→ slowest rank's group formed), state_transfer (→ slowest rank restored),
            first_step (→ every rank completed the step);
  baseline  detect (crash → the srun step died), relaunch (→ dead node found, DOWN, spare
            swapped in, new srun), process_start (→ every rank started and imported torch),
            rendezvous (→ TCPStore + gloo group formed), init_and_load (→ model built and the
            checkpoint loaded), recompute (→ every rank redid the last step before the crash),
            first_step (→ every rank completed the step after it).
The training data is synthetic (derived from seed, rank and step), so there is no data
re-attach phase to measure here; `bench cache` measures that cost on its own.
"""
from __future__ import annotations

import contextlib
import datetime
import shutil
import statistics
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable, Sequence

from ..errors import HpctError
from ..localcluster import LocalCluster
from ..localcluster.jobs import (NODES, TEMPLATE, VICTIM, RunResult, back_at, bitwise_equal,
                                 cancel, collect, controller_events, crash_at, fresh_work_dir,
                                 ready_cluster, recomputed_steps, submit, submit_baseline,
                                 wait_job)
from .common import write_result

NAME = "recovery"
BENCH_ROOT = Path("/tmp/hpct-bench-cluster")
WORLD = NODES - 1
HPCT_PHASES = ("detect", "stop", "fence", "survivors_ready", "reform", "state_transfer",
               "first_step")
BASELINE_PHASES = ("detect", "relaunch", "process_start", "rendezvous", "init_and_load",
                   "recompute", "first_step")


@dataclass(frozen=True)
class Config:
    steps: int
    kill_at: int
    ckpt_every: int
    hidden: int
    layers: int
    repeats: int
    step_sleep: float = 0.0
    timeout_s: float = 300.0

    def train_args(self) -> list[str]:
        return ["--steps", str(self.steps), "--hidden", str(self.hidden),
                "--layers", str(self.layers), "--step-sleep", str(self.step_sleep)]


# 2048 wide, 3 hidden layers: 8.46 M parameters, 101.5 MB with Adam's two moments; one step
# takes about 0.8 s on the 2-core VM. The crash lands K/2 steps after a checkpoint on average
# for a uniformly random failure; step 14 with K=10 is close to that (4-5 recomputed steps).
FULL = Config(steps=20, kill_at=14, ckpt_every=10, hidden=2048, layers=3, repeats=3)
QUICK = Config(steps=30, kill_at=15, ckpt_every=10, hidden=256, layers=1, repeats=1,
               step_sleep=0.1)


def state_bytes(hidden: int, layers: int) -> int:
    """Bytes of the training state a replacement must get back: parameters + every optimizer
    state tensor, counted on the real model and optimizer after one step."""
    import torch

    from ..examples.train import build

    model, opt = build(hidden, layers)
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    opt.step()  # Adam allocates its moments on the first step
    params = sum(p.numel() * p.element_size() for p in model.parameters())
    moments = sum(t.numel() * t.element_size() for s in opt.state.values()
                  for t in s.values() if torch.is_tensor(t))
    return params + moments


def _first(events: Sequence[dict], name: str, after: float) -> dict:
    for e in sorted(events, key=lambda e: e["t"]):
        if e["event"] == name and e["t"] >= after:
            return e
    raise HpctError(f"no {name!r} event after t={after:.3f}: the run did not get that far")


def back_to_speed(steps: Sequence[dict], new: Callable[[dict], bool]) -> tuple[float, int]:
    """When the recovered job is back to speed, and the last step reached before the crash:
    every rank of the new incarnation (`new(event)`) has completed a step after the highest
    step any rank of the old one completed (the demo's yardstick, jobs.back_at). Deciding
    old/new by incarnation instead of by the crash's timestamp keeps a step that a dying rank
    finished a millisecond after the kill signal from counting as progress."""
    old = [e["step"] for e in steps if e["event"] == "rank.step" and not new(e)]
    k_last = max(old, default=-1)
    return back_at(steps, k_last, range(WORLD), new), k_last


def _cut(marks: Sequence[tuple[str, float]], start: float) -> dict[str, float]:
    """Consecutive durations between time marks; each mark is held at least at the previous
    one, so the phases are never negative and always add up to the last mark − start."""
    out, prev = {}, start
    for name, t in marks:
        t = max(t, prev)
        out[name] = t - prev
        prev = t
    return out


def hpct_phases(controller: Sequence[dict], ranks: Sequence[dict],
                t_crash: float) -> tuple[dict[str, float], dict]:
    """Phases of one hpct recovery from the controller's and the ranks' events, and the
    recovery's outline (end time, last step before the crash, restore step)."""
    detected = _first(controller, "fault.detected", t_crash)
    stop = _first(controller, "fault.stop_sent", detected["t"])
    assign = _first(controller, "recovery.assign", stop["t"])
    fenced = [e["t"] for e in controller if e["event"] == "fault.fenced"
              and stop["t"] <= e["t"] <= assign["t"]]
    adopted = [e for e in ranks if e["event"] == "rank.adopted"
               and e["generation"] == assign["generation"]]
    if not adopted:
        raise HpctError(f"no rank adopted generation {assign['generation']}")
    t_end, k_last = back_to_speed(ranks, lambda e: e["generation"] >= assign["generation"])
    formed = max(e["t"] - e["restore_s"] for e in adopted)
    restored = max(e["t"] for e in adopted)
    phases = _cut([("detect", detected["t"]), ("stop", stop["t"]),
                   ("fence", max(fenced, default=stop["t"])), ("survivors_ready", assign["t"]),
                   ("reform", formed), ("state_transfer", restored), ("first_step", t_end)],
                  t_crash)
    return phases, {"t_end": t_end, "k_last": k_last, "restore_step": assign["restore_step"],
                    "generation": assign["generation"], "taken": assign["taken"],
                    "restore_sources": sorted({e["source"] for e in adopted})}


def baseline_phases(controller: Sequence[dict], ranks: Sequence[dict],
                    t_crash: float) -> tuple[dict[str, float], dict]:
    """Phases of one restart-all recovery from its driver's and its ranks' events, and the
    recovery's outline (end time, last step before the crash, checkpoint step resumed)."""
    died = _first(controller, "baseline.step_exit", t_crash)
    relaunch = _first(controller, "baseline.launch", died["t"])
    after = [e for e in ranks if e["t"] >= relaunch["t"]]
    t_end, k_last = back_to_speed(ranks, lambda e: e["t"] >= relaunch["t"])

    def slowest(name: str) -> float:
        ts = [e["t"] for e in after if e["event"] == name]
        if len(ts) < WORLD:
            raise HpctError(f"only {len(ts)} of {WORLD} relaunched ranks emitted {name!r}")
        return max(ts)

    started = slowest("baseline.start")
    resumed_at = min(e["start_step"] for e in after if e["event"] == "baseline.start")
    recomputed = max(e["t"] for e in after if e["event"] == "rank.step"
                     and e["step"] == k_last) if resumed_at <= k_last else started
    phases = _cut([("detect", died["t"]), ("relaunch", relaunch["t"]),
                   ("process_start", slowest("baseline.imported")),
                   ("rendezvous", slowest("baseline.pg_ready")), ("init_and_load", started),
                   ("recompute", recomputed), ("first_step", t_end)], t_crash)
    return phases, {"t_end": t_end, "k_last": k_last, "resumed_at": resumed_at,
                    "recomputed_steps": max(0, k_last + 1 - resumed_at)}


def spread(values: Sequence[float]) -> dict[str, float]:
    """Median and range of repeated measurements (3 repeats: the range is the honest spread)."""
    if not values:
        raise HpctError("no measurements to summarise")
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def summarize(repeats: Sequence[dict], state_mb: float,
              failed: Sequence[dict] = ()) -> dict:
    """The one-line summary: medians over the repeats where both methods recovered; lost steps
    is the worst repeat, bit-equality must hold in every repeat, failed runs are counted."""
    hpct = [r["hpct"]["recovery_s"] for r in repeats]
    base = [r["baseline"]["recovery_s"] for r in repeats]
    h, b = statistics.median(hpct), statistics.median(base)
    return {
        "bench": NAME,
        "hpct_recovery_s": round(h, 3),
        "baseline_recovery_s": round(b, 3),
        "ratio": round(h / b, 4) if b > 0 else None,
        "lost_steps": max(r["hpct"]["lost_steps"] for r in repeats),
        "baseline_recomputed_steps": statistics.median(r["baseline"]["recomputed_steps"]
                                                       for r in repeats),
        "bitwise_equal": all(r["hpct"]["bitwise_equal"] for r in repeats),
        "baseline_bitwise_equal": all(r["baseline"]["bitwise_equal"] for r in repeats),
        "state_mb": round(state_mb, 1),
        "repeats": len(repeats),
        "failed_runs": {m: sum(f["method"] == m for f in failed) for m in ("hpct", "baseline")},
        "spread_s": {"hpct": [round(min(hpct), 3), round(max(hpct), 3)],
                     "baseline": [round(min(base), 3), round(max(base), 3)]},
        "phases": {m: {p: round(statistics.median(r[m]["phases"][p] for r in repeats), 4)
                       for p in phases}
                   for m, phases in (("hpct", HPCT_PHASES), ("baseline", BASELINE_PHASES))},
        # The phases are consecutive cuts of the critical path: in every repeat they add up
        # to that repeat's recovery time (to the rounding of the event clock).
        "phases_add_up": all(abs(sum(r[m]["phases"].values()) - r[m]["recovery_s"]) < 1e-3
                             for r in repeats for m in ("hpct", "baseline")),
        # Phases the issue names that this job has no separate time for, and why.
        "phase_notes": {
            "data_reattach": "none in either method: the benchmark's batches are generated "
                             "from (seed, rank, step); `hpct-slurm bench cache` measures a "
                             "warm re-attach of the per-node cache",
            "recompute": "hpct: lost_steps (0: nothing recomputed); baseline: the "
                         "'recompute' phase and baseline_recomputed_steps",
            "stop": "hpct 'stop' is the STOP broadcast; the baseline has none (Slurm's "
                    "node timeout ends the dead step, then every rank is relaunched)",
            "overlap": "hpct survivors report ready once their state is captured (the broken "
                       "group's teardown runs on, in the background), and the spare pulls its "
                       "state from every survivor at once while the group forms: "
                       "'state_transfer' is what of the restore did not overlap 'reform'",
        },
    }


def _say(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def wait_unless_escalated(cluster: LocalCluster, job_id: int, run_dir: Path,
                           timeout: float) -> None:
    """Wait for the job to leave the queue. A recovery that escalated (requeue or fail) is a
    failed repeat: cancel the job instead of timing a restart from disk."""
    deadline = time.monotonic() + timeout
    slurm = cluster.client()
    while time.monotonic() < deadline:
        bad = [e for e in controller_events(run_dir)
               if e["event"] in ("recovery.failed", "escalate.requeue", "escalate.fail")]
        if bad or slurm.job_finished(job_id):
            if bad:
                cancel(cluster, job_id)
                raise HpctError(f"job {job_id} escalated instead of recovering in place: "
                                f"{bad[0].get('error') or bad[0].get('reason')}; see {run_dir}")
            return
        time.sleep(0.5)
    cancel(cluster, job_id)
    raise HpctError(f"job {job_id} did not finish within {timeout:.0f} s; see {run_dir}")


def _run_one(cluster: LocalCluster, d: Path, cfg: Config, ref: dict[int, dict],
             method: str) -> dict:
    if method == "hpct":
        jid = submit(cluster, d, TEMPLATE, [sys.executable, "-m", "hpct_slurm.examples.train",
                                            *cfg.train_args()])
    else:
        jid = submit_baseline(cluster, d, cfg.train_args(), cfg.ckpt_every)
    t_crash = crash_at(cluster, d, cfg.kill_at, cfg.timeout_s)
    wait_unless_escalated(cluster, jid, d, cfg.timeout_s)
    run = RunResult(method, d, jid, t_crash, collect(d, WORLD))
    ctl, ranks = run.controller_events(), run.events()
    if method == "hpct":
        phases, outline = hpct_phases(ctl, ranks, t_crash)
        done = _first(ctl, "recovery.done", t_crash)
        outline["lost_steps"] = max(0, outline["k_last"] - outline["restore_step"],
                                    recomputed_steps(d))
        outline["controller_recovery_s"] = done["recovery_s"]
    else:
        phases, outline = baseline_phases(ctl, ranks, t_crash)
    return {"run_dir": str(d), "job_id": jid, "recovery_s": outline.pop("t_end") - t_crash,
            "bitwise_equal": bitwise_equal(ref, run.results, d), "phases": phases, **outline}


def _drop_bulk(d: Path) -> None:
    """Persisted snapshots and checkpoints are 100 MB each: keep events and logs only."""
    shutil.rmtree(d / "persist", ignore_errors=True)
    for f in d.glob("ckpt.*"):
        f.unlink()


def _plot(path: Path, summary: dict, repeats: Sequence[dict]) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for ax, method, phases, color in ((axes[0], "hpct", HPCT_PHASES, "#4c72b0"),
                                      (axes[1], "baseline", BASELINE_PHASES, "#dd8452")):
        vals = [[r[method]["phases"][p] for r in repeats] for p in phases]
        med = [statistics.median(v) for v in vals]
        err = [[m - min(v) for m, v in zip(med, vals)], [max(v) - m for m, v in zip(med, vals)]]
        bars = ax.barh(list(phases), med, xerr=err, capsize=3, color=color)
        ax.bar_label(bars, fmt="%.3g", padding=3)
        ax.invert_yaxis()
        ax.set_xlabel("seconds (median, range over repeats)")
        total = summary[f"{method}_recovery_s"]
        ax.set_title(f"{'hpct-slurm' if method == 'hpct' else 'restart-all'}: {total:.3g} s "
                     f"to back-to-speed")
    fig.suptitle(f"node crash, {summary['state_mb']} MB state, {summary['repeats']} repeat(s): "
                 f"ratio {summary['ratio']}")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _measure(cluster: LocalCluster, work: Path, cfg: Config,
             down: bool) -> tuple[list[dict], list[dict]]:
    """One reference run, then `repeats` x (hpct, baseline), healing the cluster after each;
    the repeats where both recovered, and the failures."""
    try:
        d = work / "reference"
        jid = submit(cluster, d, TEMPLATE, [sys.executable, "-m", "hpct_slurm.examples.train",
                                            *cfg.train_args()])
        wait_job(cluster, jid, d, cfg.timeout_s, label="reference")
        ref = collect(d, WORLD)
        _drop_bulk(d)
        repeats, failed = [], []
        for i in range(cfg.repeats):
            rep = {}
            for method in ("hpct", "baseline"):
                d = work / f"{method}{i}"
                try:
                    rep[method] = _run_one(cluster, d, cfg, ref, method)
                    _say(f"[recovery] repeat {i + 1}/{cfg.repeats} {method}: "
                         f"{rep[method]['recovery_s']:.3f} s")
                except HpctError as exc:
                    # reported, never dropped silently: the summary counts failed repeats
                    failed.append({"repeat": i, "method": method, "error": exc.message})
                    _say(f"[recovery] repeat {i + 1}/{cfg.repeats} {method} FAILED: "
                         f"{exc.message}")
                _drop_bulk(d)
                cluster.heal()
            if len(rep) == 2:
                repeats.append(rep)
    finally:
        if down:
            cluster.down()
    return repeats, failed


def run(out_dir: Path, quick: bool = False, root: Path = BENCH_ROOT,
        down: bool = False) -> dict:
    """Run the benchmark on the cluster under `root` (brought up if needed, left up unless
    `down`); writes recovery.json and recovery.png to `out_dir`; returns the summary."""
    cfg = QUICK if quick else FULL
    out_dir = Path(out_dir)
    t_start = time.monotonic()
    nbytes = state_bytes(cfg.hidden, cfg.layers)
    _say(f"[recovery] local cluster: {NODES} nodes under {root}; state {nbytes / 1e6:.1f} MB; "
         f"{cfg.repeats} repeat(s) of hpct vs restart-all, crash at step {cfg.kill_at}")
    cluster = ready_cluster(root, NODES)
    work = fresh_work_dir(root, "bench-recovery")
    # progress to stderr: stdout's last line is the summary
    with contextlib.redirect_stdout(sys.stderr):
        repeats, failed = _measure(cluster, work, cfg, down)
    if not repeats:
        raise HpctError(f"every repeat failed: {failed}")
    summary = summarize(repeats, nbytes / 1e6, failed)
    out_dir.mkdir(parents=True, exist_ok=True)
    _plot(out_dir / f"{NAME}.png", summary, repeats)
    write_result(out_dir, NAME, {
        "summary": summary, "quick": quick, "config": asdict(cfg), "state_bytes": nbytes,
        "world": WORLD, "victim": VICTIM, "repeat_details": repeats, "failed": failed,
        "spread": {"hpct": spread([r["hpct"]["recovery_s"] for r in repeats]),
                   "baseline": spread([r["baseline"]["recovery_s"] for r in repeats])},
        "wall_s": time.monotonic() - t_start, "work_dir": str(work), "method": __doc__,
        "when": datetime.datetime.now(datetime.timezone.utc).isoformat(),
    })
    return summary
