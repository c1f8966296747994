"""Fail-slow: one node really slowed, found and moved out, on the real local Slurm cluster.

The demo job (4 active nodes + 1 warm spare, one rank per node) trains with a step of about
--step-sleep seconds. From step `slow_from` on, the rank on n2 spends (F - 1) x step-sleep
longer loading each step's data (examples/train.py --slow-node: a real delay in that rank's own
time; nothing the controller reads), so every rank waits for it at each gradient all-reduce.
For each factor F the same job runs twice:
  on   HPCT_FAILSLOW=move, the ratio and window at their defaults: the controller should name
       n2 in `node.slow` once its own time per step stays above HPCT_SLOW_RATIO x the others'
       median for a window and holds over a window more, drain it and move its rank onto the
       spare (move.requested .. move.done);
  off  HPCT_FAILSLOW=off: nothing measured or acted on; the job runs at n2's pace to the end;
plus one reference run with no slowdown (detection on: it must name nobody), whose final
parameters every run is compared with bit for bit, and whose median step time is the yardstick
of goodput.

Read from each run's events (pure, `analyse_run`):
  the job's step times   when the job completed step k is the last rank's rank.step of k;
                         a step's time is that minus the same for k - 1;
  before / during / after  median step time over [warmup, slow_from), [slow_from, the last
                         step before the move's STOP] and [the second step after the move, end]
                         (the first step after the move holds the move's pause);
  steps to detection     node.slow's step - slow_from;
  move pause             move.done's recovery_s (STOP to the first step every rank completed),
                         and its lost_steps; recomputed (rank, step) pairs from the rank logs;
                         the job's time for the first step after the move (`move_step_s`:
                         the pause less the work it overlapped: the step in progress at the
                         STOP is completed, the first step after it computed);
  goodput                (steps trained x the reference's median step time) / the training's
                         wall time (first to last completed step): 1.0 is the unslowed pace.
"""
from __future__ import annotations

import contextlib
import datetime
import os
import statistics
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Sequence

from .. import config
from ..errors import HpctError
from ..localcluster.jobs import (NODES, TEMPLATE, bitwise_equal, collect, controller_events,
                                 fresh_work_dir, ready_cluster, recomputed_steps, step_events,
                                 submit, wait_job)
from .common import write_result
from .recovery import BENCH_ROOT

NAME = "failslow"
ACTIVE, SPARES = NODES - 1, 1
SLOW_NODE = "n2"
# The first steps hold process start and the group's first collectives, not the pace.
WARMUP = 5


@dataclass(frozen=True)
class Config:
    steps: int
    slow_from: int
    factors: tuple[float, ...]
    step_sleep: float
    window: int | None = None  # HPCT_SLOW_WINDOW for the job; None: the settings' default
    timeout_s: float = 900.0


# A rank's figure is a median over its window, so a slowed node is found once more than half
# of its window is slow: with the default 50 steps, about 26 steps after the slowdown starts,
# and named once that has held for 50 more (controller/slowness.Hold). 250 steps of ~0.3 s
# leave well over 100 steps after the move to measure. The step is mostly the sleep, so a
# rank's own time grows by nearly the factor (the MLP's compute and the snapshot do not
# grow); 1.1x is below the default 1.2 ratio on purpose.
FULL = Config(steps=250, slow_from=40, factors=(1.1, 1.25, 2.0), step_sleep=0.3)
QUICK = Config(steps=160, slow_from=20, factors=(2.0, 1.25), step_sleep=0.25)


# ---- what one run's events say (pure) ---------------------------------------------------------

def job_step_ends(steps: Sequence[dict]) -> dict[int, float]:
    """When the job completed each step: the latest rank.step of it (the last rank to finish;
    a synchronous step is done for the job when it is done for every rank)."""
    out: dict[int, float] = {}
    for e in steps:
        if e.get("event") == "rank.step":
            out[e["step"]] = max(out.get(e["step"], e["t"]), e["t"])
    return out


def step_times(ends: dict[int, float]) -> dict[int, float]:
    """Step k's time: its end less step k-1's end (where both are known)."""
    return {k: ends[k] - ends[k - 1] for k in sorted(ends) if k - 1 in ends}


def _median(times: dict[int, float], lo: int, hi: int | None) -> float | None:
    vals = [v for k, v in times.items() if k >= lo and (hi is None or k <= hi)]
    return statistics.median(vals) if vals else None


def _first(events: Sequence[dict], name: str, after: float = 0.0, **match) -> dict | None:
    for e in sorted(events, key=lambda e: e["t"]):
        if e["event"] == name and e["t"] >= after and \
                all(e.get(k) == v for k, v in match.items()):
            return e
    return None


def _step_at(ends: dict[int, float], t: float) -> int:
    """The highest step the job had completed at time t (-1: none yet)."""
    return max((k for k, te in ends.items() if te <= t), default=-1)


def goodput(ends: dict[int, float], ref_step_s: float) -> float | None:
    """Steps trained x the unslowed step time / the wall time they took (first to last
    completed step): the share of the unslowed pace the run kept."""
    if len(ends) < 2 or not ref_step_s:
        return None
    first, last = min(ends), max(ends)
    wall = ends[last] - ends[first]
    return (last - first) * ref_step_s / wall if wall > 0 else None


def analyse_run(controller: Sequence[dict], steps: Sequence[dict], slow_from: int | None,
                ref_step_s: float | None, node: str = SLOW_NODE, warmup: int = WARMUP) -> dict:
    """Detection, move and the job's pace of one run from its controller's and ranks' events.
    `slow_from` None: no slowdown (the reference run); `ref_step_s` None: no goodput."""
    ends = job_step_ends(steps)
    if not ends:
        raise HpctError("the run completed no step")
    times = step_times(ends)
    slow = [e for e in controller if e["event"] == "node.slow"]
    said = _first(slow, "node.slow", node=node)
    out: dict = {
        "steps": max(ends) + 1,
        "train_wall_s": ends[max(ends)] - ends[min(ends)],
        "node_slow_events": len(slow),
        # a node.slow naming any other node, or any at all in a run with no slowdown
        "false_detections": sum(1 for e in slow if e.get("node") != node or slow_from is None),
        "detected": said is not None,
        "escalated": any(e["event"].startswith("escalate.") or e["event"] == "move.failed"
                         for e in controller),
    }
    if said is not None:
        step = said.get("step")
        step = int(step) if isinstance(step, int) else _step_at(ends, said["t"])
        out.update(detect_step=step,
                   steps_to_detection=step - slow_from if slow_from is not None else None,
                   ratio=said.get("ratio"), node_s=said.get("node_s"), job_s=said.get("job_s"),
                   window=said.get("window"), action=said.get("action"))
    requested = _first(controller, "move.requested", said["t"] if said else 0.0, node=node)
    assign = _first(controller, "move.assign", requested["t"]) if requested else None
    done = _first(controller, "move.done", assign["t"]) if assign else None
    out["moved"] = done is not None
    last_slow = None  # the last step of the slowed pace: the end, or the last before the STOP
    after = None
    if done is not None:
        last_slow = assign.get("newest_done", _step_at(ends, requested["t"]))
        after = _median(times, assign["restore_step"] + 2, None)
        # move.done's pause runs from the STOP: it holds the rest of the step in progress
        # and the whole first step after the move. What the job's clock lost to the move is
        # that first step's time less an ordinary step's (`move_step_s` - step_s.after).
        out.update(move_pause_s=done["recovery_s"], move_phases=done.get("phases"),
                   lost_steps=done.get("lost_steps"), move_step=assign["restore_step"],
                   move_step_s=times.get(assign["restore_step"] + 1),
                   taken=assign.get("taken"), move_done_step=_step_at(ends, done["t"]))
    before_end = (slow_from if slow_from is not None else max(ends) + 1) - 1
    out["step_s"] = {
        "before": _median(times, warmup, before_end),
        "during": _median(times, slow_from, last_slow) if slow_from is not None else None,
        "after": after,
    }
    out["goodput"] = goodput(ends, ref_step_s) if ref_step_s else None
    return out


def side_by_side(factor: float, on: dict, off: dict) -> dict:
    """One factor's row: detection on next to off, and the ratios read across."""
    def ratio(a, b):
        return round(a / b, 4) if a is not None and b else None

    def get(run, *path):
        for p in path:
            run = run.get(p) if isinstance(run, dict) else None
        return run

    return {
        "factor": factor,
        "detected": get(on, "detected"), "steps_to_detection": get(on, "steps_to_detection"),
        "move_pause_s": get(on, "move_pause_s"), "move_step_s": get(on, "move_step_s"),
        "lost_steps": get(on, "lost_steps"),
        "goodput_on": get(on, "goodput"), "goodput_off": get(off, "goodput"),
        "goodput_on_over_off": ratio(get(on, "goodput"), get(off, "goodput")),
        "train_wall_on_over_off": ratio(get(on, "train_wall_s"), get(off, "train_wall_s")),
        "on_after_over_before": ratio(get(on, "step_s", "after"), get(on, "step_s", "before")),
        "off_during_over_before": ratio(get(off, "step_s", "during"),
                                        get(off, "step_s", "before")),
        "bit_identical": bool(get(on, "bit_identical") and get(off, "bit_identical")),
        "on": on, "off": off,
    }


# ---- the runs on the cluster ------------------------------------------------------------------

def _say(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def _train(cfg: Config, factor: float | None) -> list[str]:
    argv = [sys.executable, "-m", "hpct_slurm.examples.train", "--steps", str(cfg.steps),
            "--step-sleep", str(cfg.step_sleep)]
    if factor is not None:
        argv += ["--slow-node", SLOW_NODE, "--slow-factor", str(factor),
                 "--slow-from", str(cfg.slow_from)]
    return argv


def _env(cfg: Config, detection: bool) -> dict[str, str]:
    env = {config.ACTIVE_NODES: str(ACTIVE), config.SPARE_NODES: str(SPARES)}
    if cfg.window is not None:
        env[config.SLOW_WINDOW] = str(cfg.window)
    # fail-slow only reports by default: the 'on' runs ask for the move
    env[config.FAILSLOW] = "move" if detection else "off"
    return env


def one_run(cluster, run_dir: Path, cfg: Config, factor: float | None, detection: bool,
            reference: dict | None, ref_step_s: float | None) -> dict:
    """Run the job once (slowed by `factor`, or not) and read it; a run that fails is a
    record with its error, not the end of the benchmark."""
    label = f"x{factor} {'on' if detection else 'off'}" if factor else "reference"
    t0 = time.time()
    try:
        jid = submit(cluster, run_dir, TEMPLATE, _train(cfg, factor), nodes=ACTIVE + SPARES,
                     env=_env(cfg, detection))
        wait_job(cluster, jid, run_dir, cfg.timeout_s, label=label)
        wall = time.time() - t0
        results = collect(run_dir, ACTIVE)
        out = analyse_run(controller_events(run_dir), step_events(run_dir),
                          cfg.slow_from if factor else None, ref_step_s)
    except HpctError as exc:
        _say(f"[failslow] {label} FAILED: {exc.message}")
        return {"error": exc.message, "run_dir": str(run_dir)}
    node = cluster.client().show_node(SLOW_NODE)
    out.update(job=jid, run_dir=str(run_dir), wall_s=wall,
               recomputed_steps=recomputed_steps(run_dir),
               slow_node_state=node.summary, slow_node_reason=node.reason,
               bit_identical=bitwise_equal(reference, results, run_dir)
               if reference is not None else True,
               results=results)
    _say(f"[failslow] {label}: {wall:.1f} s, detected {out['detected']}, moved "
         f"{out['moved']}, step s {out['step_s']}, goodput {out['goodput']}")
    return out


def _settings(cfg: Config) -> dict:
    """The fail-slow settings the 'on' runs ran with: the table's defaults (the window, the
    config's where it sets one); the 'off' runs had HPCT_FAILSLOW=off."""
    env = _env(cfg, True)
    return {name: config.read(env, name)
            for name in (config.FAILSLOW, config.SLOW_RATIO, config.SLOW_WINDOW)}


def _load() -> dict:
    return {"loadavg": os.getloadavg(), "cpu_count": os.cpu_count()}


def _plot(path: Path, cfg: Config, reference: dict, rows: list[dict]) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(len(rows), 1, figsize=(10, 3 * len(rows)), squeeze=False)
    for ax, row in zip(axes[:, 0], rows):
        for run, name, color in ((reference, "no slowdown", "#999999"),
                                 (row["off"], "detection off", "#dd8452"),
                                 (row["on"], "detection on", "#4c72b0")):
            times = run.get("times") or {}
            ks = sorted(int(k) for k in times)
            ax.plot(ks, [times[k] for k in ks], label=name, color=color, lw=1)
        ax.axvline(cfg.slow_from, color="black", ls="--", lw=1, label="slowdown starts")
        on = row["on"]
        if on.get("detected"):
            ax.axvline(on["detect_step"], color="#c44e52", ls=":", lw=1.5, label="node.slow")
        if on.get("moved"):
            ax.axvline(on["move_done_step"], color="#55a868", ls=":", lw=1.5, label="move.done")
        ax.set_ylabel("job step time (s)")
        ax.set_title(f"{SLOW_NODE} slowed {row['factor']}x from step {cfg.slow_from}: goodput "
                     f"{_fmt(row['goodput_on'])} with detection, {_fmt(row['goodput_off'])} "
                     f"without", fontsize=10)
        ax.set_ylim(bottom=0)
        ax.legend(fontsize=7, loc="upper right")
    axes[-1, 0].set_xlabel("step")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _fmt(x) -> str:
    return "-" if x is None else f"{x:.3f}"


def _with_times(run: dict) -> dict:
    """A run's per-step job times for the plot and the JSON (step -> s)."""
    if "error" in run:
        return run
    d = Path(run["run_dir"])
    run["times"] = {k: round(v, 4) for k, v in step_times(job_step_ends(step_events(d))).items()}
    run.pop("results", None)
    return run


def meter_cost_us(steps: int = 200_000) -> float:
    """What the measurement costs a rank per step, in microseconds: one wait marked around a
    collective and one step's end (own_time.py), timed in a loop here. bench replication's
    headline is a ratio of variants that both pay it, so it cannot show it (issue 47)."""
    from ..recovery.own_time import OwnTime

    m = OwnTime(50)
    t0 = time.perf_counter()
    for _ in range(steps):
        m.wait_begins(time.monotonic())
        m.wait_ends(time.monotonic())
        m.step_ends(0, time.monotonic())
    return (time.perf_counter() - t0) / steps * 1e6


def run(out_dir: Path, quick: bool = False, root: Path = BENCH_ROOT,
        down: bool = False) -> dict:
    """Reference run, then each factor with detection on and off; writes failslow.json and
    failslow.png to `out_dir`; returns the summary."""
    cfg = QUICK if quick else FULL
    out_dir = Path(out_dir)
    t_start = time.monotonic()
    load_before = _load()
    _say(f"[failslow] {ACTIVE} active + {SPARES} spare, {SLOW_NODE} slowed x{cfg.factors} from "
         f"step {cfg.slow_from} of {cfg.steps}, step-sleep {cfg.step_sleep} s")
    cluster = ready_cluster(root, NODES, who="bench failslow")
    work = fresh_work_dir(root, "bench-failslow")
    rows = []
    try:
        with contextlib.redirect_stdout(sys.stderr):  # stdout's last line is the summary
            ref = one_run(cluster, work / "reference", cfg, None, True, None, None)
            if "error" in ref:
                raise HpctError(f"the reference run failed: {ref['error']}")
            ref_results = ref.pop("results")
            ref_step_s = ref["step_s"]["before"]
            # its own pace against its median step: under 1.0 by its first steps' warm-up only
            ref["goodput"] = goodput(job_step_ends(step_events(work / "reference")), ref_step_s)
            for f in cfg.factors:
                pair = {}
                for detection in (True, False):
                    cluster.heal()
                    d = work / f"x{f}-{'on' if detection else 'off'}"
                    pair[detection] = _with_times(one_run(cluster, d, cfg, f, detection,
                                                          ref_results, ref_step_s))
                rows.append(side_by_side(f, pair[True], pair[False]))
            cluster.heal()
    finally:
        if down:
            cluster.down()
    _with_times(ref)
    summary = {
        "bench": NAME, "reference_step_s": ref_step_s,
        "reference_false_detections": ref["false_detections"],
        "per_factor": {str(r["factor"]): {k: r[k] for k in (
            "detected", "steps_to_detection", "move_pause_s", "move_step_s", "lost_steps",
            "goodput_on",
            "goodput_off", "goodput_on_over_off", "bit_identical")} for r in rows},
        "all_bit_identical": all(r["bit_identical"] for r in rows),
        "failed_runs": sum("error" in r[s] for r in rows for s in ("on", "off")),
        "meter_us_per_step": round(meter_cost_us(), 2),
    }
    out_dir.mkdir(parents=True, exist_ok=True)
    _plot(out_dir / f"{NAME}.png", cfg, ref, rows)
    write_result(out_dir, NAME, {
        "summary": summary, "quick": quick, "config": asdict(cfg), "settings": _settings(cfg),
        "slow_node": SLOW_NODE, "active": ACTIVE, "spares": SPARES, "warmup_steps": WARMUP,
        "reference": ref, "factors": rows,
        "load_before": load_before, "load_after": _load(),
        "wall_s": time.monotonic() - t_start, "work_dir": str(work), "method": __doc__,
        "when": datetime.datetime.now(datetime.timezone.utc).isoformat()})
    return summary
