"""Stress: one job, 20+ random faults one after another, on the real local Slurm cluster.

A job of 3 active nodes + 2 warm spares (5 nodes) trains the demo model; a seeded RNG draws a
fault plan, and each fault is injected at a random step once the previous recovery is done
and enough warm spares are ready again:
  kill_rank      SIGKILL one active rank process (its node stays up: the controller cancels the
                 step, a spare takes the rank, the node comes back as a warm spare);
  hang_rank      SIGSTOP one active rank (found by missed heartbeats, fenced by cancelling its
                 step);
  kill_spare     SIGKILL a warm spare before it is used;
  back_to_back   SIGKILL two active ranks a moment apart (a second fault during recovery);
  node_crash     `kill_node` of a non-batch active node (slurmd, slurmstepd, rank): at most one,
                 last among the multi-fault kinds, since a crashed node leaves the allocation.
Rank pids come from the controller's `rank.register` events (the nodes share the host's PID
namespace). Checked at the end: the job completed within a bound, final parameters and losses
are bit-identical to an uninterrupted run, and no process of the job is left on any node.
"""
from __future__ import annotations

import contextlib
import datetime
import os
import random
import signal
import statistics
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Sequence

from ..demo import TEMPLATE, bitwise_equal, collect, step_events, submit, wait_job
from ..errors import HpctError
from ..events import read_events
from ..localcluster import LocalCluster
from .common import plot_bars, write_result
from .recovery import BENCH_ROOT, ready_cluster, spread

NAME = "stress"
NODES = 5
ACTIVE = 3
KINDS = ("kill_rank", "hang_rank", "kill_spare", "back_to_back", "node_crash")
FAULT_TIMEOUT_S = 120.0  # one fault's recovery (and a spare re-warming) must end by then
JOB_MARKERS = (b"hpct_slurm", b"hpct-slurm")  # in the argv of every process of the job


@dataclass(frozen=True)
class Config:
    faults: int
    steps: int
    step_sleep: float
    back_to_back: int
    node_crashes: int
    kill_spares: int
    hangs: int
    seed: int = 20261122
    # Faults on the batch host's own rank process are part of the plan (the controller's step
    # cancel skips the batch step, 'JOBID.batch'); True keeps them off that rank.
    spare_the_batch_host: bool = False
    min_gap_steps: int = 3
    max_gap_steps: int = 15
    job_timeout_s: float = 900.0


FULL = Config(faults=22, steps=1200, step_sleep=0.1, back_to_back=2, node_crashes=1,
              kill_spares=2, hangs=5)
QUICK = Config(faults=5, steps=400, step_sleep=0.1, back_to_back=1, node_crashes=0,
               kill_spares=1, hangs=1)


@dataclass(frozen=True)
class Fault:
    kind: str
    gap_steps: int  # steps to let pass after the previous recovery before injecting it

    @property
    def size(self) -> int:
        return 2 if self.kind == "back_to_back" else 1


def plan(cfg: Config) -> list[Fault]:
    """The fault sequence, a pure function of the config (seeded RNG). Multi-node faults come
    first and the node crash last among them: afterwards one spare fewer is left for good."""
    rng = random.Random(cfg.seed)
    singles = cfg.faults - 2 * cfg.back_to_back - cfg.node_crashes - cfg.kill_spares - cfg.hangs
    if singles < 0:
        raise HpctError(f"faults={cfg.faults} is fewer than the special faults it must hold")
    rest = ["kill_rank"] * singles + ["hang_rank"] * cfg.hangs + ["kill_spare"] * cfg.kill_spares
    rng.shuffle(rest)
    cut = rng.randrange(len(rest) // 3 + 1)
    head = ["back_to_back"] * cfg.back_to_back + ["node_crash"] * cfg.node_crashes
    kinds = rest[:cut] + head + rest[cut:]
    return [Fault(k, rng.randint(cfg.min_gap_steps, cfg.max_gap_steps)) for k in kinds]


@dataclass
class JobView:
    """What the controller's event log says about the job right now."""
    members: list[str]
    spare_pids: dict[str, int]  # warm spares that registered and were not lost since
    active_pids: dict[str, int]
    last_fault_t: float  # last fault on an active node
    last_done_t: float
    recovery_s: list[float]


def view(controller: Sequence[dict]) -> JobView:
    """Fold the controller's events into the job's current layout (pure)."""
    members: list[str] = []
    latest: dict[str, dict] = {}  # node -> its latest register / fault / launch event
    last_fault = last_done = 0.0
    recovery_s = []
    for e in controller:
        ev = e["event"]
        if ev == "controller.start":
            members = list(e["active"])
        elif ev == "recovery.assign":
            members = list(e["members"])
        elif ev in ("rank.register", "fault.detected", "step.launch"):
            latest[e["node"]] = e
            if ev == "fault.detected" and e.get("role") == "active":
                last_fault = e["t"]
        elif ev == "recovery.done":
            last_done = e["t"]
            recovery_s.append(e["recovery_s"])
    registered = {n: e for n, e in latest.items() if e["event"] == "rank.register"}
    return JobView(members=members,
                   spare_pids={n: e["pid"] for n, e in registered.items()
                               if n not in members and e["role"] == "spare"},
                   active_pids={n: e["pid"] for n, e in registered.items() if n in members},
                   last_fault_t=last_fault, last_done_t=last_done, recovery_s=recovery_s)


def _controller_events(run_dir: Path) -> list[dict]:
    path = run_dir / "controller.jsonl"
    return list(read_events(path)) if path.exists() else []


def _step(run_dir: Path) -> int:
    return max((e["step"] for e in step_events(run_dir)), default=-1)


def _say(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def _job_pids(cluster: LocalCluster, nodes: Sequence[str]) -> dict[str, list[int]]:
    """Processes of the job (controller, ranks, spares) still running on each node."""
    out = {}
    for node in nodes:
        pids = []
        for pid in cluster.node_pids(node):
            try:
                argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
            except OSError:
                continue
            if any(m in a for a in argv for m in JOB_MARKERS):
                pids.append(pid)
        out[node] = pids
    return out


class _Injector:
    def __init__(self, cluster: LocalCluster, run_dir: Path, batch_host: str,
                 rng: random.Random):
        self.cluster, self.run_dir, self.batch_host, self.rng = cluster, run_dir, batch_host, rng
        self.crashed: set[str] = set()
        self.job_id = 0

    def job_queued(self) -> bool:
        out = self.cluster.run(["squeue", "-h", "-j", str(self.job_id), "-o", "%T"]).stdout
        return out.strip() not in ("", "COMPLETED", "FAILED", "CANCELLED")

    def wait_quiet(self, need_spares: int, gap_steps: int, steps: int) -> JobView | None:
        """Wait until the last recovery is done, `need_spares` spares are warm and `gap_steps`
        more steps have run; None when the job ends (or is about to) first."""
        deadline = time.monotonic() + FAULT_TIMEOUT_S
        start_step = None
        polls = 0
        while time.monotonic() < deadline:
            v = view(_controller_events(self.run_dir))
            step = _step(self.run_dir)
            if step >= steps - 2 * gap_steps - 5:
                return None
            polls += 1
            if polls % 10 == 0 and not self.job_queued():
                return None
            quiet = v.last_done_t >= v.last_fault_t and len(v.active_pids) == len(v.members) \
                and len(v.spare_pids) >= need_spares
            if quiet:
                start_step = step if start_step is None else start_step
                if step >= start_step + gap_steps:
                    return v
            else:
                start_step = None
            time.sleep(0.1)
        raise HpctError(f"no quiet moment within {FAULT_TIMEOUT_S:.0f} s (a recovery hung or "
                        f"no spare came back); see {self.run_dir}/controller.jsonl")

    def inject(self, fault: Fault, v: JobView, spare_batch_host: bool) -> list[dict]:
        """Inject one fault; returns what was done to which node and pid."""
        ranks = [n for n in sorted(v.active_pids)
                 if not (spare_batch_host and n == self.batch_host)]
        if fault.kind == "kill_spare":
            node = self.rng.choice(sorted(v.spare_pids))
            return [self._signal(fault.kind, node, v.spare_pids[node], signal.SIGKILL)]
        if fault.kind == "node_crash":
            node = self.rng.choice([n for n in ranks if n != self.batch_host])
            t = time.time()
            self.cluster.kill_node(node)
            self.crashed.add(node)
            return [{"kind": fault.kind, "node": node, "pid": v.active_pids[node], "t": t}]
        if fault.kind == "back_to_back":
            a, b = self.rng.sample(ranks, 2)
            first = self._signal(fault.kind, a, v.active_pids[a], signal.SIGKILL)
            time.sleep(self.rng.uniform(0.1, 0.5))  # lands while the first is recovering
            return [first, self._signal(fault.kind, b, v.active_pids[b], signal.SIGKILL)]
        node = self.rng.choice(ranks)
        sig = signal.SIGSTOP if fault.kind == "hang_rank" else signal.SIGKILL
        return [self._signal(fault.kind, node, v.active_pids[node], sig)]

    def _signal(self, kind: str, node: str, pid: int, sig: signal.Signals) -> dict:
        t = time.time()
        os.kill(pid, sig)
        return {"kind": kind, "node": node, "pid": pid, "t": t, "step": _step(self.run_dir)}


def outcome(controller: Sequence[dict], injected: Sequence[dict]) -> list[dict]:
    """For each injected fault: was it detected and recovered (an active rank's loss by a
    later recovery.done, a spare's by its fence), and how long from injection to that (pure)."""
    out = []
    for f in injected:
        det = next((e for e in controller if e["event"] == "fault.detected"
                    and e["node"] == f["node"] and e["t"] >= f["t"]), None)
        end = None
        if det is not None:
            name = "fault.fenced" if det.get("role") == "spare" else "recovery.done"
            end = next((e for e in controller if e["event"] == name and e["t"] >= det["t"]
                        and (name == "recovery.done" or e["node"] == f["node"])), None)
        out.append({**f, "detected": det["reason"] if det else None,
                    "recovered": end is not None,
                    "fault_to_recovered_s": end["t"] - f["t"] if end else None})
    return out


def _stress(cluster: LocalCluster, work: Path, cfg: Config, faults: list[Fault]) -> dict:
    """The reference run, then the stress job with `faults` injected; what happened."""
    train = [sys.executable, "-m", "hpct_slurm.examples.train", "--steps", str(cfg.steps),
             "--step-sleep", str(cfg.step_sleep)]
    env = {"HPCT_ACTIVE_NODES": str(ACTIVE)}
    d = work / "reference"
    jid = submit(cluster, d, TEMPLATE, train, nodes=ACTIVE, env=env)
    wait_job(cluster, jid, d, cfg.job_timeout_s, label="reference")
    ref = collect(d, ACTIVE)

    d = work / "stress"
    injector = _Injector(cluster, d, "n1", random.Random(cfg.seed + 1))
    injector.job_id = submit(cluster, d, TEMPLATE, train, nodes=NODES, env=env)
    t_job = time.monotonic()
    injected: list[dict] = []
    error = None
    hung = False
    for i, fault in enumerate(faults):
        try:
            v = injector.wait_quiet(max(1, fault.size), fault.gap_steps, cfg.steps)
        except HpctError as exc:
            error = exc.message  # a recovery that never ends: the job is hung, stop it now
            cluster.run(["scancel", str(injector.job_id)])
            hung = True
            break
        if v is None:
            _say(f"[stress] the job ended or is about to: {len(faults) - i} injection(s) "
                 f"not done")
            break
        done = injector.inject(fault, v, cfg.spare_the_batch_host)
        injected += done
        _say(f"[stress] {len(injected):2d} faults: {fault.kind} "
             f"{' '.join(f['node'] for f in done)} at step {_step(d)}")
    try:
        wait_job(cluster, injector.job_id, d,
                 max(cfg.job_timeout_s - (time.monotonic() - t_job), 1.0), label="stress")
    except HpctError as exc:
        hung, error = True, error or exc.message
    job_s = time.monotonic() - t_job
    # The job left the queue; Slurm may still be reaping its last processes.
    deadline = time.monotonic() + 20
    while True:
        leaked = _job_pids(cluster, [n for n in cluster.nodes if n not in injector.crashed])
        if not any(leaked.values()) or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    ctl = _controller_events(d)
    try:
        equal = bitwise_equal(ref, collect(d, ACTIVE), d)
        completed = any(e["event"] == "job.done" for e in ctl)
    except HpctError as exc:
        equal, completed, error = False, False, error or exc.message
    return {"ctl": ctl, "injected": injected, "leaked": leaked, "equal": equal,
            "completed": completed, "hung": hung, "job_s": job_s, "error": error}


def run(out_dir: Path, quick: bool = False, root: Path = BENCH_ROOT,
        down: bool = False) -> dict:
    """Run the stress job on the cluster under `root` (brought up if needed, left up unless
    `down`); writes stress.json and stress.png to `out_dir`; returns the summary."""
    cfg = QUICK if quick else FULL
    faults = plan(cfg)
    t_start = time.monotonic()
    cluster = ready_cluster(root, NODES)
    work = root / "bench-stress" / time.strftime("%Y%m%d-%H%M%S")
    _say(f"[stress] {len(faults)} fault injections ({sum(f.size for f in faults)} faults) into "
         f"one job of {ACTIVE} active + {NODES - ACTIVE} spare nodes under {root}")
    # progress to stderr: stdout's last line is the summary
    with contextlib.redirect_stdout(sys.stderr):
        try:
            got = _stress(cluster, work, cfg, faults)
        finally:
            cluster.heal()
            if down:
                cluster.down()
    results = outcome(got["ctl"], got["injected"])
    v = view(got["ctl"])
    leaked, equal = got["leaked"], got["equal"]
    summary = {
        "bench": NAME,
        "faults": len(got["injected"]),
        "recovered": sum(r["recovered"] for r in results),
        "completed": got["completed"] and not got["hung"],
        "bitwise_equal": equal,
        "leaked_processes": sum(len(p) for p in leaked.values()),
        "median_recovery_s": round(statistics.median(v.recovery_s), 3) if v.recovery_s
        else None,
        "recovery_rounds": len(v.recovery_s),
        "job_s": round(got["job_s"], 1),
        "hung": got["hung"],
        "error": got["error"],
    }
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    times = {k: [r["fault_to_recovered_s"] for r in results if r["kind"] == k
                 and r["fault_to_recovered_s"] is not None] for k in KINDS}
    kinds = [k for k in KINDS if times[k]]
    plot_bars(out_dir / f"{NAME}.png", kinds, [statistics.median(times[k]) for k in kinds],
              "seconds, fault to recovered (median)",
              f"stress: {summary['recovered']}/{summary['faults']} faults recovered, "
              f"bit-identical: {equal}")
    write_result(out_dir, NAME, {
        "summary": summary, "quick": quick, "config": asdict(cfg),
        "plan": [asdict(f) for f in faults], "injected": results,
        "by_kind": {k: spread(times[k]) for k in kinds}, "leaked": leaked,
        "controller_recovery_s": v.recovery_s, "wall_s": time.monotonic() - t_start,
        "work_dir": str(work), "method": __doc__,
        "when": datetime.datetime.now(datetime.timezone.utc).isoformat(),
    })
    return summary
