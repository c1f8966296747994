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
The awkward moments of issue 19, each kill timed by polling the controller's event log every
5 ms for the event that opens its window (never a sleep):
  formation         SIGKILL an active rank within 100 ms of a `generation.start`: generation 0
                    (the first fault of the plan, before any step), or the generation a
                    trigger kill's recovery just assigned (the survivors are forming the group);
  owner_and_holder  SIGKILL the rank at position i and the one holding its ring replica
                    (position `replica_peer(i, members)`) together: that rank's state then
                    exists only on disk, so a disk fallback (`recovery.disk_fallback`) with
                    recomputed steps is expected, stated and counted;
  taker             SIGKILL an active rank, then the spare named in the `recovery.assign`'s
                    `taken` within 50 ms of that event (mid-transfer): the next spare takes over.
These kill rank processes, not nodes: the node stays up and comes back as a warm spare, so the
5 nodes serve the whole plan (a rank's in-memory state dies with its process either way).
The plan is a pure function of the seed and the cluster shape, and never asks for more warm
spares than exist at that point (a node crash takes one for good); before each fault the
injector waits until that many spares are warm again.
Rank pids come from the controller's `rank.register` events (the nodes share the host's PID
namespace). Checked at the end: the job completed within a bound, final parameters and losses
are bit-identical to an uninterrupted run, and no process of the job is left on any node.
Each fault's record says what it waited for, the delay from that event to the kill, whether it
recovered and how fast, any disk fallback, the steps it cost twice, and the longest stretch
with no step completed while a warm spare was ready (`max_pause_with_spare_s`).
"""
from __future__ import annotations

import bisect
import contextlib
import datetime
import json
import os
import random
import signal
import statistics
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable, Sequence

from ..errors import HpctError
from ..localcluster import LocalCluster
from ..localcluster.jobs import (TEMPLATE, bitwise_equal, cancel, collect, controller_events,
                                 fresh_work_dir, last_step, ready_cluster, recomputed_steps,
                                 step_events, submit, wait_job)
from ..recovery.ring import replica_peer
from .common import plot_bars, write_result
from .recovery import BENCH_ROOT, spread

NAME = "stress"
NODES = 5
ACTIVE = 3
KINDS = ("kill_rank", "hang_rank", "kill_spare", "back_to_back", "node_crash",
         "formation", "owner_and_holder", "taker")
# How soon after the event that opens its window each awkward kill must land.
WINDOW_S = {"formation": 0.1, "taker": 0.05}
POLL_S = 0.005  # event-log polling while a window is awaited
START_TIMEOUT_S = 300.0  # submit to generation 0's start (scheduling, imports)
PAUSE_LIMIT_S = 10.0  # issue 19: no pause longer than this while a warm spare was ready
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
    formations: int = 0  # the first at generation 0 (1 kill), each other one 2 kills
    owner_holders: int = 0  # 2 kills each
    takers: int = 0  # 2 kills each
    seed: int = 20261122
    # Faults on the batch host's own rank process are part of the plan (the controller's step
    # cancel skips the batch step, 'JOBID.batch'); True keeps them off that rank.
    spare_the_batch_host: bool = False
    min_gap_steps: int = 3
    max_gap_steps: int = 15
    job_timeout_s: float = 900.0
    # a per-rank data position (rank state, replicated on the ring): losing a rank and its
    # replica holder then really loses that state, and the disk fallback is exercised
    position: bool = True


FULL = Config(faults=30, steps=1600, step_sleep=0.1, back_to_back=2, node_crashes=1,
              kill_spares=2, hangs=5, formations=2, owner_holders=2, takers=2)
QUICK = Config(faults=9, steps=700, step_sleep=0.1, back_to_back=0, node_crashes=0,
               kill_spares=1, hangs=1, formations=2, owner_holders=1, takers=1)


AIMED = ("formation", "owner_and_holder", "taker")  # the plan names the position they hit
TWO_KILLS = ("back_to_back", "owner_and_holder", "taker")


@dataclass(frozen=True)
class Fault:
    kind: str
    gap_steps: int  # steps to let pass after the previous recovery before injecting it
    # position among the active members it hits first (formation: the rank killed at the
    # formation; owner_and_holder: the owner; taker: the rank whose taker is killed); -1: drawn
    # at injection
    index: int = -1
    at_start: bool = False  # formation at generation 0's start (the plan's first fault)

    @property
    def size(self) -> int:
        """Rank processes it kills."""
        if self.kind == "formation":
            return 1 if self.at_start else 2
        return 2 if self.kind in TWO_KILLS else 1

    @property
    def spares(self) -> int:
        """Warm spares that must be ready when it is injected: one per active rank it kills
        (a killed spare needs one to exist)."""
        return self.size


def spare_budget(faults: Sequence[Fault], active: int, nodes: int) -> list[int]:
    """The spares the allocation has when each fault comes (pure): all nodes beyond the
    active ones, less one for good after each node crash."""
    left, out = nodes - active, []
    for f in faults:
        out.append(left)
        if f.kind == "node_crash":
            left -= 1
    return out


def check_plan(faults: Sequence[Fault], active: int, nodes: int) -> None:
    """Raise unless every fault's replacement is possible: one asking for more spares than
    exist at that point would only escalate."""
    for i, (f, have) in enumerate(zip(faults, spare_budget(faults, active, nodes))):
        if f.spares > have:
            raise HpctError(f"fault {i} ({f.kind}) needs {f.spares} warm spare(s) but the "
                            f"{nodes}-node job of {active} active nodes has {have} then")
        if f.kind in AIMED and not 0 <= f.index < active:
            raise HpctError(f"fault {i} ({f.kind}) aims at position {f.index}, outside "
                            f"0..{active - 1}")
        if f.at_start and (f.kind != "formation" or i != 0):
            raise HpctError(f"fault {i} ({f.kind}) at generation 0 must be the first formation")
    if active < 2 and any(f.kind == "owner_and_holder" for f in faults):
        raise HpctError("owner_and_holder needs at least 2 active nodes (a ring replica)")


def plan(cfg: Config, active: int = ACTIVE, nodes: int = NODES) -> list[Fault]:
    """The fault sequence, a pure function of the config (its seed) and the cluster shape.
    The first formation (if any) comes first, at generation 0's start; the faults that need
    two spares come next to the node crash and before it: afterwards one spare fewer is left
    for good."""
    rng = random.Random(cfg.seed)
    formation_kills = 2 * cfg.formations - 1 if cfg.formations else 0
    special = (2 * cfg.back_to_back + cfg.node_crashes + cfg.kill_spares + cfg.hangs
               + formation_kills + 2 * cfg.owner_holders + 2 * cfg.takers)
    singles = cfg.faults - special
    if singles < 0:
        raise HpctError(f"faults={cfg.faults} is fewer than the special faults it must hold "
                        f"({special})")
    rest = ["kill_rank"] * singles + ["hang_rank"] * cfg.hangs + ["kill_spare"] * cfg.kill_spares
    rng.shuffle(rest)
    cut = rng.randrange(len(rest) // 3 + 1)
    head = ["back_to_back"] * cfg.back_to_back
    awkward = (["formation"] * max(cfg.formations - 1, 0) + ["owner_and_holder"]
               * cfg.owner_holders + ["taker"] * cfg.takers)
    if awkward:
        head += awkward
        rng.shuffle(head)
    head += ["node_crash"] * cfg.node_crashes
    kinds = rest[:cut] + head + rest[cut:]
    faults = [Fault(k, rng.randint(cfg.min_gap_steps, cfg.max_gap_steps),
                    rng.randrange(active) if k in AIMED else -1) for k in kinds]
    if cfg.formations:
        # (its gap is not used: it waits for generation 0, not for steps)
        faults.insert(0, Fault("formation", rng.randint(cfg.min_gap_steps, cfg.max_gap_steps),
                               rng.randrange(active), at_start=True))
    check_plan(faults, active, nodes)
    return faults


@dataclass
class JobView:
    """What the controller's event log says about the job right now."""
    members: list[str]
    spare_pids: dict[str, int]  # warm spares that registered and were not lost since
    active_pids: dict[str, int]
    last_fault_t: float  # last fault on an active node
    last_done_t: float
    recovery_s: list[float]
    generation: int = -1  # the latest generation.start's


def view(controller: Sequence[dict]) -> JobView:
    """Fold the controller's events into the job's current layout (pure)."""
    members: list[str] = []
    latest: dict[str, dict] = {}  # node -> its latest register / fault / launch event
    last_fault = last_done = 0.0
    recovery_s = []
    generation = -1
    for e in controller:
        ev = e["event"]
        if ev == "generation.start":
            generation = e["generation"]
        elif ev == "controller.start":
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
                   last_fault_t=last_fault, last_done_t=last_done, recovery_s=recovery_s,
                   generation=generation)


def latest_pid(controller: Sequence[dict], node: str) -> int | None:
    """The pid of the node's latest registered process (pure)."""
    return next((e["pid"] for e in reversed(controller)
                 if e["event"] == "rank.register" and e["node"] == node), None)


class _Tail:
    """The controller's event log as it is written: each read parses only what was appended
    since the last one (a torn last line waits for its end)."""

    def __init__(self, path: Path):
        self.path, self.events = path, []
        self._f = None
        self._buf = b""

    def read(self) -> list[dict]:
        if self._f is None:
            try:
                self._f = open(self.path, "rb")  # noqa: SIM115 (held open, read as it grows)
            except FileNotFoundError:
                return self.events
        chunk = self._f.read()
        if chunk:
            *lines, self._buf = (self._buf + chunk).split(b"\n")
            for line in lines:
                with contextlib.suppress(ValueError):
                    self.events.append(json.loads(line))
        return self.events

    def when(self, what: str, pred: Callable[[dict], bool], since: int = 0,
             timeout: float = FAULT_TIMEOUT_S,
             alive: Callable[[], bool] | None = None) -> dict:
        """The first event from index `since` on that `pred` accepts, polled every 5 ms, so
        that the kill which follows lands within milliseconds of it."""
        deadline = time.monotonic() + timeout
        i, next_check = since, time.monotonic() + 1.0
        while time.monotonic() < deadline:
            events = self.read()
            while i < len(events):
                if pred(events[i]):
                    return events[i]
                i += 1
            if alive is not None and time.monotonic() > next_check:
                if not alive():
                    raise HpctError(f"the job ended before {what}")
                next_check = time.monotonic() + 1.0
            time.sleep(POLL_S)
        raise HpctError(f"never saw {what} within {timeout:.0f} s; see {self.path}")

    def close(self) -> None:
        if self._f is not None:
            self._f.close()


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
        self.tail = _Tail(run_dir / "controller.jsonl")

    def job_queued(self) -> bool:
        return not self.cluster.client().job_finished(self.job_id)

    def wait_quiet(self, need_spares: int, gap_steps: int, steps: int) -> JobView | None:
        """Wait until the last recovery is done, `need_spares` spares are warm and `gap_steps`
        more steps have run; None when the job ends (or is about to) first."""
        deadline = time.monotonic() + FAULT_TIMEOUT_S
        start_step = None
        polls = 0
        while time.monotonic() < deadline:
            v = view(self.tail.read())
            step = last_step(self.run_dir)
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

    def _aim(self, index: int, members: Sequence[str], spare_batch_host: bool,
             with_holder: bool = False) -> int:
        """The plan's position, moved on along the ring while it (or its replica holder)
        is the batch host's rank and that rank is spared."""
        n = len(members)
        for k in range(n):
            i = (index + k) % n
            hit = {members[i], members[replica_peer(i, n)]} if with_holder else {members[i]}
            if not (spare_batch_host and self.batch_host in hit):
                return i
        raise HpctError(f"no position to aim at among {list(members)} that spares "
                        f"{self.batch_host}")

    def at_start(self, fault: Fault, spare_batch_host: bool) -> dict:
        """Formation at generation 0: kill the planned position's rank within 100 ms of the
        first `generation.start` (before any step). Skipped, and said so, when no warm spare
        has registered by then: the loss could not be replaced."""
        rec = _record(fault)
        start = self.tail.when("generation 0's start", lambda e: e["event"] == "generation.start"
                               and e["generation"] == 0, timeout=START_TIMEOUT_S,
                               alive=self.job_queued)
        members = start["members"]
        node = members[self._aim(fault.index, members, spare_batch_host)]
        events = self.tail.read()
        pid = latest_pid(events, node)
        rec["waited_for"] = _waited(start)
        if not view(events).spare_pids or pid is None:
            rec["skipped"] = "no warm spare registered at generation 0's start"
            return rec
        rec["kills"].append(self._signal(fault.kind, node, pid, signal.SIGKILL, "formation"))
        return self._done(rec)

    def inject(self, fault: Fault, v: JobView, spare_batch_host: bool) -> dict:
        """Inject one fault; returns its record: what was done to which node and pid, the
        event it waited for and the delay from that event to the kill."""
        rec = _record(fault)
        kills = rec["kills"]
        ranks = [n for n in sorted(v.active_pids)
                 if not (spare_batch_host and n == self.batch_host)]
        if fault.kind == "kill_spare":
            node = self.rng.choice(sorted(v.spare_pids))
            kills.append(self._signal(fault.kind, node, v.spare_pids[node], signal.SIGKILL))
        elif fault.kind == "node_crash":
            node = self.rng.choice([n for n in ranks if n != self.batch_host])
            t = time.time()
            self.cluster.kill_node(node)
            self.crashed.add(node)
            kills.append({"kind": fault.kind, "node": node, "pid": v.active_pids[node],
                          "t": t, "role": "crash", "signal": "kill_node"})
        elif fault.kind == "back_to_back":
            a, b = self.rng.sample(ranks, 2)
            kills.append(self._signal(fault.kind, a, v.active_pids[a], signal.SIGKILL))
            time.sleep(self.rng.uniform(0.1, 0.5))  # lands while the first is recovering
            kills.append(self._signal(fault.kind, b, v.active_pids[b], signal.SIGKILL))
        elif fault.kind == "owner_and_holder":
            i = self._aim(fault.index, v.members, spare_batch_host, with_holder=True)
            owner, holder = v.members[i], v.members[replica_peer(i, len(v.members))]
            kills.append(self._signal(fault.kind, owner, v.active_pids[owner], signal.SIGKILL,
                                      "owner"))
            kills.append(self._signal(fault.kind, holder, v.active_pids[holder],
                                      signal.SIGKILL, "holder"))
        elif fault.kind == "taker":
            node = v.members[self._aim(fault.index, v.members, spare_batch_host)]
            since = len(self.tail.read())
            kills.append(self._signal(fault.kind, node, v.active_pids[node], signal.SIGKILL,
                                      "trigger"))
            assign = self.tail.when(f"the assignment replacing {node}",
                                    lambda e: e["event"] == "recovery.assign"
                                    and e["generation"] > v.generation, since=since)
            rec["waited_for"] = _waited(assign)
            taker = assign.get("taken", {}).get(node)
            pid = latest_pid(self.tail.events, taker) if taker else None
            if pid is None:
                rec["skipped_second"] = f"no spare took {node}'s position"
            else:
                kills.append(self._signal(fault.kind, taker, pid, signal.SIGKILL, "taker"))
        elif fault.kind == "formation":
            trigger = self.rng.choice(ranks)
            since = len(self.tail.read())
            kills.append(self._signal(fault.kind, trigger, v.active_pids[trigger],
                                      signal.SIGKILL, "trigger"))
            start = self.tail.when(f"the generation formed after {trigger}'s loss",
                                   lambda e: e["event"] == "generation.start"
                                   and e["generation"] > v.generation, since=since)
            members = start["members"]
            node = members[self._aim(fault.index, members, spare_batch_host)]
            rec["waited_for"] = _waited(start)
            pid = latest_pid(self.tail.events, node)
            if pid is None:
                rec["skipped_second"] = f"no registered process of {node} to kill"
            else:
                kills.append(self._signal(fault.kind, node, pid, signal.SIGKILL, "formation"))
        else:
            node = self.rng.choice(ranks)
            sig = signal.SIGSTOP if fault.kind == "hang_rank" else signal.SIGKILL
            kills.append(self._signal(fault.kind, node, v.active_pids[node], sig))
        return self._done(rec)

    def _done(self, rec: dict) -> dict:
        kills = rec["kills"]
        rec["targets"] = [k["node"] for k in kills]
        rec["t"] = kills[0]["t"]
        if rec["waited_for"] is not None and kills[-1]["role"] in WINDOW_S:  # the timed kill
            rec["delay_s"] = kills[-1]["t"] - rec["waited_for"]["t"]
            rec["in_window"] = rec["delay_s"] <= WINDOW_S[rec["kind"]]
        rec["step"] = last_step(self.run_dir)  # after the kills: reading the logs takes a while
        return rec

    def _signal(self, kind: str, node: str, pid: int | None, sig: signal.Signals,
                role: str = "") -> dict:
        if pid is None:
            raise HpctError(f"no registered process of {node} to signal ({kind})")
        t = time.time()
        os.kill(pid, sig)
        return {"kind": kind, "node": node, "pid": pid, "t": t, "role": role or kind,
                "signal": sig.name}


def _record(fault: Fault) -> dict:
    return {"kind": fault.kind, "index": fault.index, "at_start": fault.at_start,
            "targets": [], "kills": [], "waited_for": None, "delay_s": None,
            "window_s": WINDOW_S.get(fault.kind), "in_window": None, "skipped": None}


def _waited(e: dict) -> dict:
    return {"event": e["event"], "generation": e.get("generation"), "t": e["t"]}


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


def spare_timeline(controller: Sequence[dict]) -> list[tuple[float, int]]:
    """(t, warm spares ready from t on), one entry per change (pure). A spare is ready from
    its registration until it is lost, relaunched, or assigned a position."""
    members: list[str] = []
    ready: set[str] = set()
    out: list[tuple[float, int]] = []
    for e in controller:
        ev = e["event"]
        if ev == "controller.start":
            members = list(e["active"])
        elif ev in ("recovery.assign", "recovery.shrink"):
            members = list(e["members"])
            ready -= set(members)
        elif ev == "rank.register":
            if e.get("role") == "spare" and e["node"] not in members:
                ready.add(e["node"])
        elif ev in ("fault.detected", "step.launch"):
            ready.discard(e["node"])
        elif ev in ("job.done", "job.failed", "controller.terminated", "controller.exit") \
                or ev.startswith("escalate."):
            ready.clear()
        else:
            continue
        if not out or out[-1][1] != len(ready):
            out.append((e["t"], len(ready)))
    return out


def pauses_with_spare(controller: Sequence[dict], step_times: Sequence[float],
                      end_t: float) -> list[tuple[float, float, float]]:
    """Each stretch with no step completed, from generation 0's start to the job's end, as
    (start, end, pause with a spare): the part of it from the first moment a warm spare was
    ready to its end (0 when none was) (pure). A pause a spare could have ended is the one
    that counts: without a spare the job has to wait for one."""
    start = next((e["t"] for e in controller if e["event"] == "generation.start"), None)
    if start is None:
        return []
    end = next((e["t"] for e in controller if e["event"] == "job.done"), end_t)
    points = sorted({start, end, *(t for t in step_times if start < t < end)})
    timeline = spare_timeline(controller)
    times = [t for t, _ in timeline]
    out = []
    for a, b in zip(points, points[1:]):
        i = bisect.bisect_right(times, a) - 1
        t0 = a if i >= 0 and timeline[i][1] > 0 else None
        j = i + 1
        while t0 is None and j < len(timeline) and timeline[j][0] < b:
            if timeline[j][1] > 0:
                t0 = timeline[j][0]
            j += 1
        out.append((a, b, b - t0 if t0 is not None else 0.0))
    return out


def recomputed_by_fault(step_evs: Sequence[dict], starts: Sequence[float]) -> list[int]:
    """Steps computed again, per fault (pure): each repeat of a (rank, step) counts for the
    latest fault injected before it was computed again."""
    seen: dict[tuple[int, int], list[float]] = {}
    for e in step_evs:
        seen.setdefault((e["rank"], e["step"]), []).append(e["t"])
    out = [0] * len(starts)
    for ts in seen.values():
        for t in sorted(ts)[1:]:
            i = bisect.bisect_right(starts, t) - 1
            if i >= 0:
                out[i] += 1
    return out


def fault_outcomes(controller: Sequence[dict], records: Sequence[dict],
                   step_evs: Sequence[dict], end_t: float) -> list[dict]:
    """Each fault's outcome (pure): every process it killed was detected, and recovered (a
    `recovery.done` after the last active loss was detected; a lost spare, its fence), how long
    from its first kill to that, whether memory fell back to disk, the steps it cost twice,
    and its longest pause with no step completed while a warm spare was ready. Skipped faults
    come back as they were."""
    live = [r for r in records if not r.get("skipped")]
    starts = [r["t"] for r in live]
    recomputed = recomputed_by_fault(step_evs, starts)
    pauses = pauses_with_spare(controller, [e["t"] for e in step_evs], end_t)
    out = []
    j = -1
    for r in records:
        if r.get("skipped"):
            out.append({**r, "recovered": None})
            continue
        j += 1
        lo, hi = r["t"], starts[j + 1] if j + 1 < len(starts) else end_t
        detected = {}
        for k in r["kills"]:
            detected[k["node"]] = next((e for e in controller if e["event"] == "fault.detected"
                                        and e["node"] == k["node"] and e["t"] >= k["t"]), None)
        end = None
        if detected and all(detected.values()):
            active = [d["t"] for d in detected.values() if d.get("role") != "spare"]
            if active:
                end = next((e for e in controller if e["event"] == "recovery.done"
                            and e["t"] >= max(active)), None)
            else:
                fenced = [next((e for e in controller if e["event"] == "fault.fenced"
                                and e["node"] == n and e["t"] >= d["t"]), None)
                          for n, d in detected.items()]
                end = max(fenced, key=lambda e: e["t"]) if all(fenced) else None
        until = end["t"] if end else hi
        fallback = [e for e in controller if e["event"] == "recovery.disk_fallback"
                    and lo <= e["t"] <= until]
        escalated = [e["event"] for e in controller if lo <= e["t"] < hi
                     and (e["event"].startswith("escalate.") or e["event"] == "job.failed")]
        pause = max((p for a, b, p in pauses if b > lo and a < hi), default=0.0)
        out.append({**r,
                    "detected": {n: d["reason"] if d else None for n, d in detected.items()},
                    "recovered": end is not None and not escalated,
                    "recovery_s": end["t"] - lo if end else None,
                    "controller_recovery_s": end.get("recovery_s") if end else None,
                    "disk_fallback": bool(fallback),
                    "disk_fallback_restore_step": fallback[0]["restore_step"] if fallback
                    else None,
                    "recomputed_steps": recomputed[j],
                    "max_pause_with_spare_s": round(pause, 3),
                    "escalated": escalated})
    return out


def kind_plan(faults: Sequence[Fault]) -> dict[str, int]:
    return {k: n for k in KINDS if (n := sum(f.kind == k for f in faults))}


def kind_counts(faults: Sequence[Fault], results: Sequence[dict]) -> dict[str, dict]:
    """Per kind: planned, injected, skipped, recovered, disk fallbacks, recomputed steps, the
    longest pause with a spare ready, and (timed kinds) kills that landed in their window."""
    out = {}
    for kind in KINDS:
        rs = [r for r in results if r["kind"] == kind]
        planned = sum(f.kind == kind for f in faults)
        if not planned and not rs:
            continue
        done = [r for r in rs if not r.get("skipped")]
        c = {"planned": planned, "injected": len(done), "skipped": len(rs) - len(done),
             "recovered": sum(bool(r["recovered"]) for r in done),
             "disk_fallback": sum(r["disk_fallback"] for r in done),
             "recomputed_steps": sum(r["recomputed_steps"] for r in done),
             "max_pause_with_spare_s": max((r["max_pause_with_spare_s"] for r in done),
                                           default=None)}
        if kind in WINDOW_S:
            c["in_window"] = sum(bool(r.get("in_window")) for r in done)
        out[kind] = c
    return out


def _stress(cluster: LocalCluster, work: Path, cfg: Config, faults: list[Fault]) -> dict:
    """The reference run, then the stress job with `faults` injected; what happened."""
    train = [sys.executable, "-m", "hpct_slurm.examples.train", "--steps", str(cfg.steps),
             "--step-sleep", str(cfg.step_sleep), *(["--position"] if cfg.position else [])]
    env = {"HPCT_ACTIVE_NODES": str(ACTIVE)}
    d = work / "reference"
    jid = submit(cluster, d, TEMPLATE, train, nodes=ACTIVE, env=env)
    wait_job(cluster, jid, d, cfg.job_timeout_s, label="reference")
    ref = collect(d, ACTIVE)

    d = work / "stress"
    injector = _Injector(cluster, d, "n1", random.Random(cfg.seed + 1))
    injector.job_id = submit(cluster, d, TEMPLATE, train, nodes=NODES, env=env)
    t_job = time.monotonic()
    records: list[dict] = []
    error = None
    hung = False
    for i, fault in enumerate(faults):
        try:
            if fault.at_start:
                rec = injector.at_start(fault, cfg.spare_the_batch_host)
            else:
                v = injector.wait_quiet(fault.spares, fault.gap_steps, cfg.steps)
                if v is None:
                    _say(f"[stress] the job ended or is about to: {len(faults) - i} "
                         f"injection(s) not done")
                    break
                rec = injector.inject(fault, v, cfg.spare_the_batch_host)
        except HpctError as exc:
            # a recovery that never ends (or a window never opening): the job is hung, stop it
            error = exc.message
            cancel(cluster, injector.job_id)
            hung = True
            break
        records.append(rec)
        if rec["skipped"]:
            _say(f"[stress] {fault.kind} skipped: {rec['skipped']}")
            continue
        delay = f" {rec['delay_s'] * 1000:.0f} ms after {rec['waited_for']['event']}" \
            if rec["delay_s"] is not None else ""
        _say(f"[stress] {len(records):2d} injections: {fault.kind} "
             f"{' '.join(rec['targets'])} at step {rec['step']}{delay}")
    try:
        wait_job(cluster, injector.job_id, d,
                 max(cfg.job_timeout_s - (time.monotonic() - t_job), 1.0), label="stress")
    except HpctError as exc:
        hung, error = True, error or exc.message
    job_s = time.monotonic() - t_job
    t_end = time.time()
    injector.tail.close()
    injected = [k for r in records for k in r["kills"]]
    # The job left the queue; Slurm may still be reaping its last processes.
    deadline = time.monotonic() + 20
    while True:
        leaked = _job_pids(cluster, [n for n in cluster.nodes if n not in injector.crashed])
        if not any(leaked.values()) or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    ctl = controller_events(d)
    try:
        equal = bitwise_equal(ref, collect(d, ACTIVE), d)
        completed = any(e["event"] == "job.done" for e in ctl)
    except HpctError as exc:
        equal, completed, error = False, False, error or exc.message
    return {"ctl": ctl, "injected": injected, "records": records, "steps": step_events(d),
            "t_end": t_end, "recomputed": recomputed_steps(d), "leaked": leaked,
            "equal": equal, "completed": completed, "hung": hung, "job_s": job_s,
            "error": error}


def run(out_dir: Path, quick: bool = False, root: Path = BENCH_ROOT,
        down: bool = False) -> dict:
    """Run the stress job on the cluster under `root` (brought up if needed, left up unless
    `down`); writes stress.json and stress.png to `out_dir`; returns the summary."""
    cfg = QUICK if quick else FULL
    faults = plan(cfg)
    t_start = time.monotonic()
    cluster = ready_cluster(root, NODES)
    work = fresh_work_dir(root, "bench-stress")
    _say(f"[stress] {len(faults)} fault injections ({sum(f.size for f in faults)} faults: "
         f"{', '.join(f'{k} {n}' for k, n in kind_plan(faults).items())}) into one job of "
         f"{ACTIVE} active + {NODES - ACTIVE} spare nodes under {root}")
    # progress to stderr: stdout's last line is the summary
    with contextlib.redirect_stdout(sys.stderr):
        try:
            got = _stress(cluster, work, cfg, faults)
        finally:
            cluster.heal()
            if down:
                cluster.down()
    results = outcome(got["ctl"], got["injected"])
    per_fault = fault_outcomes(got["ctl"], got["records"], got["steps"], got["t_end"])
    done = [r for r in per_fault if not r.get("skipped")]
    pauses = pauses_with_spare(got["ctl"], [e["t"] for e in got["steps"]], got["t_end"])
    max_pause = max((p for _, _, p in pauses), default=0.0)
    v = view(got["ctl"])
    leaked, equal = got["leaked"], got["equal"]
    summary = {
        "bench": NAME,
        "faults": len(got["injected"]),  # processes killed (or nodes crashed)
        "recovered": sum(r["recovered"] for r in results),
        "injections": len(done),
        "injections_recovered": sum(bool(r["recovered"]) for r in done),
        "all_recovered": bool(done) and all(r["recovered"] for r in done),
        "kinds": kind_counts(faults, per_fault),
        "max_pause_with_spare_s": round(max_pause, 3),
        "pause_limit_s": PAUSE_LIMIT_S,
        "disk_fallbacks": sum(r["disk_fallback"] for r in done),
        "recomputed_steps": got["recomputed"],
        # issue 19's must-show: every fault recovered, bit-identical, no long pause with a
        # spare ready, and the job completed clean
        "passed": bool(done) and all(r["recovered"] for r in done) and equal
        and got["completed"] and not got["hung"] and max_pause <= PAUSE_LIMIT_S
        and not any(leaked.values()),
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
    times = {k: [r["recovery_s"] for r in done if r["kind"] == k
                 and r["recovery_s"] is not None] for k in KINDS}
    kinds = [k for k in KINDS if times[k]]
    plot_bars(out_dir / f"{NAME}.png", kinds, [statistics.median(times[k]) for k in kinds],
              "seconds, fault to recovered (median)",
              f"stress: {summary['injections_recovered']}/{summary['injections']} faults "
              f"recovered, bit-identical: {equal}")
    write_result(out_dir, NAME, {
        "summary": summary, "quick": quick, "config": asdict(cfg),
        "plan": [asdict(f) for f in faults], "faults": per_fault, "injected": results,
        "pauses_over_limit": [{"from": a, "to": b, "with_spare_s": p} for a, b, p in pauses
                              if p > PAUSE_LIMIT_S],
        "by_kind": {k: spread(times[k]) for k in kinds}, "leaked": leaked,
        "controller_recovery_s": v.recovery_s, "wall_s": time.monotonic() - t_start,
        "work_dir": str(work), "method": __doc__,
        "when": datetime.datetime.now(datetime.timezone.utc).isoformat(),
    })
    return summary
