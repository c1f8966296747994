"""hpct-slurm side by side with its peers (issues 29, 44), on the real local Slurm cluster.

The same job for every system: `torchrun_inline.py`'s model, data and schedule (a small
transformer LM, AdamW, cosine schedule, DistributedSampler), 4 active nodes of one rank each
plus 1 spare node, and the same fault: node n3 hard-crashed (`kill_node`: slurmd, slurmstepd and
every task SIGKILLed) at a random moment. Each peer runs in its best documented mode for "4
active + 1 spare node, one node lost", and in the mode the earlier bench ran, labelled:
  hpct-slurm        examples/adopted_inline.py with the step record inserted (`script_text`)
                    under the shipped sbatch template;
  torchft           examples/peers/torchft_ddp.py --spares 1: a fifth replica group live and
                    in sync, contributing zero gradients (WorldSizeMode.FIXED_WITH_SPARES);
  torchft-relaunch  the same script, 4 groups, the lost group relaunched onto the spare node;
  nvrx              examples/peers/nvrx_inprocess.py: in-process restart (inprocess.Wrapper)
                    with a reserve rank on the spare node;
  nvrx-injob        examples/peers/nvrx_ddp.py under ft_launcher: in-job restart of every rank
                    from a checkpoint saved every step.
(bench/peers_driver.py launches the peers; `configuration` says what each was given and which
of the peer's documents each setting comes from.)

One measuring point: every script logs its step through bench/steplog.log_step on the line
right after its optimizer step. The crashes: `Config.crashes` of them per system, the same
schedule for all (`schedule`: from a seed, the step each follows and the moment within the
next step, uniform over the system's fault-free step time, so that some land inside the
all-reduce). One fault-free run per system is its reference. Per crash:
  back_to_full_world_s  from the crash until every one of the 4 data shards completed a step
                        after the last one reached before the crash, at full world size, in
                        the group that trains after it (localcluster.jobs.back_at);
  back_to_speed_s       from the crash until the end of the first full-world step after it
                        that took at most 10 % more than the fault-free pace;
  lost_steps            steps a rank completed more than once (recomputed);
  skipped_batches       batches left out by steps committed at less than full world size;
  seconds_lost          the headline: the run's wall time from the last step before the crash
                        to the end of the step back at speed, minus those steps at the
                        fault-free pace, plus the skipped batches at the fault-free time to
                        train one (a step / 4);
The fault-free pace: the run's own median step over the 10 before the crash (`analyse` says
why; against the fault-free run's time for the rest of the run: `seconds_lost_vs_reference`).
  bitwise_equal         every rank's final parameters equal to the fault-free run's.
Per system: the median and the [min, max] of each, `runs` (the records), `given`, `version`,
`changed_lines` (the script against torchrun_inline.py, `# bench` lines left out). A peer that
is not installed, or all of whose runs failed, carries `error` (the exact message).
"""
from __future__ import annotations

import ast
import contextlib
import datetime
import difflib
import importlib
import importlib.metadata
import json
import os
import random
import statistics
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable, Sequence

from ..errors import HpctError
from ..events import Ev
from ..localcluster import LocalCluster
from ..localcluster.jobs import (NODES, TEMPLATE, VICTIM, back_at, cancel, controller_events,
                                 fresh_work_dir, group_after, rank_events, ready_cluster,
                                 submit, wait_finished)
from . import peers_driver
from .common import write_result
from .recovery import BENCH_ROOT

NAME = "peers"
ACTIVE = NODES - 1
SYSTEMS = ("hpct-slurm", "torchft", "torchft-relaunch", "nvrx", "nvrx-injob")
EXAMPLES = Path(__file__).resolve().parent.parent / "examples"
PLAIN = EXAMPLES / "torchrun_inline.py"
PEERS = EXAMPLES / "peers"
SCRIPTS = {"hpct-slurm": EXAMPLES / "adopted_inline.py", "torchft": PEERS / "torchft_ddp.py",
           "torchft-relaunch": PEERS / "torchft_ddp.py", "nvrx": PEERS / "nvrx_inprocess.py",
           "nvrx-injob": PEERS / "nvrx_ddp.py"}
NVRX = "nvidia-resiliency-ext"
PACKAGES = {"hpct-slurm": ("hpct_slurm", "hpct-slurm"), "torchft": ("torchft", "torchft"),
            "torchft-relaunch": ("torchft", "torchft"),
            "nvrx": ("nvidia_resiliency_ext.inprocess", NVRX),
            "nvrx-injob": ("nvidia_resiliency_ext.fault_tolerance", NVRX)}
INSTALL_HINT = "install the peers extra: pip install '.[peers]'"
SPEED_SLACK = 1.10  # back to speed: a step within 10 % of the fault-free median
METRICS = ("seconds_lost", "back_to_full_world_s", "back_to_speed_s", "lost_steps",
           "skipped_batches")


@dataclass(frozen=True)
class Config:
    epochs: int
    kill_at: int              # the earliest step a crash follows
    step_sleep: float
    crashes: int = 5          # per system, the same schedule for all
    spread: int = 8           # a crash follows step kill_at + [0, spread)
    seed: int = 44
    ckpt_every: int = 1       # NVRx's checkpoint interval (steps), both modes
    heartbeat_ms: int = 500   # torchft Lighthouse --heartbeat_timeout_ms (default 5000)
    torchft_timeout_s: float = 5.0  # Manager and ProcessGroupGloo timeouts
    gloo_timeout_s: float = 3.0     # NVRx in-process: the process group's timeout
    nvrx_heartbeat_s: float = 0.5   # NVRx in-process: the Wrapper's intervals
    timeout_s: float = 300.0

    def script_args(self) -> list[str]:
        return ["--epochs", str(self.epochs), "--step-sleep", str(self.step_sleep)]


STEPS_PER_EPOCH = 8  # 512 samples / (4 ranks x batch 16)
# After the crash the run must outlast torchft-relaunch's recovery (~5 s quiet, 10-20 s with
# the 2-core VM loaded), or its survivors end training before the relaunched group joins them
# (a run of --quick lost that race at load 17: recorded as that run's error). About 0.32 s a
# step: a run takes ~50-80 s (NVRx in-job's ~30 s more), the full bench 5 systems x 6 runs,
# about 40 minutes; --quick 5 x 3, about 15.
FULL = Config(epochs=16, kill_at=30, step_sleep=0.25)
QUICK = Config(epochs=10, kill_at=16, step_sleep=0.25, crashes=2)


@dataclass(frozen=True)
class Crash:
    after_step: int   # the crash comes once some rank logged this step...
    fraction: float   # ...this share of a fault-free step later


def schedule(cfg: Config) -> list[Crash]:
    """The crashes of every system, the same for all: from `cfg.seed` alone. The moments are
    uniform over a step, stratified: the i-th of n lands in [i/n, (i+1)/n) of it (in a random
    order), so that n = 5 cannot all land in the step's sleep (its first ~78 %) and miss the
    forward, backward and all-reduce at its end, as 5 plain draws of seed 44 did."""
    rng = random.Random(cfg.seed)
    strata = list(range(cfg.crashes))
    rng.shuffle(strata)
    return [Crash(cfg.kill_at + rng.randrange(cfg.spread),
                  (i + rng.random()) / cfg.crashes) for i in strata]


# ---- what each system's scripts and packages are ---------------------------------------

def _code(path: Path) -> list[str]:
    """A script's lines after its module docstring, without the bench's own lines."""
    text = path.read_text()
    doc = ast.parse(text).body[0]
    lines = text.splitlines()[doc.end_lineno:]
    return [ln for ln in lines if not ln.rstrip().endswith("# bench")]


def changed_lines(old: list[str], new: list[str], whitespace: bool = True) -> int:
    """tests/test_adoption.py's count: lines touched turning `old` into `new`, a replaced line
    once; with `whitespace`, a re-indented or blank line is a change too (issue 31's way)."""
    a = [line if whitespace else line.strip() for line in old if whitespace or line.strip()]
    b = [line if whitespace else line.strip() for line in new if whitespace or line.strip()]
    ops = difflib.SequenceMatcher(a=a, b=b, autojunk=False).get_opcodes()
    return sum(max(i2 - i1, j2 - j1) for tag, i1, i2, j1, j2 in ops if tag != "equal")


def script_changes(system: str) -> int:
    return changed_lines(_code(PLAIN), _code(SCRIPTS[system]))


STEPLOG_IMPORT = "from hpct_slurm.bench.steplog import log_step  # bench"
STEPLOG_LINE = "log_step(rank, job.step, loss.item(), world, generation=job.generation)  # bench"


def script_text(system: str) -> str:
    """The script the bench runs for `system`. For hpct-slurm: adopted_inline.py with the
    step record inserted right after its optimizer step (and its import), so that the adopted
    script docs/adoption.md shows stays the one source; the peers' scripts carry theirs."""
    text = SCRIPTS[system].read_text()
    if system != "hpct-slurm":
        return text
    lines = text.splitlines()
    at = [i for i, ln in enumerate(lines) if ln.strip() == "opt.step()"]
    imp = [i for i, ln in enumerate(lines) if ln.startswith("from hpct_slurm.")]
    if len(at) != 1 or not imp:
        raise HpctError(f"{SCRIPTS[system]}: expected one `opt.step()` line and an import from "
                        f"hpct_slurm to place the bench's step record")
    indent = lines[at[0]][:len(lines[at[0]]) - len(lines[at[0]].lstrip())]
    lines.insert(at[0] + 1, indent + STEPLOG_LINE)
    lines.insert(imp[0], STEPLOG_IMPORT)
    return "\n".join(lines) + "\n"


def version(system: str) -> str:
    """The installed version of the system's package; an HpctError saying exactly what is
    missing when it is not installed or does not import."""
    module, dist = PACKAGES[system]
    try:
        importlib.import_module(module)
        return importlib.metadata.version(dist)
    except Exception as exc:  # noqa: BLE001 - any import failure is the peer's error
        raise HpctError(f"{system}: {type(exc).__name__}: {exc}; {INSTALL_HINT}") from None


# ---- the record of one run -------------------------------------------------------------

def bench_steps(run_dir: Path) -> list[dict]:
    """The run's step records (bench/steplog.py), every system's alike."""
    return [e for e in rank_events(run_dir) if e.get("event") == Ev.BENCH_STEP]


def _committed(steps: Sequence[dict]) -> list[dict]:
    """Steps that were applied, by a rank that trained a data shard (a torchft spare logs -1)."""
    return [e for e in steps if e.get("committed", True) and e["rank"] >= 0]


def recomputed(steps: Sequence[dict]) -> int:
    """Steps some rank completed more than once."""
    seen: dict[tuple[int, int], int] = {}
    for e in _committed(steps):
        seen[(e["rank"], e["step"])] = seen.get((e["rank"], e["step"]), 0) + 1
    return len({s for (_, s), n in seen.items() if n > 1})


def reduced(steps: Sequence[dict], world: int) -> tuple[int, int]:
    """Steps committed at less than full world size, and the batches they left out."""
    by_step: dict[int, int] = {}
    for e in _committed(steps):
        by_step[e["step"]] = max(by_step.get(e["step"], 0), e.get("world", world))
    short = {s: w for s, w in by_step.items() if w < world}
    return len(short), sum(world - w for w in short.values())


def finished_at(steps: Sequence[dict], step: int) -> float:
    """When the group completed `step`: the latest of its ranks' completions."""
    ts = [e["t"] for e in _committed(steps) if e["step"] == step]
    if not ts:
        raise HpctError(f"no rank completed step {step}")
    return max(ts)


def step_time(ref_steps: Sequence[dict], last: int, first: int = 0) -> float:
    """The median step from `first` to `last`: between the group's completions of steps in a
    row."""
    done = [finished_at(ref_steps, s) for s in range(first, last + 1)]
    return statistics.median(b - a for a, b in zip(done, done[1:]))


def seconds_lost(run_span: float, ref_span: float, skipped: int, ref_step_s: float,
                 world: int = ACTIVE) -> float:
    """Wall time lost to the fault against the fault-free run, counting each skipped batch as
    the fault-free time to train one (a step trains `world` batches in `ref_step_s`)."""
    return run_span - ref_span + skipped * ref_step_s / world


def full_world(system: str, steps: Sequence[dict], t_kill: float,
               controller: Sequence[dict] = ()) -> Callable[[dict], bool]:
    """Which step records are the group that trains after the crash, at full world size."""
    if system == "hpct-slurm":  # the first generation the controller starts after the crash
        return group_after(controller, t_kill)[1]
    if system.startswith("torchft"):  # every shard committed at world 4 (a spare logs -1)
        return lambda e: e["t"] > t_kill and e.get("world") == ACTIVE and \
            e.get("committed", True) and e["rank"] >= 0
    if system == "nvrx":  # in-process: the Wrapper's restart iteration after the crash's
        gen = max((e["generation"] for e in steps if e["t"] < t_kill), default=0)
        return lambda e: e["generation"] > gen
    # nvrx-injob: every rank restarted by the launchers (its process started after the crash)
    return lambda e: e["started"] > t_kill


def back_to_speed(steps: Sequence[dict], new: Callable[[dict], bool], t_kill: float,
                  ref_step_s: float) -> tuple[int, float]:
    """The first full-world step after the crash (both its end and the previous step's by all
    4 shards of the new group) that took at most SPEED_SLACK times the fault-free step
    `ref_step_s`, and the seconds from the crash to its end."""
    by_step: dict[int, dict[int, float]] = {}
    for e in _committed(steps):
        if new(e):
            by_step.setdefault(e["step"], {})[e["rank"]] = e["t"]
    done = {s: max(r.values()) for s, r in by_step.items() if len(r) == ACTIVE}
    for s in sorted(done):
        if s - 1 in done and done[s] - done[s - 1] <= SPEED_SLACK * ref_step_s:
            return s, done[s] - t_kill
    raise HpctError(f"never back to speed (a full-world step within "
                    f"{SPEED_SLACK:.2f} x {ref_step_s:.3f} s) after the crash")


PACE_STEPS = 10  # the fault-free pace: the run's own median over this many steps before the crash


def analyse(system: str, steps: Sequence[dict], ref_steps: Sequence[dict], t_kill: float,
            last: int, controller: Sequence[dict] = ()) -> dict:
    """One crash run's numbers (pure: from the records).

    The fault-free pace is this run's own median step over the PACE_STEPS steps before the
    crash, and the loss is counted up to the end of the step that was back at speed (after
    it the run goes at that pace again): the 2 cores are shared with other engineers'
    clusters, whose load moves a 30 s stretch by seconds either way. Against the reference
    run's time for the rest of the training, as first measured, hpct-slurm's loss came out
    -4.4 s to +1.6 s in one bench; that figure is kept as `seconds_lost_vs_reference`."""
    k_last = max((e["step"] for e in _committed(steps) if e["t"] < t_kill), default=-1)
    if k_last < 2:
        raise HpctError(f"the crash came at step {k_last}: too early to know the run's pace")
    before = [e for e in steps if e["t"] < t_kill]
    pace = step_time(before, k_last, max(0, k_last - PACE_STEPS))
    ref_step_s = step_time(ref_steps, last)
    new = full_world(system, steps, t_kill, controller)
    full = back_at(steps, k_last, range(ACTIVE), lambda e: e.get("committed", True) and new(e),
                   event=Ev.BENCH_STEP) - t_kill
    at_speed, speed_s = back_to_speed(steps, new, t_kill, pace)
    short, skipped = reduced([e for e in steps if e["t"] > t_kill], ACTIVE)
    # timed from the group's completion of the last step before the crash (its completion
    # before the crash: a recomputed one is not that point)
    t_from = max(e["t"] for e in _committed(before) if e["step"] == k_last)
    took = t_kill + speed_s - t_from
    span = finished_at(steps, last) - t_from
    ref_span = finished_at(ref_steps, last) - finished_at(ref_steps, k_last)
    return {"seconds_lost": round(seconds_lost(took, (at_speed - k_last) * pace, skipped,
                                               pace), 3),
            "back_to_full_world_s": round(full, 3), "back_to_speed_s": round(speed_s, 3),
            "lost_steps": recomputed(steps), "skipped_batches": skipped,
            "reduced_world_steps": short, "k_last": k_last, "at_speed_step": at_speed,
            "pace_s": round(pace, 4),
            "seconds_lost_vs_reference": round(seconds_lost(span, ref_span, skipped,
                                                            ref_step_s), 3),
            "span_s": round(span, 3), "reference_span_s": round(ref_span, 3),
            "reference_step_s": round(ref_step_s, 4)}


def reanalyse(json_path: Path, out_dir: Path | None = None) -> dict:
    """A bench's peers.json again from its runs' records (each run's run_dir and t_kill, each
    system's reference_dir), with the analysis as it is now: for a change to the yardstick,
    without running the crashes again. Writes peers.json and peers.png to `out_dir` (by
    default next to `json_path`); returns the summary."""
    old = json.loads(Path(json_path).read_text())
    cfg = Config(**old["config"])
    last = cfg.epochs * STEPS_PER_EPOCH - 1
    results = {}
    for system, rec in old["systems"].items():
        if "reference_dir" not in rec:
            results[system] = rec
            continue
        ref_dir = Path(rec["reference_dir"])
        ref, ref_steps = params(ref_dir), bench_steps(ref_dir)
        runs = []
        for run in rec["runs"]:
            if "t_kill" not in run:
                runs.append(run)
                continue
            run_dir = Path(run["run_dir"])
            try:
                new = analyse(system, bench_steps(run_dir), ref_steps, run["t_kill"], last,
                              controller_events(run_dir))
            except Exception as exc:  # noqa: BLE001 - as in measure
                new = {"error": _error(exc)}
            keep = ("bitwise_equal", "moment", "t_kill", "after_step", "fraction", "run_dir")
            runs.append({**new, **{k: run[k] for k in keep if k in run}})
        results[system] = {**rec, **summarise(runs),
                           "reference_equal_across_ranks": len(set(ref.values())) == 1}
    load = old.get("load_avg_1_5_15")
    return write(Path(out_dir or Path(json_path).parent), results, cfg, old["quick"],
                 Path(old["work_dir"]), old["wall_s"],
                 load=(load["before"], load["after"]) if load else None)


def params(run_dir: Path) -> dict[int, str]:
    """Every result's final parameters digest (torchft: one per replica group that ended the
    run); an HpctError when fewer than the 4 data shards' worth wrote one."""
    files = sorted((run_dir / "results").glob("rank*.json"))
    if len(files) < ACTIVE:
        raise HpctError(f"{len(files)} of {ACTIVE} ranks wrote a result in {run_dir}/results")
    return {int(f.stem[4:]): json.loads(f.read_text())["params_sha256"]
            for f in files}


def summarise(runs: Sequence[dict]) -> dict:
    """Median and [min, max] of each metric over the runs that produced numbers."""
    ok = [r for r in runs if "error" not in r]
    out: dict = {"runs": list(runs), "crashes": len(runs), "failed_runs": len(runs) - len(ok)}
    if not ok:
        out["error"] = "; ".join(sorted({r["error"] for r in runs})) or "no runs"
        return out
    for key in METRICS:
        vals = [r[key] for r in ok]
        out[f"{key}_median"] = round(statistics.median(vals), 3)
        out[f"{key}_range"] = [min(vals), max(vals)]
    out["bitwise_equal"] = all(r["bitwise_equal"] for r in ok)
    out["bitwise_equal_runs"] = sum(r["bitwise_equal"] for r in ok)
    return out


def ratios(systems: dict[str, dict], base: str = "hpct-slurm") -> dict[str, float]:
    """Each peer's median seconds lost per failure over `base`'s (the headline)."""
    mine = systems.get(base, {}).get("seconds_lost_median")
    if not mine or mine <= 0:
        return {}
    return {name: round(s["seconds_lost_median"] / mine, 2) for name, s in systems.items()
            if name != base and "seconds_lost_median" in s}


# ---- running the systems -----------------------------------------------------------------

def _submit(cluster: LocalCluster, system: str, run_dir: Path, cfg: Config) -> int:
    if system == "hpct-slurm":
        run_dir.mkdir(parents=True, exist_ok=True)
        script = run_dir / "hpct_inline.py"
        script.write_text(script_text(system))
        return submit(cluster, run_dir, TEMPLATE, [sys.executable, str(script),
                                                   *cfg.script_args()])
    script_args = cfg.script_args()
    if system.startswith("torchft"):
        script_args += ["--timeout", str(cfg.torchft_timeout_s)]
    else:
        script_args += ["--ckpt-every", str(cfg.ckpt_every)]
    if system == "nvrx":
        script_args += ["--gloo-timeout", str(cfg.gloo_timeout_s),
                        "--heartbeat", str(cfg.nvrx_heartbeat_s)]
    return submit(cluster, run_dir, peers_driver.batch_script(run_dir),
                  ["--system", system, "--run-dir", str(run_dir), "--active", str(ACTIVE),
                   "--heartbeat-ms", str(cfg.heartbeat_ms), "--", *script_args])


def crash_at_moment(cluster: LocalCluster, run_dir: Path, crash: Crash, step_s: float,
                    timeout: float) -> tuple[float, float]:
    """Hard-crash VICTIM `crash.fraction` of a step after some rank logged `crash.after_step`;
    the time of the first SIGKILL and the moment it came at (a share of `step_s`)."""
    deadline = time.monotonic() + timeout
    while True:
        seen = [e["t"] for e in bench_steps(run_dir) if e["step"] >= crash.after_step]
        if seen:
            break
        if time.monotonic() > deadline:
            raise HpctError(f"training never reached step {crash.after_step} within "
                            f"{timeout:.0f} s; see {run_dir}")
        time.sleep(0.01)
    t0 = min(seen)
    pids = cluster.node_pids(VICTIM)  # a /proc scan: before the moment, not in it
    time.sleep(max(0.0, t0 + crash.fraction * step_s - time.time()))
    t = time.time()
    cluster.kill_node(VICTIM, pids)
    return t, round((t - t0) / step_s, 3)


def _run(cluster: LocalCluster, system: str, run_dir: Path, cfg: Config,
         crash: Crash | None = None, step_s: float = 0.0) -> tuple[float, float] | None:
    cluster.heal()
    jid = _submit(cluster, system, run_dir, cfg)
    try:
        kill = crash_at_moment(cluster, run_dir, crash, step_s, cfg.timeout_s) if crash \
            else None
        wait_finished(cluster, jid, cfg.timeout_s, f"{system} job {jid}")
    except BaseException:
        cancel(cluster, jid)
        raise
    return kill


def _error(exc: Exception) -> str:
    return exc.message if isinstance(exc, HpctError) else f"{type(exc).__name__}: {exc}"


def measure(cluster: LocalCluster, system: str, work: Path, cfg: Config) -> dict:
    """One system: its fault-free reference, then every crash of the schedule."""
    ver = version(system)
    last = cfg.epochs * STEPS_PER_EPOCH - 1
    ref_dir = work / system / "reference"
    _run(cluster, system, ref_dir, cfg)
    ref, ref_steps = params(ref_dir), bench_steps(ref_dir)
    ref_step_s = step_time(ref_steps, last)
    runs = []
    for i, crash in enumerate(schedule(cfg)):
        run_dir = work / system / f"crash{i}"
        _say(f"[peers] {system}: crash {i}: {crash}")
        try:
            t_kill, moment = _run(cluster, system, run_dir, cfg, crash, ref_step_s)
            got = params(run_dir)
            rec = analyse(system, bench_steps(run_dir), ref_steps, t_kill, last,
                          controller_events(run_dir))
            rec.update(bitwise_equal=len(set(got.values())) == 1 and
                       set(got.values()) == set(ref.values()), moment=moment, t_kill=t_kill)
        except Exception as exc:  # noqa: BLE001 - one failed run is recorded, not fatal
            rec = {"error": _error(exc)}
        rec.update(after_step=crash.after_step, fraction=crash.fraction, run_dir=str(run_dir))
        _say(f"[peers] {system}: crash {i}: {rec}")
        runs.append(rec)
    return {**summarise(runs), "version": ver, "changed_lines": script_changes(system),
            "given": configuration(cfg)[system], "reference_step_s": round(ref_step_s, 4),
            "reference_equal_across_ranks": len(set(ref.values())) == 1,
            "reference_dir": str(ref_dir)}


def configuration(cfg: Config) -> dict[str, dict[str, str]]:
    """What each system was given, setting by setting, with the document each comes from
    (docs/benchmarks.md cites the same)."""
    tft = "github.com/pytorch/torchft"
    nvrx = "github.com/NVIDIA/nvidia-resiliency-ext v0.4.1"
    lighthouse = (f"torchft_lighthouse --min_replicas 1 --quorum_tick_ms 100 "
                  f"--join_timeout_ms 10000 on the batch host [{tft} README.md, Lighthouse]")
    heartbeat = (f"--heartbeat_timeout_ms {cfg.heartbeat_ms} (default 5000): a dead group "
                 f"leaves the quorum once its last heartbeat is older [{tft} "
                 f"src/lighthouse.rs quorum_compute]; the Manager beats every 100 ms "
                 f"[torchft/manager.py Manager(heartbeat_interval)]")
    timeouts = (f"Manager(timeout={cfg.torchft_timeout_s:g} s), ProcessGroupGloo(timeout="
                f"{cfg.torchft_timeout_s:g} s) [{tft} train_ddp.py: Gloo 5 s on CPU]")
    injob = (f"ft_launcher --nnodes=4:4 --nproc-per-node=1 --max-restarts=3 "
             f"--rdzv-backend=c10d --monitor-interval=0.1 --ft-initial-rank-heartbeat-timeout"
             f"=60 --ft-rank-heartbeat-timeout=30, one per node, the spare's waiting in the "
             f"rendezvous [{nvrx} examples/fault_tolerance/run_inprocess_injob_example.sh, "
             f"train_ddp_heartbeats_api.py]")
    ckpt = (f"torch.save of model, optimizer, schedule, RNG and step every {cfg.ckpt_every} "
            f"step(s) on the shared run dir, loaded by every rank at a restart [{nvrx} "
            f"examples/fault_tolerance/in_job_and_in_process_example.py]")
    beat = cfg.nvrx_heartbeat_s
    return {
        "hpct-slurm": {
            "launch": "the shipped sbatch template (templates/train.sbatch), defaults: 4 "
                      "active + 1 warm spare, HPCT_HEARTBEAT_S 0.5, in-memory snapshots "
                      "[docs/admin.md]"},
        "torchft": {
            "mode": "Manager(world_size_mode=WorldSizeMode.FIXED_WITH_SPARES, "
                    "min_replica_size=4), 5 replica groups (one a live spare contributing "
                    "zero gradients), data shard = participating_rank() "
                    "[torchft/manager.py 0.2.0, WorldSizeMode]",
            "lighthouse": lighthouse, "heartbeat": heartbeat, "timeouts": timeouts,
            "healing": "HTTP live healing (the default transport) [torchft/manager.py]"},
        "torchft-relaunch": {
            "mode": "Manager(min_replica_size=1) (WorldSizeMode.DYNAMIC), 4 replica groups, "
                    "data shard = group id; the lost group relaunched onto the warm spare "
                    "node once its step ends or its slurmd stops answering (0.3 s polls) "
                    f"[{tft} torchft/examples/slurm/README.md, runner.py]",
            "lighthouse": lighthouse, "heartbeat": heartbeat, "timeouts": timeouts},
        "nvrx": {
            "mode": "inprocess.Wrapper over the training function, 5 ranks, "
                    "rank_assignment=Compose(MaxActiveWorldSize(4), ShiftRanks()): the fifth "
                    "an initialised reserve [" + nvrx + " docs/source/inprocess/"
                    "usage_guide.rst, Rank assignment]",
            "intervals": f"monitor_thread/monitor_process/heartbeat/progress_watchdog "
                         f"intervals {beat:g} s, heartbeat_timeout {4 * beat:g} s, "
                         f"soft/hard timeouts 30/45 s (defaults 1 s, 30 s, 60/90 s) "
                         f"[{nvrx} inprocess/wrap.py Wrapper]",
            "gloo_timeout": f"init_process_group('gloo', timeout={cfg.gloo_timeout_s:g} s): "
                            f"Gloo collectives cannot be aborted, a short timeout is the "
                            f"workaround [{nvrx} usage_guide.rst, Known issues]",
            "stores": "model, optimizer and a TCPStore made once per process; the Wrapper's "
                      "store at MASTER_PORT+1, the training's at +2, a PrefixStore per "
                      f"restart [{nvrx} examples/inprocess/optimal_example.py]",
            "checkpoint": ckpt},
        "nvrx-injob": {"launcher": injob, "checkpoint": ckpt},
    }


def _plot(path: Path, systems: dict[str, dict], quick: bool) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = {"seconds_lost": "s lost per failure (headline)",
              "back_to_full_world_s": "s to full world", "back_to_speed_s": "s to full speed",
              "lost_steps": "steps recomputed", "skipped_batches": "batches skipped"}
    names = list(systems)
    colors = ["#4c72b0", "#dd8452", "#f0b27a", "#55a868", "#a9d18e"]
    fig, axes = plt.subplots(1, len(labels), figsize=(4.2 * len(labels), 4.2))
    for ax, (key, label) in zip(axes, labels.items()):
        med = [systems[n].get(f"{key}_median", 0) for n in names]
        lo_hi = [systems[n].get(f"{key}_range", [m, m]) for n, m in zip(names, med)]
        err = [[m - lh[0] for m, lh in zip(med, lo_hi)], [lh[1] - m for m, lh in zip(med, lo_hi)]]
        bars = ax.bar(names, med, yerr=err, capsize=3, color=colors[:len(names)])
        ax.bar_label(bars, labels=["error" if "error" in systems[n] else f"{m:.3g}"
                                   for n, m in zip(names, med)])
        ax.set_title(label, fontsize=10)
        ax.tick_params(axis="x", labelrotation=30, labelsize=8)
    fig.suptitle(f"node {VICTIM} hard-crashed at random moments, 4 active nodes + 1 spare: "
                 f"median and range{' (--quick)' if quick else ''}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _say(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def compare(cluster: LocalCluster, work: Path, cfg: Config,
            systems: Sequence[str] = SYSTEMS) -> dict[str, dict]:
    """Every system of `systems` one after another on `cluster`: its record, or one with
    `error` (the exact message) for a system that is not installed or whose reference run
    failed."""
    results: dict[str, dict] = {}
    for system in systems:
        _say(f"[peers] {system}: reference, then {cfg.crashes} crashes of node {VICTIM}")
        try:
            results[system] = measure(cluster, system, work, cfg)
        except Exception as exc:  # noqa: BLE001 - recorded with its exact message
            results[system] = {"error": _error(exc), "given": configuration(cfg)[system]}
            with contextlib.suppress(Exception):
                results[system]["version"] = version(system)
            with contextlib.suppress(Exception):
                results[system]["changed_lines"] = script_changes(system)
        _say(f"[peers] {system}: " + str({k: v for k, v in results[system].items()
                                          if k != "runs"}))
    cluster.heal()
    return results


def run(out_dir: Path, quick: bool = False, root: Path = BENCH_ROOT, down: bool = False,
        systems: Sequence[str] = SYSTEMS) -> dict:
    """Run every system of `systems` on the cluster under `root` (brought up if needed, left
    up unless `down`); writes peers.json and peers.png to `out_dir`; returns the summary."""
    cfg = QUICK if quick else FULL
    out_dir = Path(out_dir)
    t_start = time.monotonic()
    load_before = os.getloadavg()
    work = fresh_work_dir(root, "bench-peers")
    cluster = ready_cluster(root, NODES, who="bench peers")
    try:
        with contextlib.redirect_stdout(sys.stderr):
            results = compare(cluster, work, cfg, systems)
    finally:
        if down:
            cluster.down()
    return write(out_dir, results, cfg, quick, work, time.monotonic() - t_start,
                 load=(load_before, os.getloadavg()))


def write(out_dir: Path, results: dict[str, dict], cfg: Config, quick: bool, work: Path,
          wall_s: float, load: tuple[Sequence[float], Sequence[float]] | None = None) -> dict:
    """peers.json and peers.png under `out_dir`; the summary (the command's last line)."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    png = out_dir / f"{NAME}.png"
    _plot(png, results, quick)
    load_avg = {"before": [round(x, 2) for x in load[0]],
                "after": [round(x, 2) for x in load[1]], "cpus": os.cpu_count()} if load \
        else None
    path = write_result(out_dir, NAME, {
        "systems": results, "seconds_lost_ratio": ratios(results), "quick": quick,
        "config": asdict(cfg), "schedule": [asdict(c) for c in schedule(cfg)],
        "world": ACTIVE, "victim": VICTIM, "load_avg_1_5_15": load_avg,
        "work_dir": str(work), "wall_s": round(wall_s, 1),
        "method": __doc__, "when": datetime.datetime.now(datetime.timezone.utc).isoformat()})
    return {"bench": NAME, "systems": results, "seconds_lost_ratio": ratios(results), "json": str(path), "png": str(png)}
