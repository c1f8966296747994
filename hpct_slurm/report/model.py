"""Pure: a job's event logs -> what happened and what it cost. No file or Slurm access here.

Inputs are the records of `<run dir>/controller.jsonl` and `<run dir>/events/<node>-<lr>.jsonl`
(docs/troubleshooting.md lists the names). Two habits of those logs shape this module:
* A rank file is named after the process (node, local rank), not after the rank: a warm spare
  takes over a rank in a later generation, so ranks come from the `rank` field of the events.
* `rank.adopted` carries the restore source in a field named `source`, which overwrites the
  record's own `source` (the emitter); the emitter is therefore taken from the file name.
* Only the process's own reports, the `rank.*` events, carry its own rank in `rank`; the others
  name the rank they concern (`replica.stored`: the neighbour whose replica arrived;
  `transfer.*`: the rank whose state was fetched or served).

A requeued job appends to the same run dir and starts again at generation 0: every
`controller.start` opens a new attempt, and rank events belong to the attempt whose
controller started last before them.
"""
from __future__ import annotations

import bisect
from dataclasses import asdict, dataclass, field, replace
from typing import Any

from ..controller.policy import PHASES  # recovery.done's `phases`, in the order they happen
from ..errors import HpctError
from ..events import Ev, Role
from ..fault_count import IN_PROCESS, JOB_ENDS, FaultCount
from .records import readable


@dataclass(frozen=True)
class RunEvents:
    """All records of one run dir. `ranks` maps a rank file's stem (`n1-0`) to its records."""

    run_dir: str
    controller: list[dict]
    ranks: dict[str, list[dict]]
    warnings: list[str] = field(default_factory=list)
    checked: bool = False     # every record is one this module can read (check_run)


@dataclass(frozen=True)
class Generation:
    attempt: int
    generation: int
    start_s: float            # generation.start, seconds since the first controller.start
    end_s: float              # the next generation.start, or the end of the run
    members: list[str]
    restore_step: int         # -1: fresh start
    first_step: int | None    # steps completed in this generation (None: none)
    last_step: int | None
    steps: int


@dataclass(frozen=True)
class Fault:
    attempt: int
    t_s: float
    node: str
    reason: str
    generation: int
    role: str                 # "active" or "spare"
    fenced: str | None        # how the controller fenced it (`node down`, `step cancelled`, ...)
    during_recovery: bool     # a second fault folded into a recovery already running
    recovered_in: int | None = None  # the generation whose recovery took an active node's
                                     # fault in (None: a spare's, or no recovery (yet))


@dataclass(frozen=True)
class Recovery:
    attempt: int
    generation: int           # the generation this recovery formed
    detect_s: float           # when the controller started acting on the fault
    done_s: float | None      # every rank completed the first step after the restore
    lost: list[str]
    taken: dict[str, str]     # lost node -> the spare that took its place
    reasons: dict[str, str]
    restore_step: int
    recovery_s: float | None
    phases: dict[str, float]  # controller phases (PHASES), empty when it never finished
    max_teardown_s: float | None   # survivors: abort + tear the old group down + health check
    max_reform_s: float | None     # every rank: form the new process group
    max_restore_s: float | None    # every rank: load the restore step (own memory, peer, disk)
    restore_sources: dict[int, str]  # rank -> `own`, `host:port` of a peer, `disk:...`
    source_kinds: dict[int, str]     # rank -> own, peer, ring, disk or creation
    recomputed_steps: int     # steps the group had completed past restore_step: trained again


@dataclass(frozen=True)
class StepRun:
    """One completion of a training step by the group of one generation."""

    attempt: int
    generation: int
    step: int
    t_s: float                # the last rank that logged it
    duration_s: float         # since the group's previous completed step (or its start)
    ranks: tuple[int, ...]
    recomputed: bool          # a later generation completed this step again


@dataclass(frozen=True)
class Escalation:
    attempt: int
    t_s: float
    event: str                # recovery.failed, escalate.requeue, escalate.fail
    reason: str


@dataclass(frozen=True)
class Report:
    """What a job did and what its faults cost.

    Goodput: productive_s / wall_s, where
    * wall_s runs from the first `generation.start` (training begins; launch and imports are
      reported apart as `startup_s`) to the last `job.done`, or to the last record of any log
      while the job has not finished;
    * productive_s sums, over every distinct step, the duration of the one completion that
      counted: the last one. A completion's duration is the time from the group's previous
      completed step in the same generation (or, for a generation's first step, from the last
      `rank.adopted` of that generation, when the group was formed and restored) to the last
      rank logging this step. Completions that a later generation redid, the recovery gaps,
      steps cut short by a fault and the shutdown after the last step are not productive.
    """

    run_dir: str
    job_id: int | None
    outcome: str              # done, requeued, failed, running, ended (exit without job.done)
    start_unix: float         # the first controller.start: the origin of every `*_s` time
    startup_s: float | None   # first controller.start -> first generation.start
    wall_s: float
    productive_s: float
    goodput: float | None
    attempts: int
    steps_completed: int      # distinct steps completed
    step_runs: int            # completions, redone ones included
    steps_recomputed: int     # step_runs - steps_completed: completions that were redone
    generations: list[Generation]
    faults: list[Fault]
    recoveries: list[Recovery]
    escalations: list[Escalation]
    steps: list[StepRun]
    warnings: list[str]

    def to_dict(self, with_steps: bool = False) -> dict[str, Any]:
        d = asdict(self)
        if not with_steps:
            del d["steps"]
        return d


@dataclass(frozen=True)
class RankStatus:
    process: str              # the rank file's stem: node-localrank
    node: str
    rank: int | None          # this process's own rank, the last it held (None: a spare
                              # never used)
    generation: int | None
    step: int | None          # its latest completed step
    last_event: str
    last_seen_s: float        # seconds before `now`
    # member (its node is in the current generation), spare, lost (its node failed and no
    # other took its place yet), replaced (another node took its node's place), gone (its
    # node left the job otherwise: an earlier attempt's allocation)
    state: str = "member"
    replaced_by: str | None = None  # the node that took its node's place


@dataclass(frozen=True)
class FaultStatus(Fault):
    """A fault as `status` shows it: the report's Fault and what the recovery that took it in
    did (None, empty: no recovery took it in, or it has not finished yet)."""

    replaced_by: str | None = None       # the spare that took the node's place
    recovery_s: float | None = None      # the fault's detection -> every rank of the new
                                         # generation completed its first step (recovery.done)
    restore_step: int | None = None      # the step the new generation restored
    recomputed_steps: int | None = None  # steps completed past restore_step: trained again
    state_sources: dict[int, str] = field(default_factory=dict)  # rank -> own, peer, ring,
                                                                 # disk or creation


@dataclass(frozen=True)
class Status:
    run_dir: str
    job_id: int | None
    start_unix: float         # the first controller.start: the origin of every `*_s` time
    state: str                # starting, running, recovering, or the outcome once it ended
    attempt: int
    generation: int | None
    members: list[str]
    spares: list[str]
    step: int | None          # the newest step every current member has completed
    ranks: list[RankStatus]
    faults: list[FaultStatus]
    recoveries_done: int
    last_controller_event: str
    last_controller_event_s: float  # seconds before `now`
    # One line each: how the job ended and whose failure it was (the script's: not requeued;
    # the infrastructure's: requeued), and what it could not guarantee (too few spares, a
    # restore from disk).
    notes: list[str] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


# ---- checking --------------------------------------------------------------------------

def check_run(run: RunEvents) -> RunEvents:
    """`run` without the records this module cannot read (each said in one warning line, a
    few per file), or a clear error when the logs are not those of an `hpct-slurm controller`
    run at all."""
    if run.checked:
        return run
    warnings = list(run.warnings)
    controller, said = readable(run.controller, "controller.jsonl")
    warnings += said
    ranks = {}
    for name, evs in sorted(run.ranks.items()):
        ranks[name], said = readable(evs, f"events/{name}.jsonl")
        warnings += said
    if not any(e["event"] == Ev.CONTROLLER_START for e in controller):
        raise HpctError(f"run dir {run.run_dir!r}: controller.jsonl has no controller.start: "
                        f"not a run of `hpct-slurm controller` (or it has not started yet)")
    return RunEvents(run.run_dir, controller, ranks, warnings, checked=True)


# ---- the report --------------------------------------------------------------------------

class _Attempts:
    """Which attempt (controller run) a timestamp belongs to."""

    def __init__(self, controller: list[dict]):
        self.starts = sorted(e["t"] for e in controller if e["event"] == Ev.CONTROLLER_START)

    def of(self, t: float) -> int:
        return max(0, bisect.bisect_right(self.starts, t) - 1)

    def __len__(self) -> int:
        return len(self.starts)


def _origin(run: RunEvents) -> float:
    return min(e["t"] for e in run.controller if e["event"] == Ev.CONTROLLER_START)


def _rank_records(run: RunEvents, event: str) -> list[tuple[str, dict]]:
    return sorted(((name, e) for name, evs in run.ranks.items() for e in evs
                   if e["event"] == event), key=lambda x: x[1]["t"])


def _job_id(run: RunEvents) -> int | None:
    ids = [e.get("job_id") for e in run.controller if e["event"] == Ev.CONTROLLER_START]
    return ids[-1] if ids else None


def build_report(run: RunEvents) -> Report:
    run = check_run(run)
    t0 = _origin(run)
    att = _Attempts(run.controller)
    ctl = sorted(run.controller, key=lambda e: e["t"])
    last_t = max([e["t"] for e in ctl] + [e["t"] for evs in run.ranks.values() for e in evs])

    # generations
    gen_events = [e for e in ctl if e["event"] == Ev.GENERATION_START]
    done_events = [e for e in ctl if e["event"] == Ev.JOB_DONE]
    end_t = done_events[-1]["t"] if done_events else last_t
    first_gen_t = gen_events[0]["t"] if gen_events else None

    # step completions: (attempt, generation, step) -> ranks and the last rank's time
    runs: dict[tuple[int, int, int], list[tuple[float, int]]] = {}
    for _, e in _rank_records(run, Ev.RANK_STEP):
        key = (att.of(e["t"]), int(e["generation"]), int(e["step"]))
        runs.setdefault(key, []).append((e["t"], int(e["rank"])))
    adopted_t: dict[tuple[int, int], float] = {}
    for _, e in _rank_records(run, Ev.RANK_ADOPTED):
        key = (att.of(e["t"]), int(e["generation"]))
        adopted_t[key] = max(adopted_t.get(key, e["t"]), e["t"])
    gen_start_t = {(att.of(e["t"]), int(e["generation"])): e["t"] for e in gen_events}

    last_run_of: dict[int, tuple[int, int]] = {}
    for a, g, s in sorted(runs):
        last_run_of[s] = (a, g)
    steps: list[StepRun] = []
    prev: tuple[int, int] | None = None
    prev_t = 0.0
    for a, g, s in sorted(runs):
        t = max(tt for tt, _ in runs[(a, g, s)])
        if prev != (a, g):
            prev_t = adopted_t.get((a, g), gen_start_t.get((a, g), t))
            prev = (a, g)
        steps.append(StepRun(a, g, s, t - t0, max(0.0, t - prev_t),
                             tuple(sorted({r for _, r in runs[(a, g, s)]})),
                             last_run_of[s] != (a, g)))
        prev_t = t
    productive = sum(r.duration_s for r in steps if not r.recomputed)
    wall = end_t - first_gen_t if first_gen_t is not None else 0.0

    generations = []
    for i, e in enumerate(gen_events):
        a, g = att.of(e["t"]), int(e["generation"])
        nxt = gen_events[i + 1]["t"] if i + 1 < len(gen_events) else end_t
        mine = [r.step for r in steps if (r.attempt, r.generation) == (a, g)]
        generations.append(Generation(a, g, e["t"] - t0, nxt - t0, list(e["members"]),
                                      int(e["restore_step"]), min(mine, default=None),
                                      max(mine, default=None), len(mine)))

    faults, recoveries, escalations = _faults_and_recoveries(run, ctl, att, t0, generations)
    warnings = list(run.warnings)
    if not run.ranks:
        warnings.append(f"run dir {run.run_dir!r} has no rank events (events/*.jsonl): "
                        f"steps and goodput are unknown")
    return Report(
        run_dir=run.run_dir, job_id=_job_id(run), outcome=_outcome(ctl, att),
        start_unix=t0, startup_s=(first_gen_t - t0) if first_gen_t is not None else None,
        wall_s=wall, productive_s=productive,
        goodput=productive / wall if wall > 0 and run.ranks else None,
        attempts=len(att), steps_completed=len(last_run_of),
        step_runs=len(steps), steps_recomputed=len(steps) - len(last_run_of),
        generations=generations, faults=faults, recoveries=recoveries,
        escalations=escalations, steps=steps, warnings=warnings)


def _outcome(ctl: list[dict], att: _Attempts) -> str:
    last = [e for e in ctl if att.of(e["t"]) == len(att) - 1]
    names = [e["event"] for e in last]
    if Ev.JOB_DONE in names:
        return "done"
    if Ev.ESCALATE_REQUEUE in names:
        return "requeued"
    exits = [e for e in last if e["event"] == Ev.CONTROLLER_EXIT]
    if Ev.ESCALATE_FAIL in names or (exits and exits[-1].get("code", 0) != 0):
        return "failed"
    return "ended" if exits else "running"


def _faults_and_recoveries(run: RunEvents, ctl: list[dict], att: _Attempts, t0: float,
                           generations: list[Generation]
                           ) -> tuple[list[Fault], list[Recovery], list[Escalation]]:
    fenced: dict[tuple[int, str], list[str]] = {}
    for e in ctl:
        if e["event"] == Ev.FAULT_FENCED:
            fenced.setdefault((att.of(e["t"]), e["node"]), []).append(e.get("how", ""))
    faults: list[Fault] = []
    escalations: list[Escalation] = []
    pending: list[dict] = []       # faults detected since the last recovery.assign
    took: list[int] = []           # ... and their places in `faults`
    assigns: list[tuple[dict, list[dict], list[int]]] = []
    in_recovery, stopped_gen = False, -1
    seen_fenced: dict[tuple[int, str], int] = {}
    counted = FaultCount()  # one fault per fault: the controller's own rule
    for e in ctl:
        ev, a = e["event"], att.of(e["t"])
        new = counted.see(e)
        if ev == Ev.CONTROLLER_START:
            pending, took, in_recovery = [], [], False
        elif ev == Ev.FAULT_DETECTED and new:
            key = (a, e["node"])
            hows = fenced.get(key, [])
            n = seen_fenced.get(key, 0)
            seen_fenced[key] = n + 1
            faults.append(Fault(a, e["t"] - t0, e["node"], e.get("reason", ""),
                                int(e.get("generation", -1)), e.get("role", "active"),
                                hows[n] if n < len(hows) else None, in_recovery))
            pending.append(e)
            took.append(len(faults) - 1)
        elif ev == Ev.FAULT_STOP_SENT:
            in_recovery, stopped_gen = True, int(e.get("generation", -1))
        elif ev == Ev.FAULT_SECOND:
            # survivors that failed their health check or never answered get no
            # fault.detected of their own: this event is their only record
            for node in new:
                faults.append(Fault(a, e["t"] - t0, node, "not ready after fault",
                                    stopped_gen, "active", None, True))
                pending.append({"t": e["t"], "node": node, "reason": "not ready after fault"})
                took.append(len(faults) - 1)
        elif ev == Ev.RECOVERY_ASSIGN:
            assigns.append((e, pending, took))
            pending, took, in_recovery = [], [], False
        elif ev in (Ev.RECOVERY_FAILED, Ev.ESCALATE_REQUEUE, Ev.ESCALATE_FAIL):
            escalations.append(Escalation(a, e["t"] - t0, ev,
                                          e.get("reason") or e.get("error") or ""))
            in_recovery = False

    done = {(att.of(e["t"]), int(e["generation"])): e for e in ctl
            if e["event"] == Ev.RECOVERY_DONE}
    teardown: dict[tuple[int, int], list[float]] = {}
    for name, evs in run.ranks.items():
        fault_gen = None
        for e in sorted(evs, key=lambda x: x["t"]):
            if e["event"] == Ev.RANK_FAULT:
                fault_gen = (att.of(e["t"]), int(e["generation"]))
            elif e["event"] == Ev.RANK_READY and fault_gen is not None \
                    and "teardown_s" in e:
                teardown.setdefault(fault_gen, []).append(float(e["teardown_s"]))
    adopted: dict[tuple[int, int], list[dict]] = {}
    for _, e in _rank_records(run, Ev.RANK_ADOPTED):
        adopted.setdefault((att.of(e["t"]), int(e["generation"])), []).append(e)

    recoveries = []
    for e, detected, fault_ids in assigns:
        a, g = att.of(e["t"]), int(e["generation"])
        for i in fault_ids:
            if faults[i].role == Role.ACTIVE:
                faults[i] = replace(faults[i], recovered_in=g)
        d = done.get((a, g))
        taken = dict(e.get("taken") or {})
        if d is not None:
            detect_t = d["t"] - float(d["recovery_s"])
            lost, reasons = list(d["lost"]), dict(d["reasons"])
        else:
            detect_t = min((f["t"] for f in detected), default=e["t"])
            lost = list(taken)
            reasons = {f["node"]: f.get("reason", "") for f in detected if f["node"] in taken}
        ranks = adopted.get((a, g), [])
        tear = teardown.get((a, g - 1), [])
        planned = e.get("sources") or {}
        # where the group before stood: its last step, or its restore step if it completed none
        prev = [x for x in generations if x.attempt == a and x.generation < g][-1:]
        stood = max([-1] + [x.restore_step for x in prev]
                    + [x.last_step for x in prev if x.last_step is not None])
        recoveries.append(Recovery(
            attempt=a, generation=g, detect_s=detect_t - t0,
            done_s=d["t"] - t0 if d is not None else None, lost=lost, taken=taken,
            reasons=reasons, restore_step=int(e["restore_step"]),
            recovery_s=float(d["recovery_s"]) if d is not None else None,
            phases={k: float(d["phases"][k]) for k in PHASES if k in d["phases"]}
            if d is not None else {},
            max_teardown_s=max(tear, default=None),
            max_reform_s=max((float(r["reform_s"]) for r in ranks), default=None),
            max_restore_s=max((float(r["restore_s"]) for r in ranks), default=None),
            restore_sources={int(r["rank"]): str(r.get("source", "")) for r in ranks},
            source_kinds={int(r["rank"]): source_kind(str(r.get("source", "")),
                                                      planned.get(str(r["rank"])))
                          for r in sorted(ranks, key=lambda r: int(r["rank"]))},
            recomputed_steps=max(0, stood - int(e["restore_step"]))))
    return faults, recoveries, escalations


def source_kind(source: str, planned: str | None = None) -> str:
    """Where a rank's restored state came from, from its `rank.adopted` `source`: own, peer,
    ring, disk or creation. An address (several, comma-separated, for a striped pull) is
    another process's memory: a ring replica where the controller planned one (recovery.assign's
    `sources`), else a peer's copy."""
    if source in ("", "own", "creation"):
        return source
    if source == "fresh":       # what older versions called a start at creation
        return "creation"
    if source.startswith("disk:"):
        return "disk"
    return "ring" if planned == "ring" else "peer"


# ---- status of a running job -------------------------------------------------------------

def build_status(run: RunEvents, now: float) -> Status:
    """Where a (possibly running) job stands at unix time `now`: the report's model (faults,
    recoveries) and the current attempt's members, spares and processes."""
    run = check_run(run)
    rep = build_report(run)
    att = _Attempts(run.controller)
    ctl = sorted(run.controller, key=lambda e: e["t"])
    current = len(att) - 1
    mine = [e for e in ctl if att.of(e["t"]) == current]
    members: list[str] = []
    spares: list[str] = []
    lost: set[str] = set()            # nodes failed and not (yet) back in a generation
    taken: dict[str, str] = {}        # node -> the node that took its place
    before: dict[str, str] = {}       # ... of a node back as a spare since (fenced alive)
    generation = None
    recovering = False
    ended = False  # the job's end is written: its ranks leaving lose no node
    for e in mine:
        ev = e["event"]
        if ev in JOB_ENDS:
            ended = True
        if ev == Ev.CONTROLLER_START:
            members, spares = list(e.get("active", [])), list(e.get("spares", []))
        elif ev == Ev.STEP_LAUNCH and e.get("role") == Role.SPARE and e["node"] not in spares:
            spares.append(e["node"])  # a spare, or a node fenced alive that came back as one
            lost.discard(e["node"])
            if e["node"] in taken:
                before[e["node"]] = taken.pop(e["node"])
        elif ev == Ev.FAULT_DETECTED and (ended or e.get("reason") == IN_PROCESS):
            # a rank's own report restarts its node in place: a member still, not lost
            recovering = recovering or not ended
        elif ev == Ev.FAULT_DETECTED:
            lost.add(e["node"])
            if e["node"] in spares:
                spares.remove(e["node"])
            else:
                recovering = True
        elif ev == Ev.FAULT_SECOND:
            lost.update(e.get("nodes", []))
        elif ev in (Ev.RECOVERY_ASSIGN, Ev.MOVE_ASSIGN):
            taken.update(e.get("taken") or {})
            spares = [s for s in spares if s not in (e.get("taken") or {}).values()]
        elif ev == Ev.GENERATION_START:
            generation, members = int(e["generation"]), list(e["members"])
            lost -= set(members)
            taken = {a: b for a, b in taken.items() if a not in members}
        elif ev == Ev.RECOVERY_DONE:
            recovering = False
    # each node in one list: a member lost in the last round is lost, a spare taken a member
    members = [n for n in members if n not in lost]
    spares = [n for n in spares if n not in members and n not in lost]
    names = [e["event"] for e in mine]
    if rep.outcome != "running":
        state = rep.outcome
    elif recovering:
        state = "recovering"
    elif generation is None:
        state = "starting"
    else:
        state = "running"

    ranks = []
    for name in sorted(run.ranks):
        evs = sorted(run.ranks[name], key=lambda x: x["t"])
        if not evs:
            continue
        node, _, _ = name.rpartition("-")
        # the last rank it held: a node fenced alive and back as a spare reports rank -1 since
        held = [e["rank"] for e in evs if e["event"].startswith("rank.")
                and e.get("rank", -1) >= 0]
        last_step = [e for e in evs if e["event"] == Ev.RANK_STEP]
        rank = int(held[-1]) if held else None
        node = node or name
        where = "replaced" if node in taken else "lost" if node in lost else \
            "member" if node in members else "spare" if node in spares else "gone"
        ranks.append(RankStatus(
            process=name, node=node, rank=rank,
            generation=int(last_step[-1]["generation"]) if last_step else None,
            step=int(last_step[-1]["step"]) if last_step else None,
            last_event=evs[-1]["event"], last_seen_s=now - evs[-1]["t"],
            state=where, replaced_by=taken.get(node) or before.get(node)))
    in_gen = [r for r in ranks
              if r.node in members and r.generation == generation and r.step is not None]
    every_member = set(members) <= {r.node for r in in_gen}
    return Status(
        run_dir=run.run_dir, job_id=rep.job_id, start_unix=rep.start_unix, state=state,
        attempt=current, generation=generation, members=members, spares=spares,
        step=min(r.step for r in in_gen) if in_gen and every_member else None,
        ranks=ranks, faults=fault_statuses(rep),
        recoveries_done=names.count(Ev.RECOVERY_DONE),
        last_controller_event=mine[-1]["event"], last_controller_event_s=now - mine[-1]["t"],
        notes=_notes(mine))


def fault_statuses(rep: Report) -> list[FaultStatus]:
    """Each fault of the report with what the recovery that took it in did."""
    recoveries = {(r.attempt, r.generation): r for r in rep.recoveries}
    out = []
    for f in rep.faults:
        r = recoveries.get((f.attempt, f.recovered_in))
        if r is None:
            out.append(FaultStatus(**vars(f)))
            continue
        # A round cut short by another fault (before its first step) was folded into the
        # next round that finished: that one's recovery.done is this fault's too.
        folded = r if r.done_s is not None else next(
            (x for x in rep.recoveries if x.attempt == r.attempt
             and x.generation > r.generation and x.done_s is not None), r)
        out.append(FaultStatus(**{**vars(f), "recovered_in": folded.generation},
                               replaced_by=r.taken.get(f.node), recovery_s=folded.recovery_s,
                               restore_step=folded.restore_step,
                               recomputed_steps=folded.recomputed_steps,
                               state_sources=dict(folded.source_kinds)))
    return out


# Slurm's node states a requeued job cannot start on (scontrol's lower-case base states,
# with the "*" of a node not responding): what `status` counts as unusable.
UNUSABLE_NODE_STATES = ("down", "drain", "drained", "draining", "fail", "failing",
                        "future", "unknown", "not_responding")


def pending_note(state: str, reason: str | None, node_states: dict[str, str]) -> str | None:
    """Why a requeued job has not started again (issue 30): Slurm's state and reason, and the
    nodes that cannot take it now. None once it runs (or ended)."""
    if state != "PENDING":
        return None
    unusable = sorted(n for n, st in node_states.items()
                      if st.endswith("*") or any(st.startswith(u)
                                                 for u in UNUSABLE_NODE_STATES))
    usable = len(node_states) - len(unusable)
    not_these = f", not {', '.join(unusable)} (down or drained)" if unusable else ""
    return (f"waiting: Slurm holds the requeued job PENDING (reason: {reason or 'none given'}); "
            f"{usable} of the cluster's {len(node_states)} nodes can take it now{not_these}: it "
            f"starts once enough are back (the template's --nodes minimum), "
            f"`scontrol update NodeName=... State=RESUME` for a node that is fixed")


def _notes(ctl: list[dict]) -> list[str]:
    notes = []
    for e in ctl:
        ev, why = e["event"], e.get("reason", "")
        if ev == Ev.JOB_FAILED and e.get("cause") == "script":
            notes.append(f"ended: the training script's own error, not requeued: {why}")
        elif ev == Ev.JOB_FAILED:
            notes.append(f"ended, not requeued: {why}")
        elif ev == Ev.ESCALATE_REQUEUE:
            notes.append(f"requeued: infrastructure failure: {why}")
        elif ev == Ev.ESCALATE_FAIL:
            notes.append(f"ended: infrastructure failure, not requeued (--on-no-spare fail): "
                         f"{why}")
        elif ev == Ev.NODE_SLOW:
            notes.append(f"slow node {e['node']}: {e['ratio']:.2f} x the other nodes' median "
                         f"own time per step over {e['window']} steps (at step "
                         f"{e.get('step', '?')}): {e.get('action', '')}")
        elif ev == Ev.NODE_CORRUPT:
            notes.append(f"silent data corruption on {e['node']} (its replicas disagreed with "
                         f"it): {e.get('action', '')}")
        elif ev == Ev.CONTROLLER_SPARES_SHORT:
            notes.append(f"warning: asked for {e.get('wanted')} warm spare(s), the allocation "
                         f"gave {e.get('got')}")
        elif ev == Ev.RECOVERY_DISK_FALLBACK:
            notes.append(f"warning: generation {e.get('generation')} restored step "
                         f"{e.get('restore_step')} from disk (memory held no consistent copy "
                         f"for rank(s) {e.get('ranks')}; newest held {e.get('newest_held')}): "
                         f"the steps since are recomputed")
    return notes
