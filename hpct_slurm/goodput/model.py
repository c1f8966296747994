"""Goodput of checkpoint-restart vs hpct-slurm as a job grows from 16 to 100k GPUs. Pure.

Goodput is the fraction of wall time the job's GPUs spend on useful training: not stalled
writing checkpoints, not recovering, not recomputing steps lost since the last checkpoint,
and (for hpct-slurm) not paying the per-step replication cost.

The model is first order (Young/Daly style): failures are a Poisson process, recoveries do not
overlap, and a failure during a recovery is not modelled (it matters only where the expected
loss per hour approaches one hour, and there goodput is near zero anyway). With

    W       useful compute time, wall the job's wall time,
    lam     job failure rate per hour,
    L_fail  wall time lost per failure (recovery + recompute),
    c/tau   checkpoint stall per unit of compute,
    r       replication overhead per unit of compute (hpct-slurm only),
    mu      job fail-slow episodes per hour (a node that keeps working but paces the job),
    L_slow  wall time lost per episode (see FailSlow),

wall = W (1 + c/tau)(1 + r) + lam * wall * L_fail + mu * wall * L_slow, hence

    goodput = W / wall = (1 - lam * L_fail - mu * L_slow) / ((1 + c/tau)(1 + r)).

With mu = 0 the fail-slow term vanishes and every result is exactly the one without it.

Every constant comes from `defaults.json` (each with its source) or from measured results
passed with `--phases`; nothing here is a hidden number.
"""
from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field, replace
from importlib import resources
from pathlib import Path
from typing import Any, Mapping, Sequence

from ..errors import HpctError

CURVE_KINDS = ("linear", "log")
# The sweep the plot and the table use: 16 GPUs (two 8-GPU nodes) to 100k.
SWEEP_GPUS = (16, 32, 64, 128, 256, 512, 1024, 2304, 4096, 8192, 16384, 32768, 65536, 100_000)
# hpct-slurm's fallback checkpoints are written at most this rarely (Young/Daly may ask for
# weeks when spares almost never run out; nobody runs a month without a durable copy).
MAX_FALLBACK_CKPT_INTERVAL_MIN = 24 * 60


@dataclass(frozen=True)
class Curve:
    """Seconds as a function of ranks: a + b*n (linear) or a + b*log2(n) (log)."""

    kind: str
    a: float
    b: float

    def __post_init__(self) -> None:
        if self.kind not in CURVE_KINDS:
            raise HpctError(f"curve kind {self.kind!r} is not one of {', '.join(CURVE_KINDS)}")

    def __call__(self, ranks: float) -> float:
        x = ranks if self.kind == "linear" else math.log2(max(ranks, 1))
        # A fitted intercept can be negative; a phase never takes negative time.
        return max(0.0, self.a + self.b * x)


def fit_curve(points: Sequence[tuple[float, float]], kind: str = "auto") -> Curve:
    """Least-squares fit of (ranks, seconds) points; `auto` keeps the kind with less error.

    Two kinds only, because they are the two hypotheses that matter: a rooted rendezvous
    serialises every rank through one server (linear), a rootless one spreads the work so a
    rank's cost grows with the depth of the exchange (log)."""
    pts = [(float(n), float(s)) for n, s in points]
    if len({n for n, _ in pts}) < 2:
        raise HpctError(f"curve points {list(points)!r} need at least two distinct rank counts")
    if any(n < 1 or s < 0 for n, s in pts):
        raise HpctError(f"curve points {list(points)!r} need ranks >= 1 and seconds >= 0")
    kinds = CURVE_KINDS if kind == "auto" else (kind,)
    best: tuple[float, Curve] | None = None
    for k in kinds:
        xs = [n if k == "linear" else math.log2(n) for n, _ in pts]
        ys = [s for _, s in pts]
        mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
        sxx = sum((x - mx) ** 2 for x in xs)
        b = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sxx
        curve = Curve(k, my - b * mx, b)
        sse = sum((curve(n) - s) ** 2 for n, s in pts)
        if best is None or sse < best[0]:
            best = (sse, curve)
    assert best is not None
    return best[1]


@dataclass(frozen=True)
class CkptRestartCosts:
    """Per-failure phases of the restart-all baseline, seconds (see defaults.json)."""

    detect_s: float
    requeue_s: float
    process_restart_s: float
    ckpt_load_s: float
    data_loader_s: float
    first_step_s: float
    rendezvous: Curve

    def recovery_s(self, ranks: int) -> float:
        return (self.detect_s + self.requeue_s + self.process_restart_s
                + self.rendezvous(ranks) + self.ckpt_load_s + self.data_loader_s
                + self.first_step_s)


@dataclass(frozen=True)
class HpctCosts:
    """Per-failure phases of hpct-slurm's checkpointless recovery, seconds."""

    detect_s: float
    stop_s: float
    reform: Curve
    state_gb_per_gpu: float
    transfer_gb_per_s: float
    data_reattach_s: float
    first_step_s: float
    # Measured growth with the world (`hpct-slurm bench scale`, --phases results/scale.json):
    # when given, detection, stop-to-assignment and assignment-to-acknowledged follow these
    # curves instead of the flat detect_s and stop_s (assignment is otherwise assumed inside
    # first_step_s).
    detect_curve: Curve | None = None
    stop_curve: Curve | None = None
    assign_curve: Curve | None = None

    def terms(self, ranks: int) -> dict[str, float]:
        """Each phase of one recovery at `ranks` ranks, seconds, in order."""
        return {"detect": self.detect_curve(ranks) if self.detect_curve else self.detect_s,
                "stop_to_assign": self.stop_curve(ranks) if self.stop_curve else self.stop_s,
                "assign_to_acked": self.assign_curve(ranks) if self.assign_curve else 0.0,
                "reform": self.reform(ranks), "transfer": self.transfer_s(),
                "data_reattach": self.data_reattach_s, "first_step": self.first_step_s}

    def transfer_s(self) -> float:
        # The replacement pulls only its own ranks' shards, from peers in parallel: the time
        # is one GPU's state over one GPU's share of the fabric, independent of world size.
        return self.state_gb_per_gpu / self.transfer_gb_per_s

    def recovery_s(self, ranks: int) -> float:
        return sum(self.terms(ranks).values())


@dataclass(frozen=True)
class FailSlow:
    """Fail-slow episodes: a node that keeps working but slower, so that the whole synchronous
    job waits for it at every collective. The defaults here switch the term off.

    per_node_hour     episodes per node-hour (a rate; the job's rate is nodes x this)
    slowdown          the job's step time is x this while one node is slow (>= 1)
    undetected_hours  how long an episode lasts when nothing moves the node out: until a
                      person notices or the node fails outright (checkpoint-restart's case)
    step_s            the job's healthy step time, seconds
    window_steps, threshold  hpct-slurm's detector with HPCT_FAILSLOW=move (the default only
                      reports): a node above threshold x the job's median for window_steps
                      steps, held for window_steps more, is moved onto a warm spare
    move_pause_s      the planned move's pause (measured: `hpct-slurm bench move`)
    """

    per_node_hour: float = 0.0
    slowdown: float = 1.0
    undetected_hours: float = 1.0
    step_s: float = 1.0
    window_steps: int = 50
    threshold: float = 1.2
    move_pause_s: float = 0.0

    def __post_init__(self) -> None:
        checks = [("per_node_hour", self.per_node_hour >= 0), ("slowdown", self.slowdown >= 1),
                  ("undetected_hours", self.undetected_hours > 0), ("step_s", self.step_s > 0),
                  ("window_steps", self.window_steps >= 1), ("threshold", self.threshold >= 1),
                  ("move_pause_s", self.move_pause_s >= 0)]
        for name, ok in checks:
            # `not ok` also catches NaN, which compares false with everything
            if not ok or not math.isfinite(getattr(self, name)):
                raise HpctError(f"goodput parameter failslow.{name} = {getattr(self, name)!r} "
                                f"is out of range")

    def job_rate(self, nodes: int) -> float:
        """Episodes per hour of a job on `nodes` nodes: any node can be the slow one."""
        return nodes * self.per_node_hour

    def _lost_per_wall_s(self) -> float:
        # While slow, a second of wall time does 1/slowdown of a second's work.
        return 1.0 - 1.0 / self.slowdown

    def undetected_lost_s(self) -> float:
        """Wall time an episode costs when it runs its whole course (checkpoint-restart)."""
        return self.undetected_hours * 3600 * self._lost_per_wall_s()

    def detect_s(self) -> float:
        """Wall time until hpct-slurm's detector names the node: its window of steps, then
        the hold over as many more, each taking the slowed step time."""
        return 2 * self.window_steps * self.step_s * self.slowdown

    def moved(self) -> bool:
        """Whether hpct-slurm moves the node out: the job's slowdown stands for the node's own
        ratio to the median (the node's compute is slowed at least as much as the job's step,
        so this errs towards not detecting), and the episode must outlast the window and the
        hold."""
        return self.slowdown > self.threshold and self.detect_s() < self.undetected_hours * 3600

    def moved_lost_s(self) -> float:
        """Wall time an episode costs when the node is moved out: slowed steps until
        detection, then the planned move's pause; nothing is recomputed."""
        return self.detect_s() * self._lost_per_wall_s() + self.move_pause_s


@dataclass(frozen=True)
class Params:
    """Everything the model needs besides the GPU count."""

    gpus_per_node: int
    node_fail_per_hour: float
    ckpt_interval_min: float
    ckpt_stall_s: float
    ckpt_restart: CkptRestartCosts
    hpct: HpctCosts
    replication_overhead: float
    spare_fraction: float
    min_spares: int
    spare_refill_hours: float
    spares: int | None = None
    hpct_ckpt_interval_min: float | None = None
    failslow: FailSlow = field(default_factory=FailSlow)
    provenance: dict[str, str] = field(default_factory=dict, compare=False)
    # overlay key (under "hpct", or failslow.<key>) -> the --phases file it was measured in
    measured: dict[str, str] = field(default_factory=dict, compare=False)

    def __post_init__(self) -> None:
        checks = [("gpus_per_node", self.gpus_per_node >= 1),
                  ("node_fail_per_hour", 0 <= self.node_fail_per_hour < 1),
                  ("ckpt_interval_min", self.ckpt_interval_min > 0),
                  ("ckpt_stall_s", self.ckpt_stall_s >= 0),
                  ("replication_overhead", self.replication_overhead >= 0),
                  ("spare_fraction", self.spare_fraction >= 0),
                  ("min_spares", self.min_spares >= 0),
                  ("spare_refill_hours", self.spare_refill_hours > 0),
                  ("spares", self.spares is None or self.spares >= 0),
                  ("hpct_ckpt_interval_min",
                   self.hpct_ckpt_interval_min is None or self.hpct_ckpt_interval_min > 0)]
        for name, ok in checks:
            if not ok:
                raise HpctError(f"goodput parameter {name} = {getattr(self, name)!r} is out of "
                                f"range")


@dataclass(frozen=True)
class Result:
    """One point of the comparison. Times in seconds, rates per hour, goodputs fractions."""

    gpus: int
    nodes: int
    failures_per_hour: float
    ckpt_restart_recovery_s: float
    ckpt_restart_lost_per_failure_s: float
    ckpt_restart_goodput: float
    hpct_recovery_s: float
    hpct_spares: int
    hpct_fallback_fraction: float
    hpct_ckpt_interval_min: float
    hpct_lost_per_failure_s: float
    hpct_goodput: float
    hpct_goodput_incl_spares: float
    # Fail-slow: the job's episodes per hour, the wall time each costs, and the fraction of
    # wall time they cost together (the term subtracted from 1 in the goodput's numerator).
    failslow_per_hour: float
    ckpt_restart_failslow_lost_s: float
    ckpt_restart_failslow_loss: float
    hpct_failslow_lost_s: float
    hpct_failslow_loss: float

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def job_failure_rate(nodes: int, node_fail_per_hour: float) -> float:
    """Failures per hour of a job on `nodes` nodes. A per-node probability p of failing within
    an hour is a rate of -ln(1-p) per node (exact for a Poisson process, ~p for small p); the
    job stops when any node fails, so rates add."""
    return -nodes * math.log1p(-node_fail_per_hour)


def spares_for(nodes: int, p: Params) -> int:
    """Spare nodes a job keeps: the explicit count, else a fraction of its nodes (at least
    `min_spares`)."""
    if p.spares is not None:
        return p.spares
    return max(p.min_spares, math.ceil(nodes * p.spare_fraction))


def spare_exhaustion_probability(rate_per_hour: float, refill_hours: float,
                                 spares: int) -> float:
    """Probability that a failure finds no spare left.

    Failed nodes are away for `refill_hours` (drained, repaired or replaced from the pool,
    then back as spares): an M/G/inf queue, whose occupancy is Poisson with mean
    rate * refill_hours whatever the repair-time distribution. A failure arriving sees that
    occupancy (PASTA) and falls back when all `spares` are already used: P(K >= spares)."""
    mean = rate_per_hour * refill_hours
    if mean <= 0:
        return 1.0 if spares == 0 else 0.0
    # Terms in log space: a 100k-GPU job has means in the tens and spares in the hundreds.
    below = sum(math.exp(k * math.log(mean) - mean - math.lgamma(k + 1)) for k in range(spares))
    return min(1.0, max(0.0, 1.0 - below))


def young_daly_interval_min(stall_s: float, rate_per_hour: float) -> float:
    """Checkpoint interval that minimises stall + expected recompute: sqrt(2 c MTBF)."""
    if rate_per_hour <= 0 or stall_s <= 0:
        return math.inf
    return math.sqrt(2 * (stall_s / 60) * (60 / rate_per_hour))


def _goodput(rate_per_hour: float, lost_per_failure_s: float, slow_loss: float,
             stall_fraction: float, replication_overhead: float) -> float:
    # slow_loss = 0.0 leaves `useful` bit for bit what it was without the fail-slow term
    useful = 1.0 - rate_per_hour * lost_per_failure_s / 3600 - slow_loss
    return max(0.0, useful) / ((1 + stall_fraction) * (1 + replication_overhead))


def evaluate(gpus: int, p: Params) -> Result:
    """Goodput of both recovery schemes for one job of `gpus` GPUs (one rank per GPU)."""
    if gpus < 1:
        raise HpctError(f"gpus {gpus!r} is not a positive number")
    nodes = math.ceil(gpus / p.gpus_per_node)
    rate = job_failure_rate(nodes, p.node_fail_per_hour)
    tau_s = p.ckpt_interval_min * 60

    # Checkpoint-restart: every failure costs the whole restart cascade plus, on average,
    # half an interval of steps recomputed (the failure lands uniformly between checkpoints).
    cr_recovery = p.ckpt_restart.recovery_s(gpus)
    cr_lost = cr_recovery + tau_s / 2
    # A slow node is not a failure: nothing restarts until a person notices, so the job runs
    # the whole episode at 1/slowdown of its speed.
    fs = p.failslow
    slow_rate = fs.job_rate(nodes)
    cr_slow_lost = fs.undetected_lost_s()
    cr_slow = slow_rate * cr_slow_lost / 3600
    cr = _goodput(rate, cr_lost, cr_slow, p.ckpt_stall_s / tau_s, 0.0)

    # hpct-slurm: a failure that finds a spare costs only the checkpointless recovery, nothing
    # recomputed; one that finds none escalates to the same restart cascade from the last
    # durable snapshot. Those snapshots back only the fallback, so they are written at the
    # Young/Daly optimum for the fallback rate (never more often than the baseline's).
    spares = spares_for(nodes, p)
    # A move takes a spare as a recovery does (the slow node is drained and away as long as a
    # failed one), so the episodes hpct-slurm moves share the pool with the failures.
    moves = slow_rate if fs.moved() else 0.0
    q = spare_exhaustion_probability(rate + moves, p.spare_refill_hours, spares)
    if p.hpct_ckpt_interval_min is not None:
        h_tau_min = p.hpct_ckpt_interval_min
    else:
        h_tau_min = min(MAX_FALLBACK_CKPT_INTERVAL_MIN,
                        max(p.ckpt_interval_min,
                            young_daly_interval_min(p.ckpt_stall_s, rate * q)))
    h_tau_s = h_tau_min * 60
    h_recovery = p.hpct.recovery_s(gpus)
    h_lost = (1 - q) * h_recovery + q * (cr_recovery + h_tau_s / 2)
    # A slow node is moved out when the detector sees it and a spare is there; otherwise (no
    # spare: only the event and the drain reason) the episode runs its course as above.
    h_slow_lost = (1 - q) * fs.moved_lost_s() + q * cr_slow_lost if fs.moved() else cr_slow_lost
    h_slow = slow_rate * h_slow_lost / 3600
    h = _goodput(rate, h_lost, h_slow, p.ckpt_stall_s / h_tau_s, p.replication_overhead)
    return Result(
        gpus=gpus, nodes=nodes, failures_per_hour=rate,
        ckpt_restart_recovery_s=cr_recovery, ckpt_restart_lost_per_failure_s=cr_lost,
        ckpt_restart_goodput=cr, hpct_recovery_s=h_recovery, hpct_spares=spares,
        hpct_fallback_fraction=q, hpct_ckpt_interval_min=h_tau_min,
        hpct_lost_per_failure_s=h_lost, hpct_goodput=h,
        # The spares are GPUs paid for but idle: charge them for a cluster-level view.
        hpct_goodput_incl_spares=h * nodes / (nodes + spares),
        failslow_per_hour=slow_rate, ckpt_restart_failslow_lost_s=cr_slow_lost,
        ckpt_restart_failslow_loss=cr_slow, hpct_failslow_lost_s=h_slow_lost,
        hpct_failslow_loss=h_slow)


def sweep(p: Params, gpus: Sequence[int] = SWEEP_GPUS) -> list[Result]:
    return [evaluate(g, p) for g in gpus]


# ---- parameters: defaults.json, measured overlays ----------------------------------------

def _curve(spec: Mapping[str, Any], what: str) -> Curve:
    """A curve given as {"kind", "a", "b"} or as measured {"points": [[ranks, s]...],
    "fit": "log"|"linear"|"auto"}."""
    if "points" in spec:
        return fit_curve([tuple(pt) for pt in spec["points"]], spec.get("fit", "auto"))
    try:
        return Curve(spec["kind"], float(spec["a"]), float(spec["b"]))
    except (KeyError, TypeError, ValueError) as exc:
        raise HpctError(f"{what} {dict(spec)!r} needs kind/a/b or points ({exc})") from None


def _merge(base: dict[str, Any], over: Mapping[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for k, v in over.items():
        if isinstance(v, Mapping) and isinstance(out.get(k), dict):
            out[k] = _merge(out[k], v)
        else:
            out[k] = v
    return out


def default_doc() -> dict[str, Any]:
    text = resources.files(__package__).joinpath("defaults.json").read_text(encoding="utf-8")
    return json.loads(text)


def overlay_from_result(doc: Mapping[str, Any]) -> dict[str, Any]:
    """What a file passed with --phases contributes. Recognised by shape:
    * this model's own schema (keys of defaults.json), taken as is;
    * `hpct-slurm bench rendezvous` output (`sizes`): the rootless init times, rescaled to one
      core per rank, become the hpct re-form curve's points (the baseline's TCPStore curve
      stays calibrated to the
      published anchors: loopback processes on a few cores do not show a real cluster's
      rooted rendezvous);
    * `hpct-slurm bench replication` output (`overhead_pct`): the replication overhead;
    * `hpct-slurm bench recovery` output (`bench: recovery`): the measured hpct phases that do
      not depend on GPUs or the fabric: detection, and stop + fence + survivors' teardown and
      health check (as stop_s). The state transfer (state size over the fabric) and the first
      step (NCCL communicators, warm-up) stay the documented GPU-cluster assumptions: a CPU
      machine cannot measure them;
    * `hpct-slurm bench move` output (`bench: move`): the planned move's pause, which the
      fail-slow term charges per node moved out."""
    if "sizes" in doc:
        # The benchmark runs every rank as a process on one machine; past `cores` ranks they
        # queue for the same CPUs, so wall time grows with ranks/cores even where each rank's
        # work is constant. Rescale to one core per rank, the case of a real cluster.
        cores = int((doc.get("machine") or {}).get("cpu_affinity") or 1)
        try:
            rootless = [[s["ranks"],
                         s["rootless"]["init_s_median"] * min(cores, s["ranks"]) / s["ranks"]]
                        for s in doc["sizes"]]
        except (KeyError, TypeError, ZeroDivisionError) as exc:
            raise HpctError(f"rendezvous result lacks ranks/init_s_median ({exc})") from None
        return {"hpct": {"reform": {"points": rootless, "fit": "auto"}}}
    if "overhead_pct" in doc:
        return {"replication_overhead": float(doc["overhead_pct"]) / 100}
    if doc.get("bench") == "scale":
        return _overlay_from_scale(doc)
    if doc.get("bench") == "recovery":
        try:
            ph = doc["summary"]["phases"]["hpct"]
            return {"hpct": {"detect_s": float(ph["detect"]),
                             "stop_s": float(ph["stop"] + ph["fence"] + ph["survivors_ready"])}}
        except (KeyError, TypeError) as exc:
            raise HpctError(f"recovery result lacks summary.phases.hpct ({exc})") from None
    if doc.get("bench") == "move":
        try:
            return {"failslow": {"move_pause_s": float(doc["move_pause_s_median"])}}
        except (KeyError, TypeError, ValueError) as exc:
            raise HpctError(f"move result lacks move_pause_s_median ({exc})") from None
    return {k: v for k, v in doc.items() if k != "provenance"}


def _points_spec(points: list[list[float]]) -> dict[str, Any]:
    """A curve spec from measured points: fitted from two or more sizes, flat from one."""
    if len({n for n, _ in points}) >= 2:
        return {"points": points, "fit": "auto"}
    return {"kind": "linear", "a": points[0][1], "b": 0.0}


def _overlay_from_scale(doc: Mapping[str, Any]) -> dict[str, Any]:
    """`hpct-slurm bench scale` output: per simulated world size, the worst injected fault's
    controller phases. Detection is the silent node's (a node that dies without a reset is
    seen by missed heartbeats; a crashed process is seen at once, from its connection)."""
    try:
        runs = doc["runs"]
        detect, stop, assign = [], [], []
        for n, run in sorted(runs.items(), key=lambda kv: int(kv[0])):
            rounds = run["rounds"]
            silent = [r["fault_to_detect_s"] for r in rounds if r["fault"] == "silent"]
            detect.append([int(n), max(silent or [r["fault_to_detect_s"] for r in rounds])])
            stop.append([int(n), max(r["detect_to_assign_s"] for r in rounds)])
            assign.append([int(n), max(r["assign_to_all_acked_s"] for r in rounds)])
    except (KeyError, TypeError, ValueError, AttributeError) as exc:
        raise HpctError(f"scale result lacks runs.<N>.rounds phases ({exc})") from None
    if not detect:
        raise HpctError("scale result has no runs")
    return {"hpct": {"detect_curve": _points_spec(detect), "stop_curve": _points_spec(stop),
                     "assign_curve": _points_spec(assign)}}


def params_from_doc(doc: Mapping[str, Any], **overrides: Any) -> Params:
    """Build Params from a defaults-shaped document; `overrides` (CLI flags) win."""
    try:
        cr, h, sp, fs = doc["ckpt_restart"], doc["hpct"], doc["spares"], doc["failslow"]
        p = Params(
            gpus_per_node=int(doc["gpus_per_node"]),
            node_fail_per_hour=float(doc["node_fail_per_hour"]),
            ckpt_interval_min=float(doc["ckpt_interval_min"]),
            ckpt_stall_s=float(doc["ckpt_stall_s"]),
            ckpt_restart=CkptRestartCosts(
                detect_s=float(cr["detect_s"]), requeue_s=float(cr["requeue_s"]),
                process_restart_s=float(cr["process_restart_s"]),
                ckpt_load_s=float(cr["ckpt_load_s"]), data_loader_s=float(cr["data_loader_s"]),
                first_step_s=float(cr["first_step_s"]),
                rendezvous=_curve(cr["rendezvous"], "ckpt_restart.rendezvous")),
            hpct=HpctCosts(
                detect_s=float(h["detect_s"]), stop_s=float(h["stop_s"]),
                reform=_curve(h["reform"], "hpct.reform"),
                state_gb_per_gpu=float(h["state_gb_per_gpu"]),
                transfer_gb_per_s=float(h["transfer_gb_per_s"]),
                data_reattach_s=float(h["data_reattach_s"]),
                first_step_s=float(h["first_step_s"]),
                **{f"{k}_curve": _curve(h[f"{k}_curve"], f"hpct.{k}_curve")
                   for k in ("detect", "stop", "assign") if h.get(f"{k}_curve")}),
            replication_overhead=float(doc["replication_overhead"]),
            spare_fraction=float(sp["fraction"]), min_spares=int(sp["min"]),
            spare_refill_hours=float(sp["refill_hours"]),
            failslow=FailSlow(
                per_node_hour=float(fs["per_node_hour"]), slowdown=float(fs["slowdown"]),
                undetected_hours=float(fs["undetected_hours"]), step_s=float(fs["step_s"]),
                window_steps=int(fs["window_steps"]), threshold=float(fs["threshold"]),
                move_pause_s=float(fs["move_pause_s"])),
            provenance=dict(doc.get("provenance", {})))
    except (KeyError, TypeError, ValueError) as exc:
        raise HpctError(f"goodput parameters lack or mistype {exc}: compare with "
                        f"hpct_slurm/goodput/defaults.json") from None
    return replace(p, **{k: v for k, v in overrides.items() if v is not None})


def load_params(phase_files: Sequence[str | Path] = (),
                failslow: Mapping[str, Any] | None = None, **overrides: Any) -> Params:
    """defaults.json, then each measured file in order, then CLI overrides (`failslow`: keys
    of defaults.json's failslow section)."""
    doc = default_doc()
    measured: dict[str, str] = {}
    for path in phase_files:
        try:
            extra = json.loads(Path(path).read_text(encoding="utf-8"))
        except (OSError, ValueError) as exc:
            raise HpctError(f"phases file {str(path)!r} is unreadable ({exc})") from None
        if not isinstance(extra, dict):
            raise HpctError(f"phases file {str(path)!r} is not a JSON object")
        over = overlay_from_result(extra)
        measured.update({k: str(path) for k in (over.get("hpct") or {})})
        measured.update({f"failslow.{k}": str(path) for k in (over.get("failslow") or {})})
        doc = _merge(doc, over)
    by_hand = {k: v for k, v in (failslow or {}).items() if v is not None}
    for key in by_hand:
        measured.pop(f"failslow.{key}", None)  # a flag given by hand is no measurement
    doc = _merge(doc, {"failslow": by_hand})
    return replace(params_from_doc(doc, **overrides), measured=measured)


# Which defaults.json / overlay key stands behind each recovery term.
TERM_KEYS = {"detect": ("detect_curve", "detect_s"), "stop_to_assign": ("stop_curve", "stop_s"),
             "assign_to_acked": ("assign_curve",), "reform": ("reform",),
             "transfer": ("state_gb_per_gpu", "transfer_gb_per_s"),
             "data_reattach": ("data_reattach_s",), "first_step": ("first_step_s",)}


def recovery_budget(gpus: int, p: Params) -> list[dict[str, Any]]:
    """hpct-slurm's recovery time at `gpus`, term by term, each marked measured (with the
    file) or assumed (defaults.json)."""
    out = []
    for term, seconds in p.hpct.terms(gpus).items():
        src = next((p.measured[k] for k in TERM_KEYS[term] if k in p.measured), None)
        if term == "assign_to_acked" and src is None:
            note = "assumed: inside first_step_s"
        else:
            note = f"measured: {src}" if src else "assumed: defaults.json"
        out.append({"term": term, "s": seconds, "source": note})
    return out
