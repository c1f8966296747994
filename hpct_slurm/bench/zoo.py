"""Each script shape's recovery from a node crash beside the demo job's, in one run on one local
Slurm cluster.

The shapes: the demo's job (examples/train.py, the MLP `hpct-slurm demo` and `bench recovery`
train) and each of examples/zoo.py's (`bn_cnn`, `ema_lion`, `compile_lm`), all 4 active nodes +
1 spare through the shipped sbatch template, the same number of steps of ~0.1 s. Each shape runs
once without a fault (its reference), then once per crash moment: node n3 hard-crashed
(`kill_node`: slurmd, slurmstepd and the rank SIGKILLed) once some rank completed the moment's
step, and that many seconds into the next. The moments are drawn from one seeded generator, so
every shape is crashed at the same moments and a rerun repeats them.

Per crash: the controller's recovery.done of the crash's round (recovery_s, detection to every
rank's first step, and its phases), crash to that event (detection included), how many recovery
rounds the run took (a later one, such as a cross-check's rollback, is the job's cost too), the
steps lost (rolled back or computed twice), and whether the run ends bit-identical to the
shape's own reference. Per shape: median,
min and max recovery, and the median's ratio to the demo's median (goal: at most 2).
"""
from __future__ import annotations

import contextlib
import datetime
import random
import statistics
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Sequence

from ..controller.policy import PHASES
from ..errors import HpctError
from ..localcluster import LocalCluster
from ..localcluster.jobs import (NODES, TEMPLATE, VICTIM, bitwise_equal, collect,
                                 controller_events, crash_at, fresh_work_dir, ready_cluster,
                                 recomputed_steps, step_events, submit, wait_job, wait_step)
from ..examples.zoo import SHAPES as ZOO_SHAPES
from .common import write_result
from .recovery import BENCH_ROOT, spread, wait_unless_escalated

NAME = "zoo"
DEMO = "demo"
SHAPES = (DEMO, *ZOO_SHAPES)
WORLD = NODES - 1
# zoo.py's data: 512 samples over 4 ranks in batches of 16
STEPS_PER_EPOCH = 8
WITHIN = 2.0  # a shape's median recovery may be at most this many times the demo's


@dataclass(frozen=True)
class Config:
    epochs: int
    crashes: int
    seed: int = 0
    step_sleep: float = 0.1
    timeout_s: float = 240.0

    @property
    def steps(self) -> int:
        return self.epochs * STEPS_PER_EPOCH


FULL = Config(epochs=4, crashes=3)
QUICK = Config(epochs=2, crashes=1)


@dataclass(frozen=True)
class Moment:
    """When a node crashes: once some rank completed `step`, and `delay_s` later (inside the
    next step's compute or its pause)."""
    step: int
    delay_s: float


def crash_moments(seed: int, n: int, steps: int, step_s: float) -> list[Moment]:
    """`n` seeded crash moments in a run of `steps` steps. Never in step 0 (the formation's
    first step is a case of its own) and at least 4 steps before the end, so that every rank of
    the recovered job completes a step after the crash."""
    if steps < 6:
        raise HpctError(f"{steps} steps leave no room for a crash: give at least 6")
    rng = random.Random(seed)
    return [Moment(rng.randint(1, steps - 5), round(rng.uniform(0.0, step_s), 3))
            for _ in range(n)]


def argv(shape: str, cfg: Config, step_sleep: float) -> list[str]:
    """The shape's training command, `cfg.steps` steps long, paced at `step_sleep` s a step."""
    if shape == DEMO:
        return [sys.executable, "-m", "hpct_slurm.examples.train", "--steps", str(cfg.steps),
                "--step-sleep", str(step_sleep)]
    return [sys.executable, "-m", "hpct_slurm.examples.zoo", "--shape", shape,
            "--epochs", str(cfg.epochs), "--step-sleep", str(step_sleep)]


def same_state(ref: dict[int, dict], got: dict[int, dict]) -> bool:
    """A zoo run's results equal its reference's: every rank's digest of every registered
    object's whole state (parameters, buffers, optimizer moments, the EMA)."""
    return set(got) == set(ref) and all(got[r]["state_sha256"] == ref[r]["state_sha256"]
                                        for r in ref)


def crash_round(done: Sequence[dict]) -> dict:
    """A crash's recovery from the run's recovery.done events: the first is the crash's own
    round, the figure the demo's recovery is. A later round (a fault during the recovery, a
    cross-check that rolled the group back) is counted in `rounds` and its seconds in
    `later_rounds_s`; the steps it rolled back show in the run's lost steps."""
    return {"recovery_s": done[0]["recovery_s"], "phases": done[0]["phases"],
            "rounds": len(done), "later_rounds_s": sum(e["recovery_s"] for e in done[1:])}


def summarize(runs: Sequence[dict], failed: Sequence[dict] = ()) -> dict:
    """Per shape over its good runs: median/min/max of the crash round's recovery_s, the
    median's ratio to the demo's, crash-to-done and phase medians, the most rounds and lost
    steps of any run, bit-identity in every run;
    and whether every shape's median is within WITHIN x the demo's (None without a demo)."""
    shapes: dict[str, dict] = {}
    for shape in dict.fromkeys(r["shape"] for r in (*runs, *failed)):
        good = [r for r in runs if r["shape"] == shape]
        row = {"runs": len(good), "failed": sum(f["shape"] == shape for f in failed)}
        if good:
            row.update({k: round(v, 3) for k, v in
                        spread([r["recovery_s"] for r in good]).items()})
            row["crash_to_done_s"] = round(statistics.median(r["crash_to_done_s"]
                                                             for r in good), 3)
            row["phases"] = {p: round(statistics.median(r["phases"][p] for r in good), 4)
                             for p in PHASES}
            row["lost_steps"] = max(r["lost_steps"] for r in good)
            row["rounds"] = max(r["rounds"] for r in good)
            row["bit_identical"] = all(r["bit_identical"] for r in good)
        shapes[shape] = row
    demo = shapes.get(DEMO, {}).get("median")
    for row in shapes.values():
        row["ratio"] = round(row["median"] / demo, 2) if demo and "median" in row else None
    ratios = [row["ratio"] for row in shapes.values()]
    return {
        "bench": NAME,
        "demo_median_s": demo,
        "within_2x": None if demo is None else all(x is not None and x <= WITHIN
                                                   for x in ratios),
        "all_bit_identical": all(row.get("bit_identical", False) for row in shapes.values()),
        "lost_steps": max((row.get("lost_steps", 0) for row in shapes.values()), default=0),
        "rounds": max((row.get("rounds", 0) for row in shapes.values()), default=0),
        "failed_runs": len(failed),
        "shapes": shapes,
    }


def table(summary: dict) -> str:
    """The summary as a Markdown table, one row per shape (a shape with no good run: '-')."""
    head = ("| shape | crashes | median s | min s | max s | x demo | crash→done s | "
            "detect→stop | fence | survivors ready | reform+restore+step | rounds | "
            "lost steps | bit-identical |")
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for shape, row in summary["shapes"].items():
        crashes = f"{row['runs']}" + (f" (+{row['failed']} failed)" if row["failed"] else "")
        if not row["runs"]:
            lines.append(f"| {shape} | {crashes} |" + " - |" * 12)
            continue
        ph = row["phases"]
        lines.append(
            f"| {shape} | {crashes} | {row['median']:.3f} | {row['min']:.3f} | "
            f"{row['max']:.3f} | {row['ratio']} | {row['crash_to_done_s']:.3f} | "
            f"{ph['detect_to_stop']:.3f} | {ph['fence']:.3f} | {ph['survivors_ready']:.3f} | "
            f"{ph['reform_restore_first_step']:.3f} | {row['rounds']} | {row['lost_steps']} | "
            f"{'yes' if row['bit_identical'] else 'NO'} |")
    return "\n".join(lines)


def _say(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def _crash_run(cluster: LocalCluster, d: Path, shape: str, cfg: Config, moment: Moment,
               ref: dict[int, dict]) -> dict:
    jid = submit(cluster, d, TEMPLATE, argv(shape, cfg, cfg.step_sleep))
    wait_step(d, moment.step, cfg.timeout_s)
    time.sleep(moment.delay_s)
    t_crash = crash_at(cluster, d, moment.step, cfg.timeout_s)
    wait_unless_escalated(cluster, jid, d, cfg.timeout_s)
    done = [e for e in controller_events(d) if e["event"] == "recovery.done"]
    if not done:
        raise HpctError(f"the job ended with no recovery.done: see {d}")
    got = collect(d, WORLD)
    if shape == DEMO:
        identical = bitwise_equal(ref, got, d)
    else:
        # every step done by the group (a step lost with the crashed rank's log shows in the
        # survivors'), and every object's state equal at the end
        steps = {e["step"] for e in step_events(d)}
        identical = same_state(ref, got) and steps >= set(range(cfg.steps))
    return {"shape": shape, "step": moment.step, "delay_s": moment.delay_s, "run_dir": str(d),
            "job_id": jid, **crash_round(done), "crash_to_done_s": done[0]["t"] - t_crash,
            "lost_steps": max(max(e["lost_steps"] for e in done), recomputed_steps(d)),
            "taken": [e["taken"] for e in done], "bit_identical": identical}


def _measure(cluster: LocalCluster, work: Path, cfg: Config,
             moments: Sequence[Moment]) -> tuple[list[dict], list[dict]]:
    """Per shape: its reference run, then one run per crash moment, healing the cluster after
    each; the good runs and the failures (a failure is counted, never dropped)."""
    runs, failed = [], []
    for shape in SHAPES:
        d = work / shape / "reference"
        try:
            jid = submit(cluster, d, TEMPLATE, argv(shape, cfg, 0.0))
            wait_job(cluster, jid, d, cfg.timeout_s, label=f"{shape}-reference")
            ref = collect(d, WORLD)
        except HpctError as exc:
            failed += [{"shape": shape, "step": m.step, "error": f"reference: {exc.message}"}
                       for m in moments]
            _say(f"[zoo] {shape} reference FAILED: {exc.message}")
            cluster.heal()
            continue
        for i, m in enumerate(moments):
            try:
                r = _crash_run(cluster, work / shape / f"crash{i}", shape, cfg, m, ref)
                runs.append(r)
                _say(f"[zoo] {shape} crash {i + 1}/{len(moments)} after step {m.step} "
                     f"+{m.delay_s:.3f} s: recovery {r['recovery_s']:.3f} s, "
                     f"bit-identical {r['bit_identical']}")
            except HpctError as exc:
                failed.append({"shape": shape, "step": m.step, "error": exc.message})
                _say(f"[zoo] {shape} crash {i + 1}/{len(moments)} FAILED: {exc.message}")
            cluster.heal()
    return runs, failed


def _plot(path: Path, summary: dict) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = {s: r for s, r in summary["shapes"].items() if r["runs"]}
    med = [r["median"] for r in rows.values()]
    err = [[r["median"] - r["min"] for r in rows.values()],
           [r["max"] - r["median"] for r in rows.values()]]
    fig, ax = plt.subplots(figsize=(7, 4))
    bars = ax.bar(list(rows), med, yerr=err, capsize=4,
                  color=["#dd8452" if s == DEMO else "#4c72b0" for s in rows])
    ax.bar_label(bars, fmt="%.3g", padding=3)
    if summary["demo_median_s"]:
        ax.axhline(WITHIN * summary["demo_median_s"], color="#c44e52", linestyle="--",
                   label=f"{WITHIN:g} x the demo's median")
        ax.legend()
    ax.set_ylabel("recovery s (recovery.done: median, range)")
    ax.set_title(f"node crash at the same {max(r['runs'] for r in rows.values())} seeded "
                 f"moments per shape")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def run(out_dir: Path, quick: bool = False, root: Path = BENCH_ROOT,
        down: bool = False) -> dict:
    """Run the benchmark on the cluster under `root` (brought up if needed, left up unless
    `down`); prints the table, writes zoo.json and zoo.png to `out_dir`; returns the summary."""
    cfg = QUICK if quick else FULL
    out_dir = Path(out_dir)
    t_start = time.monotonic()
    moments = crash_moments(cfg.seed, cfg.crashes, cfg.steps, cfg.step_sleep)
    _say(f"[zoo] local cluster: {NODES} nodes under {root}; shapes {', '.join(SHAPES)}; "
         f"{cfg.steps} steps; {VICTIM} crashed after steps "
         f"{', '.join(f'{m.step}+{m.delay_s:.3f}s' for m in moments)}")
    cluster = ready_cluster(root, NODES, who="bench zoo")
    work = fresh_work_dir(root, "bench-zoo")
    try:
        # the harness's progress to stderr: stdout's last line is the summary
        with contextlib.redirect_stdout(sys.stderr):
            runs, failed = _measure(cluster, work, cfg, moments)
    finally:
        if down:
            cluster.down()
    if not runs:
        raise HpctError(f"every run failed: {failed}")
    summary = summarize(runs, failed)
    out_dir.mkdir(parents=True, exist_ok=True)
    _plot(out_dir / f"{NAME}.png", summary)
    write_result(out_dir, NAME, {
        "summary": summary, "quick": quick, "config": asdict(cfg),
        "moments": [asdict(m) for m in moments], "world": WORLD, "victim": VICTIM,
        "runs": runs, "failed": failed, "table": table(summary),
        "wall_s": time.monotonic() - t_start, "work_dir": str(work), "method": __doc__,
        "when": datetime.datetime.now(datetime.timezone.utc).isoformat(),
    })
    print(table(summary), flush=True)
    return summary
