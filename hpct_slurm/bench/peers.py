"""hpct-slurm side by side with its peers (issue 29), on the real local Slurm cluster.

The same job for every system: `torchrun_inline.py`'s model, data and schedule (a small
transformer LM, AdamW, cosine schedule, DistributedSampler), 4 active nodes of one rank each
plus 1 spare node, and the same fault: node n3 hard-crashed (`kill_node`: slurmd, slurmstepd and
every task SIGKILLed) once any rank completed step `kill_at`. Each system runs its own adopted
copy of the script, once without a fault (its reference) and once with the crash:
  hpct-slurm  examples/adopted_inline.py under the shipped sbatch template;
  torchft     examples/peers/torchft_ddp.py: Lighthouse on the batch host, one replica group
              per node, the lost group relaunched onto the spare (bench/peers_driver.py);
  nvrx        examples/peers/nvrx_ddp.py under nvidia-resiliency-ext's ft_launcher (one per
              node, the spare waiting in the rendezvous), in-job restart from the last disk
              checkpoint.

Per system:
  back_to_speed_s      the one yardstick (localcluster.jobs.back_at): seconds from the crash
                       until every rank of the group at full world size completed a step after
                       the last step reached before the crash;
  lost_steps           steps some rank computed more than once (recomputed);
  reduced_world_steps  steps committed by fewer than all ranks (torchft goes on without the
                       lost group), and skipped_batches: the data batches those steps left out;
  bitwise_equal        every rank's final parameters equal to the same system's fault-free run;
  goodput              over the fixed window of steps from the crash to the end of training:
                       (useful batches / all batches of the window) x (the fault-free run's time
                       for those steps / the faulted run's), both timed from the group's
                       completion of the last step before the crash;
  changed_lines        the adopted script against torchrun_inline.py (tests/test_adoption.py's
                       count, whitespace counted; lines marked `# bench` left out);
  version              of the system's package.
A peer that is not installed, or whose run fails, carries `error` (the exact message) instead;
the bench still runs the others.
"""
from __future__ import annotations

import ast
import contextlib
import datetime
import difflib
import importlib
import importlib.metadata
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable, Sequence

from ..errors import HpctError
from ..localcluster import LocalCluster
from ..localcluster.jobs import (NODES, TEMPLATE, VICTIM, back_at, back_to_speed, cancel, collect,
                                 crash_at, fresh_work_dir, ready_cluster, step_events, submit,
                                 wait_finished)
from . import peers_driver
from .common import write_result
from .recovery import BENCH_ROOT

NAME = "peers"
ACTIVE = NODES - 1
SYSTEMS = ("hpct-slurm", "torchft", "nvrx")
EXAMPLES = Path(__file__).resolve().parent.parent / "examples"
PLAIN = EXAMPLES / "torchrun_inline.py"
SCRIPTS = {"hpct-slurm": EXAMPLES / "adopted_inline.py",
           "torchft": EXAMPLES / "peers" / "torchft_ddp.py",
           "nvrx": EXAMPLES / "peers" / "nvrx_ddp.py"}
PACKAGES = {"hpct-slurm": ("hpct_slurm", "hpct-slurm"), "torchft": ("torchft", "torchft"),
            "nvrx": ("nvidia_resiliency_ext.fault_tolerance", "nvidia-resiliency-ext")}
INSTALL_HINT = "install the peers extra: pip install '.[peers]' (scripts/setup.sh installs torchft)"


@dataclass(frozen=True)
class Config:
    epochs: int
    kill_at: int
    step_sleep: float
    ckpt_every: int = 10          # NVRx's checkpoint interval (steps)
    heartbeat_ms: int = 1000      # torchft Lighthouse --heartbeat_timeout_ms (default 5000)
    timeout_s: float = 300.0

    def script_args(self) -> list[str]:
        return ["--epochs", str(self.epochs), "--step-sleep", str(self.step_sleep)]


STEPS_PER_EPOCH = 8  # 512 samples / (4 ranks x batch 16)
# The run after the crash must outlast the slowest recovery (NVRx's, ~15-20 s here), or the
# survivors of torchft end training before the relaunched group joins them. About 0.37 s a
# step on the 2-core VM.
FULL = Config(epochs=20, kill_at=40, step_sleep=0.25)
QUICK = Config(epochs=10, kill_at=16, step_sleep=0.25)


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

def _committed(steps: Sequence[dict]) -> list[dict]:
    return [e for e in steps if e.get("committed", True)]


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


def goodput(steps: Sequence[dict], ref_steps: Sequence[dict], k_last: int, t_kill: float,
            last: int, world: int) -> float:
    """Over the window of steps k_last+1..last: the share of the window's batches that were
    trained (a step at world w < full trains w of them) times the fault-free run's time for
    those steps over this run's (from the crash)."""
    window = range(k_last + 1, last + 1)
    if not window:
        raise HpctError(f"the crash came after the last step ({k_last} >= {last})")
    by_step: dict[int, int] = {}
    for e in _committed(steps):
        if e["step"] in window:
            by_step[e["step"]] = max(by_step.get(e["step"], 0), e.get("world", world))
    useful = sum(by_step.values()) / (world * len(window))
    t_ref = finished_at(ref_steps, last) - finished_at(ref_steps, k_last)
    # from the same point in both runs: when the group had completed step k_last (before the
    # crash: a step recomputed after it is not that point)
    t_from = max((e["t"] for e in _committed(steps) if e["step"] == k_last and e["t"] < t_kill),
                 default=t_kill)
    return useful * t_ref / (finished_at(steps, last) - t_from)


def yardstick(system: str, run_dir: Path, steps: Sequence[dict],
              t_kill: float) -> tuple[float, int]:
    """back_to_speed_s and the last step before the crash: localcluster.jobs.back_at, with
    the group at full world size after the crash picked out per system."""
    if system == "hpct-slurm":
        return back_to_speed(run_dir, t_kill)
    k_last = max((e["step"] for e in _committed(steps) if e["t"] < t_kill), default=-1)
    new: Callable[[dict], bool]
    if system == "torchft":  # back at full world: a step every group committed together
        def new(e: dict) -> bool:
            return e["t"] > t_kill and e.get("world") == ACTIVE and e.get("committed", True)
    else:  # nvrx: every rank restarted by the launchers (its process started after the crash)
        def new(e: dict) -> bool:
            return e["started"] > t_kill
    return back_at(_committed(steps), k_last, range(ACTIVE), new) - t_kill, k_last


def params(run_dir: Path) -> dict[int, str]:
    """Every rank's final parameters digest; an HpctError naming the first missing one."""
    return {r: res["params_sha256"] for r, res in collect(run_dir, ACTIVE).items()}


# ---- running the systems -----------------------------------------------------------------

def _submit(cluster: LocalCluster, system: str, run_dir: Path, cfg: Config) -> int:
    if system == "hpct-slurm":
        return submit(cluster, run_dir, TEMPLATE, [sys.executable, "-m",
                                                   "hpct_slurm.examples.adopted_inline",
                                                   *cfg.script_args()])
    script_args = cfg.script_args()
    if system == "nvrx":
        script_args += ["--ckpt-every", str(cfg.ckpt_every)]
    return submit(cluster, run_dir, peers_driver.batch_script(run_dir),
                  ["--system", system, "--run-dir", str(run_dir), "--active", str(ACTIVE),
                   "--heartbeat-ms", str(cfg.heartbeat_ms), "--", *script_args])


def _run(cluster: LocalCluster, system: str, run_dir: Path, cfg: Config,
         crash: bool) -> float | None:
    jid = _submit(cluster, system, run_dir, cfg)
    try:
        t_kill = crash_at(cluster, run_dir, cfg.kill_at, cfg.timeout_s) if crash else None
        wait_finished(cluster, jid, cfg.timeout_s, f"{system} job {jid}")
    except BaseException:
        cancel(cluster, jid)
        raise
    return t_kill


def measure(cluster: LocalCluster, system: str, work: Path, cfg: Config) -> dict:
    """One system: its fault-free reference, then the crash; the record the summary shows."""
    ver = version(system)
    lines = script_changes(system)
    ref_dir, run_dir = work / system / "reference", work / system / "crash"
    cluster.heal()
    _run(cluster, system, ref_dir, cfg, crash=False)
    ref = params(ref_dir)
    cluster.heal()
    t_kill = _run(cluster, system, run_dir, cfg, crash=True)
    assert t_kill is not None
    got = params(run_dir)
    steps, ref_steps = step_events(run_dir), step_events(ref_dir)
    took, k_last = yardstick(system, run_dir, steps, t_kill)
    last = cfg.epochs * STEPS_PER_EPOCH - 1
    short, skipped = reduced([e for e in steps if e["t"] > t_kill], ACTIVE)
    return {"back_to_speed_s": round(took, 3), "lost_steps": recomputed(steps),
            "reduced_world_steps": short, "skipped_batches": skipped,
            "bitwise_equal": got == ref,
            "goodput": round(goodput(steps, ref_steps, k_last, t_kill, last, ACTIVE), 4),
            "changed_lines": lines, "version": ver, "k_last": k_last,
            # the fault-free run's mean step time: the steady-state cost, which goodput (each
            # system against its own fault-free run) leaves out
            "reference_step_s": round((finished_at(ref_steps, last)
                                       - finished_at(ref_steps, 0)) / last, 4),
            "replicas_equal": len(set(got.values())) == 1,
            "reference_equal_across_ranks": len(set(ref.values())) == 1,
            "run_dir": str(run_dir), "reference_dir": str(ref_dir)}


def configuration(cfg: Config) -> dict[str, str]:
    """What each system was given (the docs repeat it)."""
    return {
        "hpct-slurm": "the shipped sbatch template (templates/train.sbatch), defaults: "
                      "4 active + 1 warm spare, HPCT_HEARTBEAT_S 0.5, in-memory snapshots",
        "torchft": f"torchft_lighthouse --min_replicas 1 --quorum_tick_ms 100 "
                   f"--join_timeout_ms 10000 --heartbeat_timeout_ms {cfg.heartbeat_ms} on the "
                   f"batch host (the Slurm README's flags; heartbeat below its 5000 ms "
                   f"default); Manager(min_replica_size=1, timeout=10 s, "
                   f"ProcessGroupGloo(timeout=10 s)), HTTP live healing; one replica group "
                   f"per node, its own job step; a lost group relaunched onto the warm spare "
                   f"node as soon as its step ends or its slurmd stops answering (0.3 s "
                   f"polls)",
        "nvrx": f"ft_launcher --nnodes=4:4 --nproc-per-node=1 --max-restarts=3 "
                f"--rdzv-backend=c10d --monitor-interval=0.1 "
                f"--ft-initial-rank-heartbeat-timeout=60 --ft-rank-heartbeat-timeout=30, one "
                f"per node (5: the spare waits in the rendezvous), a standalone TCPStore on "
                f"the batch host as the rendezvous endpoint; in-job restart of every rank from "
                f"a torch.save checkpoint on the shared run dir every {cfg.ckpt_every} steps "
                f"(model, optimizer, schedule, RNG, data position)",
    }


def _plot(path: Path, systems: dict[str, dict], quick: bool) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    metrics = (("back_to_speed_s", "s to full world and speed"),
               ("lost_steps", "steps recomputed"),
               ("reduced_world_steps", "steps at reduced world"),
               ("goodput", "goodput (window after the crash)"))
    names = list(systems)
    colors = ["#4c72b0", "#dd8452", "#55a868"]
    fig, axes = plt.subplots(1, len(metrics), figsize=(4 * len(metrics), 3.8))
    for ax, (key, label) in zip(axes, metrics):
        vals = [systems[n].get(key) if "error" not in systems[n] else 0 for n in names]
        bars = ax.bar(names, [v or 0 for v in vals], color=colors[:len(names)])
        ax.bar_label(bars, labels=["error" if "error" in systems[n] else f"{v or 0:.3g}"
                                   for n, v in zip(names, vals)])
        ax.set_title(label, fontsize=10)
    fig.suptitle(f"node {VICTIM} hard-crashed, 4 active nodes + 1 spare"
                 f"{' (--quick)' if quick else ''}")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _say(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def compare(cluster: LocalCluster, work: Path, cfg: Config,
            systems: Sequence[str] = SYSTEMS) -> dict[str, dict]:
    """Every system of `systems` one after another on `cluster`: its record, or {"error": the
    exact message} for a system that is not installed or whose run failed."""
    results: dict[str, dict] = {}
    for system in systems:
        _say(f"[peers] {system}: reference, then node {VICTIM} crashed at step {cfg.kill_at}")
        try:
            results[system] = measure(cluster, system, work, cfg)
        except Exception as exc:  # noqa: BLE001 - recorded with its exact message
            results[system] = {"error": exc.message if isinstance(exc, HpctError)
                               else f"{type(exc).__name__}: {exc}"}
            with contextlib.suppress(Exception):
                results[system]["version"] = version(system)
            with contextlib.suppress(Exception):
                results[system]["changed_lines"] = script_changes(system)
        _say(f"[peers] {system}: {results[system]}")
    cluster.heal()
    return results


def run(out_dir: Path, quick: bool = False, root: Path = BENCH_ROOT, down: bool = False,
        systems: Sequence[str] = SYSTEMS) -> dict:
    """Run every system of `systems` on the cluster under `root` (brought up if needed, left
    up unless `down`); writes peers.json and peers.png to `out_dir`; returns the summary."""
    cfg = QUICK if quick else FULL
    out_dir = Path(out_dir)
    t_start = time.monotonic()
    work = fresh_work_dir(root, "bench-peers")
    cluster = ready_cluster(root, NODES, who="bench peers")
    try:
        with contextlib.redirect_stdout(sys.stderr):
            results = compare(cluster, work, cfg, systems)
    finally:
        if down:
            cluster.down()
    return write(out_dir, results, cfg, quick, work, time.monotonic() - t_start)


def write(out_dir: Path, results: dict[str, dict], cfg: Config, quick: bool, work: Path,
          wall_s: float) -> dict:
    """peers.json and peers.png under `out_dir`; the summary (the command's last line)."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    png = out_dir / f"{NAME}.png"
    _plot(png, results, quick)
    path = write_result(out_dir, NAME, {
        "systems": results, "quick": quick, "config": asdict(cfg),
        "given": configuration(cfg), "world": ACTIVE, "victim": VICTIM,
        "work_dir": str(work), "wall_s": round(wall_s, 1),
        "method": __doc__, "when": datetime.datetime.now(datetime.timezone.utc).isoformat()})
    return {"bench": NAME, "systems": results, "json": str(path), "png": str(png)}
