"""The job harness that the demo, the benchmarks and the real-cluster tests share: run a
training job on a local cluster and read its record.

A run dir holds what one job wrote:
  controller.jsonl        the controller's events (or the restart-all driver's);
  events/<node>-*.jsonl   the events of every process on <node> (ranks, spares), which
                          survive the process that wrote them;
  results/rank<R>.json    each rank's final parameters digest, losses and data position;
  slurm-<jobid>.out       the batch script's output.
Jobs are submitted through the cluster's SlurmClient (hpct_slurm/slurm/ builds every Slurm
command line); nothing here imports `hpct_slurm.demo` or `hpct_slurm.bench`.
"""
from __future__ import annotations

import contextlib
import json
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterable, Sequence

from ..errors import HpctError
from ..events import read_events
from ..examples.restart_all import batch_script
from ..slurm.client import SlurmCommandError
from .cluster import LocalCluster

NODES = 5  # 4 active + 1 spare: the demo's shape, the recovery benchmark's and the tests'
VICTIM = "n3"
TEMPLATE = Path(__file__).parent.parent / "templates" / "train.sbatch"
# Appended to a reference run's arguments (the last --step-sleep wins): the pacing only gives
# a faulted run's kill its moment, and an uninterrupted run computes the same without it.
UNPACED = ("--step-sleep", "0")
# Every state a node of a cluster left behind by a killed run may be in.
ANY_STATE = {"idle", "mixed", "allocated", "completing", "drained", "draining", "down",
             "down*", "idle*", "drained*"}


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


# ---- the cluster and its jobs ----------------------------------------------------------------

def ready_cluster(root: Path, nodes: int, who: str = "this benchmark") -> LocalCluster:
    """The cluster under `root` up, every node idle and no job left, whatever a previous run
    (maybe killed half way, with a node crashed) left behind. `who` names the caller in the
    error for a cluster of another size."""
    cluster = LocalCluster(root, nodes=nodes)
    if cluster.state():
        if len(cluster.nodes) != nodes:
            raise HpctError(f"a cluster of {len(cluster.nodes)} nodes is up under {root}; "
                            f"{who} needs {nodes}: `hpct-slurm localcluster down` it first")
        with contextlib.suppress(HpctError):
            cluster.heal()  # a crashed node revived now keeps `up` from rebuilding it all
    # slurmctld keeps a node DOWN across a rebuild, so `up` must not wait for idle: heal does
    cluster.up(wait=False)
    cluster.wait_nodes(ANY_STATE, timeout=60)
    cluster.heal()
    return cluster


def fresh_work_dir(root: Path, name: str) -> Path:
    """Where one invocation of the demo or a benchmark puts its runs: `root/name/<time>`, new
    each time, so no run directory of an earlier invocation is reused (submit refuses one)."""
    return root / name / time.strftime("%Y%m%d-%H%M%S")


def submit(cluster: LocalCluster, run_dir: Path, script: Path, args: list[str],
           nodes: int | str = NODES, env: dict[str, str] | None = None) -> int:
    """Submit `script ARGS...` on `nodes` nodes with `run_dir` as its run dir (HPCT_RUN_DIR)
    and working directory; the job id. A run directory that holds a run already is refused:
    its events would read as the new run's (a step reached, a snapshot to resume from)."""
    if (run_dir / "controller.jsonl").exists() or (run_dir / "events").exists():
        raise HpctError(f"{run_dir} holds a run already (controller.jsonl or events/): "
                        f"give each job a fresh run directory")
    run_dir.mkdir(parents=True, exist_ok=True)
    bindir = Path(sys.executable).parent
    env = {"HPCT_BIN": str(bindir / "hpct-slurm"), "HPCT_PYTHON": sys.executable,
           "HPCT_RUN_DIR": str(run_dir), **(env or {})}
    return cluster.client().sbatch(script, options=[
        f"--nodes={nodes}", f"--output={run_dir / 'slurm-%j.out'}", f"--chdir={run_dir}"],
        script_args=args, env=env)


def submit_baseline(cluster: LocalCluster, run_dir: Path, train_args: Sequence[str],
                    ckpt_every: int, tasks_per_node: int = 1) -> int:
    """Submit the restart-all baseline (hpct_slurm/examples/restart_all.py) of the training
    arguments `train_args`, checkpointing to disk every `ckpt_every` steps."""
    return submit(cluster, run_dir, batch_script(run_dir, tasks_per_node),
                  [*train_args, "--ckpt-every", str(ckpt_every)])


def cancel(cluster: LocalCluster, job_id: int) -> None:
    """Cancel the job; one that is gone already is no error."""
    with contextlib.suppress(SlurmCommandError):
        cluster.client().cancel(job_id)


def wait_finished(cluster: LocalCluster, job_id: int, timeout: float, what: str = "") -> None:
    """Until the job has left the queue (an HpctError naming `what` after `timeout`)."""
    deadline = time.monotonic() + timeout
    slurm = cluster.client()
    while not slurm.job_finished(job_id):
        if time.monotonic() > deadline:
            raise HpctError(f"{what or f'job {job_id}'} never ended within {timeout:.0f} s")
        time.sleep(0.3)


def release_requeued(cluster: LocalCluster, job_id: int, run_dir: Path,
                     timeout: float = 120) -> None:
    """Once the controller escalated to a requeue and Slurm has the job pending again,
    release it at once instead of after Slurm's ~2-minute BeginTime hold (what an admin does
    with repaired or enough nodes; it keeps the requeue tests minutes shorter)."""
    deadline = time.monotonic() + timeout
    while not any(e["event"] == "escalate.requeue" for e in controller_events(run_dir)):
        if time.monotonic() > deadline:
            raise HpctError(f"job {job_id} did not escalate to a requeue within {timeout:.0f} s")
        time.sleep(0.2)
    release_when_pending(cluster, job_id, max(1.0, deadline - time.monotonic()))


def release_when_pending(cluster: LocalCluster, job_id: int, timeout: float = 120,
                         after_restarts: int | None = None) -> None:
    """Wait until Slurm has the job pending again, then release it at once (release_now).
    With `after_restarts` (its restart count before a requeue Slurm does itself), a job that
    was requeued and already left PENDING (started again, or ended) needs nothing."""
    deadline = time.monotonic() + timeout
    slurm = cluster.client()
    while True:
        info = slurm.show_job(job_id)
        requeued = after_restarts is None or info.restart_count > after_restarts
        if requeued and info.state == "PENDING":
            break
        if requeued and after_restarts is not None and info.state != "COMPLETING":
            return  # requeued and already started again (or ended)
        if time.monotonic() > deadline:
            raise HpctError(f"requeued job {job_id} never became pending within {timeout:.0f} s "
                            f"(state {info.state}, reason {info.reason})")
        time.sleep(0.2)
    slurm.release_now(job_id)


def wait_job(cluster: LocalCluster, job_id: int, run_dir: Path, timeout: float,
             kill_at: int | None = None, label: str = "") -> float | None:
    """Wait for the job to leave the queue; kill VICTIM once any rank passed step `kill_at`.
    Prints progress; returns the kill time."""
    deadline = time.monotonic() + timeout
    t_kill = None
    last_print = -1
    slurm = cluster.client()
    while time.monotonic() < deadline:
        step = last_step(run_dir)
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
    try:
        info = slurm.show_job(job_id)
        where = f"state {info.state}, reason {info.reason}, restarts {info.restart_count}"
    except HpctError as e:  # the error names what went wrong; the timeout is the news
        where = f"scontrol show job failed: {e}"
    cancel(cluster, job_id)
    raise HpctError(f"{label} job {job_id} did not finish within {timeout:.0f} s ({where}); "
                    f"see {run_dir}")


# ---- the record of a run ---------------------------------------------------------------------

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


def last_step(run_dir: Path) -> int:
    """The highest step any rank of the run reported done; -1 before the first."""
    return max((e["step"] for e in step_events(run_dir)), default=-1)


def wait_step(run_dir: Path, step: int, timeout: float = 120) -> None:
    """Until some rank of the run reported `step` done (an HpctError after `timeout`)."""
    deadline = time.monotonic() + timeout
    while last_step(run_dir) < step:
        if time.monotonic() > deadline:
            raise HpctError(f"training never reached step {step} within {timeout:.0f} s; see "
                            f"{run_dir}")
        time.sleep(0.05)


def crash_at(cluster: LocalCluster, run_dir: Path, step: int, timeout: float,
             node: str = VICTIM) -> float:
    """Hard-crash `node` once any rank completed `step`; returns when the first SIGKILL went
    out (wait_job stamps the crash after every process died instead)."""
    wait_step(run_dir, step, timeout)
    # the lookup of the node's processes (a /proc scan) is the harness's work, not the fault's:
    # the clock starts at the first SIGKILL, for both methods alike
    pids = cluster.node_pids(node)
    t = time.time()
    cluster.kill_node(node, pids)
    return t


def collect(run_dir: Path, world: int) -> dict[int, dict]:
    """Every rank's result (results/rank<R>.json); an HpctError when one is missing."""
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
        # (a script that records no losses in its result, e.g. adopted_3d.py: its parameters
        # and the losses in its events are compared)
        if any(ref[r].get("losses", {}).get(k) != v for k, v in res.get("losses", {}).items()):
            return False
    if run_dir is not None:
        seen = step_losses(run_dir)
        steps_done = {step for _, step in seen}
        for r, res in ref.items():
            for k, loss in res.get("losses", {}).items():
                if int(k) not in steps_done:
                    return False
                if any(v != loss for v in seen.get((r, int(k)), [])):
                    return False
        if any(rk[0] not in ref or str(rk[1]) not in ref[rk[0]].get("losses", {str(rk[1]): 0})
               for rk in seen):
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
    """Seconds from the crash until every rank of the group that trains after it completed a
    step after the last one reached before the crash (same yardstick for both recoveries), and
    that last step. Any later step counts, not only the next one: a replacement that restored
    the state captured at the fault, after that next step, goes on from the step after it."""
    evs = step_events(run_dir)
    k_last = max((e["step"] for e in evs if e["t"] < t_kill), default=-1)
    ranks, new = group_after(controller_events(run_dir), t_kill, run_dir)
    return back_at(evs, k_last, ranks, new) - t_kill, k_last


def group_after(controller: Sequence[dict], t_kill: float,
                run_dir: Path | str = "the run") -> tuple[range, Callable[[dict], bool]]:
    """The ranks of the group that trains after the crash, and which step events are its: the
    first generation that starts after it (its members x the controller's tasks per node; its
    steps are those of that generation or a later one), or the restart-all driver's first
    relaunch after it (one rank per node; every step logged since)."""
    per_node = 1
    for e in sorted(controller, key=lambda e: e["t"]):
        if e["event"] == "controller.start":
            per_node = int(e.get("tasks_per_node", 1))
        elif e["t"] <= t_kill:
            continue
        elif e["event"] == "generation.start":
            g = int(e["generation"])
            return range(len(e["members"]) * per_node), lambda s: s.get("generation", -1) >= g
        elif e["event"] == "baseline.launch":
            t = e["t"]
            return range(len(e["nodes"])), lambda s: s["t"] >= t
    raise HpctError(f"no new generation and no relaunch started after the crash in {run_dir}")


def back_at(steps: Sequence[dict], k_last: int, ranks: Iterable[int],
            new: Callable[[dict], bool], event: str = "rank.step") -> float:
    """When every one of `ranks` completed, in the group after the crash (`new(event)`), a
    step after `k_last`: the latest of each rank's first such completion. A rank missing is an
    error, never a rank that drops out of the yardstick. `event`: the step record read (the
    peers bench reads its own, `bench.step`)."""
    want = set(ranks)
    firsts: dict[int, float] = {}
    for e in steps:
        if e["event"] == event and e["step"] > k_last and new(e):
            firsts[e["rank"]] = min(firsts.get(e["rank"], e["t"]), e["t"])
    missing = sorted(want - set(firsts))
    if missing or not want:
        raise HpctError(f"rank(s) {missing} completed no step from step {k_last + 1} on "
                        f"after the recovery")
    return max(firsts[r] for r in want)


def baseline_recomputed(run_dir: Path, k_last: int) -> int:
    """Steps the restart-all baseline computed twice: from its restart's checkpoint step up to
    the last step reached before the crash."""
    starts = [e["start_step"] for f in (run_dir / "events").glob("baseline-*.jsonl")
              for e in read_events(f) if e.get("event") == "baseline.start"]
    resumed = [s for s in starts if s > 0]
    return max(0, k_last + 1 - min(resumed)) if resumed else k_last + 1
