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

import contextlib
import json
import shutil
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from .bench.restart_all import batch_script
from .errors import HpctError
from .events import read_events
from .localcluster import DEFAULT_ROOT, LocalCluster
from .slurm.client import SlurmCommandError

NODES = 5
VICTIM = "n3"
TEMPLATE = Path(__file__).parent / "templates" / "train.sbatch"


@dataclass
class RunResult:
    name: str
    run_dir: Path
    job_id: int
    t_kill: float | None
    results: dict[int, dict]

    def events(self) -> list[dict]:
        return rank_events(self.run_dir)

    def controller_events(self) -> list[dict]:
        return controller_events(self.run_dir)


def _say(msg: str) -> None:
    print(msg, flush=True)


def submit(cluster: LocalCluster, run_dir: Path, script: Path, args: list[str],
           nodes: int | str = NODES, env: dict[str, str] | None = None) -> int:
    run_dir.mkdir(parents=True, exist_ok=True)
    bindir = Path(sys.executable).parent
    env = {"HPCT_BIN": str(bindir / "hpct-slurm"), "HPCT_PYTHON": sys.executable,
           "HPCT_RUN_DIR": str(run_dir), **(env or {})}
    return cluster.client().sbatch(script, options=[
        f"--nodes={nodes}", f"--output={run_dir / 'slurm-%j.out'}", f"--chdir={run_dir}"],
        script_args=args, env=env)


def controller_events(run_dir: Path) -> list[dict]:
    """The controller's events of a run (none yet: an empty list)."""
    path = run_dir / "controller.jsonl"
    return list(read_events(path)) if path.exists() else []


def rank_events(run_dir: Path, node: str | None = None) -> list[dict]:
    """The events of a run's processes (of those on `node` only, given one), file by file."""
    d = run_dir / "events"
    files = sorted(d.glob(f"{node}-*.jsonl" if node else "*.jsonl")) if d.exists() else []
    return [e for f in files for e in read_events(f)]


def step_events(run_dir: Path) -> list[dict]:
    return [e for e in rank_events(run_dir) if e.get("event") == "rank.step"]


def wait_step(run_dir: Path, step: int, timeout: float = 120) -> None:
    """Until some rank of the run reported `step` done (an AssertionError after `timeout`)."""
    deadline = time.monotonic() + timeout
    while max((e["step"] for e in step_events(run_dir)), default=-1) < step:
        assert time.monotonic() < deadline, f"training never reached step {step}"
        time.sleep(0.05)


def wait_job(cluster: LocalCluster, job_id: int, run_dir: Path, timeout: float,
             kill_at: int | None = None, label: str = "") -> float | None:
    """Wait for the job to leave the queue; kill VICTIM once any rank passed step `kill_at`.
    Prints progress; returns the kill time."""
    deadline = time.monotonic() + timeout
    t_kill = None
    last_print = -1
    slurm = cluster.client()
    while time.monotonic() < deadline:
        evs = step_events(run_dir)
        step = max((e["step"] for e in evs), default=-1)
        if step // 10 != last_print // 10 and step >= 0:
            _say(f"  [{label}] step {step}")
            last_print = step
        if kill_at is not None and t_kill is None and step >= kill_at:
            cluster.kill_node(VICTIM)
            t_kill = time.time()
            _say(f"  [{label}] step {step}: node {VICTIM} hard-crashed (slurmd, slurmstepd, "
                 f"tasks SIGKILLed)")
        if slurm.job_finished(job_id):
            return t_kill
        time.sleep(0.2)
    with contextlib.suppress(SlurmCommandError):
        slurm.cancel(job_id)
    raise HpctError(f"{label} job {job_id} did not finish within {timeout:.0f} s; see {run_dir}")


def collect(run_dir: Path, world: int) -> dict[int, dict]:
    out = {}
    for r in range(world):
        path = run_dir / "results" / f"rank{r}.json"
        if not path.exists():
            raise HpctError(f"rank {r} wrote no result under {run_dir}: the run failed; see "
                            f"{run_dir}/slurm-*.out and {run_dir}/logs")
        out[r] = json.loads(path.read_text())
    return out


def step_losses(run_dir: Path) -> dict[tuple[int, int], list[float]]:
    """Every loss any process reported, by (rank, step), from the ranks' event logs (these
    survive the process that wrote them, so a crashed rank's steps are counted too)."""
    out: dict[tuple[int, int], list[float]] = {}
    for e in step_events(run_dir):
        out.setdefault((e["rank"], e["step"]), []).append(e.get("loss"))
    return out


def bitwise_equal(ref: dict[int, dict], other: dict[int, dict],
                  run_dir: Path | None = None) -> bool:
    """Same final parameters on every rank, and every loss the run reports equal to the
    reference's loss of the same rank and step (a replacement reports only the steps it ran).

    With `run_dir`, also (from the event logs, crashed ranks included) every step of the
    reference must have been completed by the group, and every loss any rank recorded must
    equal the reference's for that rank and step, however often it was computed: a skipped
    step or one computed differently fails. (A rank lost after the collectives of a step but
    before it logged that step leaves no record of it; the survivors' records show the group
    completed it, and its state was restored from them.)"""
    if set(other) != set(ref):
        return False
    for r, res in other.items():
        if res["params_sha256"] != ref[r]["params_sha256"]:
            return False
        # the rank's own data position, where both runs record one
        if None not in (res.get("consumed"), ref[r].get("consumed")) and \
                res["consumed"] != ref[r]["consumed"]:
            return False
        if any(ref[r]["losses"].get(k) != v for k, v in res["losses"].items()):
            return False
    if run_dir is not None:
        seen = step_losses(run_dir)
        steps_done = {step for _, step in seen}
        for r, res in ref.items():
            for k, loss in res["losses"].items():
                if int(k) not in steps_done:
                    return False
                if any(v != loss for v in seen.get((r, int(k)), [])):
                    return False
        if any(rk[0] not in ref or str(rk[1]) not in ref[rk[0]]["losses"] for rk in seen):
            return False
    return True


def rolled_back_steps(run_dir: Path) -> set[int]:
    """The steps some rank computed more than once."""
    return {step for (_, step), losses in step_losses(run_dir).items() if len(losses) > 1}


def recomputed_steps(run_dir: Path) -> int:
    """(rank, step) pairs computed more than once, counted per extra time: 0 when recovery
    resumed every rank exactly where the group stopped."""
    return sum(len(v) - 1 for v in step_losses(run_dir).values())


def back_to_speed(run_dir: Path, t_kill: float) -> tuple[float, int]:
    """Seconds from the crash until every rank completed the step after the last one reached
    before the crash (same yardstick for both recoveries), and that last step."""
    evs = step_events(run_dir)
    before = [e["step"] for e in evs if e["t"] < t_kill]
    k_last = max(before, default=-1)
    firsts: dict[int, float] = {}
    for e in evs:
        if e["step"] == k_last + 1 and e["t"] > t_kill:
            firsts[e["rank"]] = min(firsts.get(e["rank"], e["t"]), e["t"])
    if not firsts:
        raise HpctError(f"no rank completed step {k_last + 1} after the crash in {run_dir}")
    return max(firsts.values()) - t_kill, k_last


def baseline_recomputed(run_dir: Path, k_last: int) -> int:
    """Steps the restart-all baseline computed twice: from its restart's checkpoint step up to
    the last step reached before the crash."""
    starts = [e["start_step"] for f in (run_dir / "events").glob("baseline-*.jsonl")
              for e in read_events(f) if e.get("event") == "baseline.start"]
    resumed = [s for s in starts if s > 0]
    return max(0, k_last + 1 - min(resumed)) if resumed else k_last + 1


def print_timeline(run: RunResult) -> dict:
    evs = run.controller_events()
    done = [e for e in evs if e["event"] == "recovery.done"]
    t0 = run.t_kill or 0.0
    _say(f"  timeline (seconds after the crash at t=0):")
    for e in evs:
        if e["event"].startswith(("fault.", "recovery.", "escalate.", "generation.")):
            detail = {k: v for k, v in e.items() if k in ("node", "reason", "how", "restore_step",
                                                         "taken", "generation")}
            _say(f"    {e['t'] - t0:+7.3f}  {e['event']:18} {json.dumps(detail)}")
    return done[-1] if done else {}


def run_demo(root: Path = DEFAULT_ROOT, steps: int = 60, kill_at: int = 20,
             step_sleep: float = 0.1, timeout: float = 300, keep: bool = False,
             parallel: str = "ddp") -> dict:
    cluster = LocalCluster(root, nodes=NODES)
    if cluster.state() and len(cluster.nodes) != NODES:
        raise HpctError(f"a cluster of {len(cluster.nodes)} nodes is up under {root}; the demo "
                        f"needs {NODES}: `hpct-slurm localcluster down` first")
    _say(f"[1/4] local Slurm cluster: {NODES} nodes (4 active + 1 spare) under {root}")
    cluster.up()
    cluster.heal()
    work = root / "demo" / time.strftime("%Y%m%d-%H%M%S")
    # ddp: the demo MLP, data parallel; fsdp / hsdp: the sharded job (FSDP2 fully_shard on a
    # 1-D mesh, or HSDP on a 2 x 2 replicate x shard mesh), the same faults and yardsticks
    sharded = [] if parallel == "ddp" else ["--parallel", parallel]
    example = "train" if parallel == "ddp" else "sharded_train"
    train = [sys.executable, "-m", f"hpct_slurm.examples.{example}", *sharded,
             "--steps", str(steps), "--step-sleep", str(step_sleep)]
    runs: dict[str, RunResult] = {}

    _say(f"[2/4] reference run ({parallel}), no fault")
    d = work / "reference"
    jid = submit(cluster, d, TEMPLATE, train)
    runs["reference"] = RunResult("reference", d, jid, wait_job(cluster, jid, d, timeout,
                                                                label="reference"),
                                  collect(d, 4))

    _say(f"[3/4] hpct-slurm run: crash {VICTIM} at step {kill_at}; a warm spare takes over")
    d = work / "hpct"
    jid = submit(cluster, d, TEMPLATE, train)
    t_kill = wait_job(cluster, jid, d, timeout, kill_at=kill_at, label="hpct")
    runs["hpct"] = RunResult("hpct", d, jid, t_kill, collect(d, 4))
    done = print_timeline(runs["hpct"])
    cluster.heal()

    _say(f"[4/4] baseline run: the same crash, restart-all from the last disk checkpoint")
    d = work / "baseline"
    jid = submit(cluster, d, batch_script(d), [*sharded, "--steps", str(steps), "--step-sleep",
                                               str(step_sleep), "--ckpt-every", "10"])
    t_kill_b = wait_job(cluster, jid, d, timeout, kill_at=kill_at, label="baseline")
    runs["baseline"] = RunResult("baseline", d, jid, t_kill_b, collect(d, 4))
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
