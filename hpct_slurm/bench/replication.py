"""Steady-state cost of recoverability, as % of step time (~100 MB of model + Adam state).

An MLP with Adam trains in this process, its gradients reduced every step as `Job` reduces
them (`average_gradients` over a one-rank gloo group, in every variant); a child process
plays the ring peer (a `TransferServer` holding replicas). Blocks of steps alternate between
the variants in one run, so all see the same machine; overheads are relative to `off` (no
snapshots):

- `jit_lazy_rank_persist`: the documented adoption as `Job` runs it under the controller's
  defaults, the headline `overhead_pct`: a sampler registered (per-rank state), the shared
  state held lazily (as in `jit_lazy`), the rank's own small state (the sampler position; not
  the RNG states, which `Job` reseeds before every step) carried to its ring holder in the
  step's gradient all-reduce (carry.py), and the controller's default disk persistence
  (every HPCT_PERSIST_EVERY = 500 of its steps: a full commit, its file written by one rank,
  every rank's own file; background threads, whose files a block waits for). This process is
  its own holder here: it pays for its slot, the extra all-reduce, and taking a held rank's
  slot into its replicas.
- `jit_lazy_rank_persist10`: the same persisting every 10 steps (the default before: what a
  persisted file costs, side by side).
- `jit_lazy_rank`: the same without the disk persistence: what its memory path costs.
- `jit_lazy_rank_pushed`: that memory path as `Job` did it before carrying: the rank's state
  committed and pushed to the ring peer after every step, its acknowledgement awaited at the
  next step's end (`ReplicaPusher.push_next`).
- `jit_lazy`: what `Job` does for data parallelism without per-rank state: a full
  commit every LAZY_FULL_EVERY (64) of its own steps, and every step in between held where it
  lies and copied only if a fault comes before the next optimizer step (`prepare_lazy`).
  Every lazy variant's full commits (and persisted steps) run the replicas' cross-check as
  `Job` does (crosscheck.py: the shared state's digest and its all-gather).
- `jit_k1_sync`: what `Job` does on CPU with per-rank state registered and no disk
  persistence (HPCT_PERSIST_EVERY=0): a full commit (a copy; the digest is left to its first
  reader) after every step, before the step returns.
- `jit_k1`: the same copy overlapping the next step's forward and backward (the next optimizer
  step waits for it only if it is not done): `Job`'s default where the state is on a GPU.
- `jit_k1_sealed`: the same with `background_seal=True` (each commit hashed right away).
- `jit_kK`: the same as `jit_k1_sync`, committing every K steps (`HPCT_SNAPSHOT_EVERY=K`).
- `replicated_k1` / `replicated_kK`: commit + push to the peer every 1 / K steps (sharded setups).

Each block pays for what it started: pushes are flushed, files written and, with background
sealing, the last commit's seal awaited before the clock stops. `min_k_for_3pct` is the
smallest commit interval whose measured per-commit cost fits in 3%. `overhead_pct_by_mode`:
every variant's median per-block overhead against the `off` block of the same round (>= 5
rounds outside --smoke; a lazy variant's blocks are whole cycles of LAZY_FULL_EVERY steps, a
persisting one's at least one interval long), the lowest and highest next to it.
`disk_write_mb_s`: this machine's rate of writing one full-state file as the persistence
writes it, measured in the same run: the persistence's cost follows it.

The headline is measured apart, in pairs: after the rounds, `pairs` (25 per round) pairs of
adjacent 16-step blocks, `off` and the documented adoption, alternately first (its full commit
lands in one of its blocks in four, every 64 of its steps: its share of the totals). On this
project's 2-core VM a step's time wanders by +-10 % over seconds; a round's blocks are
seconds apart (`off`, then ten other variants, then the headline), and the headline's median
over the rounds moved by several % from one run to the next. Within a pair the drift is
nearly the same on both sides. `overhead_pct` is the ratio of the pairs' totals (every cost,
the persisted files included: they land in their share of the pairs), `overhead_ci95` its 95 %
interval by resampling the pairs; `overhead_paired_median_pct` the median pair (the typical
step) and its interval. `step_phases_ms`: both sides' mean time a step in each phase, timed
in the same pairs (forward and backward, gradient reduction, update, what the step's end
adds), and `added_ms_by_phase` what the documented adoption adds to each: where the headline's
cost lies (the carry's all-reduce and the holder's taking of slots fall in the reduction).

Sharded jobs (FSDP2 on 4 ranks, HSDP on 2 x 2, FSDP2 + TP and HSDP + TP) run in 4 processes:
see replication_sharded.py; their default-mode overheads are `overhead_pct_<layout>`.
"""
from __future__ import annotations

import math
import multiprocessing as mp
import random
import secrets
import shutil
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from .. import config as C
from . import replication_sharded
from .common import plot_bars, write_result

JOB = "bench"
BUDGET_PCT = 3.0
# the settings table's default (HPCT_PERSIST_EVERY): the templates' jobs
PERSIST_EVERY: int = C.BY_NAME[C.PERSIST_EVERY].default  # type: ignore[assignment]
PERSIST_BEFORE = 10  # the default until 2026-11-26
# a step's phases, timed in the headline's pairs (run: `phase_s`)
PHASES = ("compute", "reduce", "update", "step_end")


class _Position:
    """A sampler's position: the per-rank state of the documented adoption."""

    def __init__(self) -> None:
        self.consumed = 0

    def state_dict(self) -> dict:
        return {"consumed": self.consumed}

    def load_state_dict(self, sd: dict) -> None:
        self.consumed = int(sd["consumed"])


def _peer(conn: Any, secret: bytes) -> None:
    from ..recovery.replicas import ReplicaStore
    from ..recovery.transfer import TransferServer
    with TransferServer(secret, JOB, 1, replicas=ReplicaStore()) as srv:
        conn.send(srv.address)
        conn.recv()


def run(out_dir: Path, quick: bool = False, smoke: bool = False,
        reps: int | None = None) -> dict:
    """`smoke`: the smallest run that goes through every variant (a few MB, one round), to
    check the command works; its numbers mean nothing. `reps`: rounds of the variants' blocks
    (default 5): more make the medians steadier on a machine that is not quiet."""
    import torch
    import torch.distributed as dist

    from ..events import EventLog
    from ..recovery.carry import Carry, CarryRecord
    from ..recovery.crosscheck import compare, exchange, shared_digest
    from ..recovery.gradients import average_gradients, parameter_gradients
    from ..recovery.persist import DiskPersister
    from ..recovery.replicas import ReplicaStore
    from ..recovery.slots import Snapshot
    from ..recovery.snapshot import SnapshotStore
    from ..recovery.snapshot_policy import LAZY_FULL_EVERY
    from ..recovery.state import TrainState
    from ..recovery.transfer import ReplicaPusher

    width, depth = (256, 2) if smoke else (1024, 2) if quick else (1440, 4)
    k, rounds = (4, 1) if smoke else (8, 5) if quick else (16, 5)
    rounds = reps or rounds
    # one commit per block at every=K, so every block of such a variant does the same work; a
    # lazy variant's full commits fall on its own steps (one block in LAZY_FULL_EVERY / K: its
    # share in the pairs' totals), and its blocks in the rounds are whole lazy cycles
    block = k
    torch.manual_seed(0)
    layers: list[torch.nn.Module] = []
    for _ in range(depth):
        layers += [torch.nn.Linear(width, width), torch.nn.ReLU()]
    model = torch.nn.Sequential(*layers)
    opt = torch.optim.Adam(model.parameters(), lr=1e-4)
    state = TrainState(model=model, optimizer=opt)
    x = torch.randn(64, width)
    # (store, push?) per variant; jit keeps the shared scope only, as `Job` does.
    stores = {"jit_lazy": (SnapshotStore(state, ("shared",), every=LAZY_FULL_EVERY), False),
              "jit_lazy_rank": (SnapshotStore(state, ("shared",), every=LAZY_FULL_EVERY),
                                False),
              "jit_lazy_rank_pushed": (SnapshotStore(state, ("shared",),
                                                     every=LAZY_FULL_EVERY), False),
              "jit_lazy_rank_persist": (SnapshotStore(state, ("shared",),
                                                      every=LAZY_FULL_EVERY), False),
              "jit_lazy_rank_persist10": (SnapshotStore(state, ("shared",),
                                                        every=LAZY_FULL_EVERY), False),
              "jit_k1": (SnapshotStore(state, ("shared",), every=1), False),
              "jit_k1_sync": (SnapshotStore(state, ("shared",), every=1), False),
              "jit_k1_sealed": (SnapshotStore(state, ("shared",), every=1, background_seal=True),
                                False),
              f"jit_k{k}": (SnapshotStore(state, ("shared",), every=k), False),
              "replicated_k1": (SnapshotStore(state, every=1), True),
              f"replicated_k{k}": (SnapshotStore(state, every=k), True)}
    variants = ["off", *stores]
    # the documented adoption as Job runs it under the controller: a sampler registered
    # (per-rank state), its defaults (disk persistence every 10 steps)
    default = "jit_lazy_rank_persist"
    # Per-rank state: a sampler position, its own snapshot every step, over Job's one
    # TrainState (the model and optimizer registered beside it), without the RNG states Job
    # reseeds (snapshot_policy.RESEEDED); carried in the gradient all-reduce, or (`_pushed`)
    # pushed to the ring peer, each push's acknowledgement awaited at the next step's end.
    position = _Position()
    rank_state = TrainState(model=model, optimizer=opt, sampler=position)
    # persisting variant -> its interval; smoke: short enough for its one short block
    persisting = {"jit_lazy_rank_persist": 4 if smoke else 100 if quick else PERSIST_EVERY,
                  "jit_lazy_rank_persist10": PERSIST_BEFORE}
    rank_stores = {v: SnapshotStore(rank_state, ("rank",), every=1, rng=False)
                   for v in ("jit_lazy_rank", "jit_lazy_rank_pushed", *persisting)}
    carried = ("jit_lazy_rank", *persisting)
    # Job's gradient all-reduce, in every variant: over a group of one rank here, which is
    # also its own ring holder (it takes its own slot into its replicas)
    store_file = tempfile.NamedTemporaryFile(prefix="hpct-bench-pg-", delete=False)
    store_file.close()
    dist.init_process_group("gloo", init_method=f"file://{store_file.name}", rank=0,
                            world_size=1)
    carry = Carry(rank_state, 0, 1, [0], ReplicaStore(), EventLog(), lambda: step,
                  CarryRecord(), secret=secrets.token_bytes(32))
    reduce_with: dict[str, Carry | None] = {"carry": None}

    overlapped = {"store": None}

    def hold_copy(*_: Any) -> None:  # Job's optimizer pre-hook
        if overlapped["store"] is not None:
            overlapped["store"].before_optimizer_step()

    opt.register_step_pre_hook(hold_copy)

    # Where a step's time goes, phase by phase, in the headline's pairs (`phases`: the
    # variant whose steps are being timed, else None): the forward and backward, the gradient
    # reduction (with the carry's all-reduce and the holder's taking of slots in the
    # documented adoption), the update (with its pre-hook), and what the step's end adds
    # (the rank's commit, the lazy hold or the full commit, the persistence's start).
    phases: dict[str, Any] = {"variant": None}
    phase_s = {v: {k: [] for k in PHASES} for v in ("off", default)}

    def train_step() -> None:
        t0 = time.perf_counter()
        opt.zero_grad()
        model(x).pow(2).mean().backward()
        t1 = time.perf_counter()
        average_gradients(parameter_gradients(model), 1, reduce_with["carry"])
        t2 = time.perf_counter()
        opt.step()
        if phases["variant"] is not None:
            got = phase_s[phases["variant"]]
            got["compute"].append(t1 - t0)
            got["reduce"].append(t2 - t1)
            got["update"].append(time.perf_counter() - t2)

    def settle(snap: Snapshot | None) -> None:
        while snap is not None and not snap.sealed and not snap.superseded.is_set():
            time.sleep(0.001)

    secret = secrets.token_bytes(32)
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=_peer, args=(child, secret), daemon=True)
    proc.start()
    times: dict[str, list[float]] = {v: [] for v in variants}
    # the headline's pairs: (seconds of an `off` block, of the adjacent default block)
    paired: list[tuple[float, float]] = []
    pairs = 2 if smoke else 8 * rounds if quick else 25 * rounds
    commit_s: list[float] = []
    step = 0
    try:
        peer = tuple(parent.recv())
        pushers = {v: ReplicaPusher(store, 0, peer, secret, JOB)
                   for v, (store, push) in stores.items() if push}
        rank_pushers = {v: ReplicaPusher(rs, 0, peer, secret, JOB)
                        for v, rs in rank_stores.items()}
        # the template's disk persistence (the shared state's file written by one rank per
        # key, every rank's own file), on background threads as in Job
        disk = out_dir / "replication-persist"
        # (every=1: a block hands them only its persist steps, its own every `persist`)
        persisters = {v: (DiskPersister(stores[v][0], disk / v / "persist", 0, 1, key=secret),
                          DiskPersister(rank_stores[v], disk / v / "persist-rank", 0, 1,
                                        key=secret))
                      for v in persisting}
        train_step()
        for v, (store, _) in stores.items():  # warm-up: both slots and the peer's buffers
            for _ in range(2):
                step += 1
                store.commit(step)
                if v in pushers:
                    pushers[v].after_commit(step)
                    pushers[v].flush()
        vsteps = {v: 0 for v in variants}  # each variant's own steps: its persistence's clock

        def run_block(variant: str, steps: int, record_commit: bool = False) -> float:
            """`steps` steps of `variant`; the seconds they took, the work they started
            (pushes, seals, files being written) done before the clock stops."""
            nonlocal step
            store, push = stores.get(variant, (None, False))
            last = None
            overlap = variant == "jit_k1"
            lazy = variant.startswith("jit_lazy")
            rank_store = rank_stores.get(variant)
            persist = persisting.get(variant, 0)
            overlapped["store"] = store if overlap or lazy else None
            reduce_with["carry"] = carry if variant in carried else None
            t_block = time.perf_counter()
            for _ in range(steps):
                step += 1  # the step in progress (Job.step), what the carry labels
                vsteps[variant] += 1
                position.consumed += 64  # the step's batch drawn
                train_step()
                t_end = time.perf_counter()
                # a persist step: every `persist` of this variant's steps, a full commit,
                # its file written by one rank, every rank's own file (as Job, whose
                # persisters save at multiples of HPCT_PERSIST_EVERY)
                persist_now = bool(persist) and vsteps[variant] % persist == 0
                if rank_store is not None:  # SnapshotPolicy._commit_rank_state
                    if variant in carried:
                        held = carry.commit(step, rank_store)[1]
                    else:
                        rank_store.commit(step)
                        held = "push"
                    if persist_now:
                        persisters[variant][1].after_commit(step)
                    if held != "carried":
                        rank_pushers[variant].push_next(step)
                # a lazy variant's full commits fall on its own steps (the global step counts
                # every variant's blocks, whose turns would place them unevenly)
                due = store is not None and store.due(vsteps[variant] if lazy else step)
                if lazy and (due or persist_now):
                    # the replicas' cross-check at a full commit, as Job runs it (crosscheck.py)
                    compare(exchange(shared_digest(state), 1), lambda r: 0)
                if persist_now:
                    store.commit(step)  # type: ignore[union-attr]
                    persisters[variant][0].after_commit(step)
                elif lazy and not due:
                    store.prepare_lazy(step)  # type: ignore[union-attr]
                elif due:
                    t0 = time.perf_counter()
                    if overlap:
                        store.commit_async(step)
                    else:
                        last = store.commit(step)
                    if record_commit and variant == "jit_k1_sync":
                        commit_s.append(time.perf_counter() - t0)
                    if push:
                        pushers[variant].after_commit(step)
                if phases["variant"] is not None:
                    phase_s[phases["variant"]]["step_end"].append(time.perf_counter() - t_end)
            if (overlap or lazy) and store is not None:
                store.wait()
                store.drop_pending()
            if push:
                pushers[variant].flush()
            if rank_store is not None:
                rank_pushers[variant].flush()  # the last step's push, acknowledged
            if persist:
                for persister in persisters[variant]:
                    persister.flush()  # its files on disk
            if store is not None and store.background_seal:
                settle(last)
            return time.perf_counter() - t_block

        for rnd in range(rounds + 1):  # round 0 is warm-up, not recorded
            # a rotating order: no variant always follows the same one (whose leftover work,
            # e.g. the peer still storing a push, would land on it)
            for variant in variants[rnd % len(variants):] + variants[:rnd % len(variants)]:
                time.sleep(0.05)  # let the previous block's background work drain
                persist = persisting.get(variant, 0)
                # a lazy block: whole lazy cycles; a persisting one at least `persist` steps
                # too (any run of them holds one multiple of `persist`: its share of the files,
                # on average)
                steps = (block if smoke or not variant.startswith("jit_lazy") else
                         LAZY_FULL_EVERY * max(1, math.ceil(persist / LAZY_FULL_EVERY)))
                took = run_block(variant, steps, record_commit=bool(rnd))
                if rnd:
                    times[variant].append(took / steps)
        # The headline, side by side: adjacent blocks of `off` and the documented adoption,
        # alternately first, each pair seconds apart, so the machine's drift (this VM's steps
        # wander by +-10 % over seconds) falls on both sides of a pair. Its persistence runs
        # at its cadence in its own steps, so the pairs hold their share of its files.
        persisted_before = vsteps[default] // persisting[default]
        for i in range(pairs):
            got = {}
            for variant in (("off", default) if i % 2 == 0 else (default, "off")):
                time.sleep(0.05)
                phases["variant"] = variant
                got[variant] = run_block(variant, block)
                phases["variant"] = None
            paired.append((got["off"], got[default]))
        persisted_in_pairs = vsteps[default] // persisting[default] - persisted_before
        carried_steps = carry.record.verified
        disk_mb_s = _disk_write_rate(stores["jit_k1"][0], out_dir, secret)
        acked = {v: p.acked_step for v, p in pushers.items()}
        for p in [*pushers.values(), *rank_pushers.values()]:
            p.close()
        for pair in persisters.values():
            for persister in pair:
                persister.close()
        parent.send("stop")
    finally:
        dist.destroy_process_group()
        Path(store_file.name).unlink(missing_ok=True)  # gloo's FileStore may have removed it
        proc.join(30)
        if proc.is_alive():
            proc.kill()
    step_s = {v: statistics.median(t) for v, t in times.items()}
    per_block = {v: [(a / b - 1) * 100 for a, b in zip(times[v], times["off"])]
                 for v in variants}
    pct = {v: round(statistics.median(per_block[v]), 1) for v in variants}
    headline = paired_overhead(paired)
    phase_ms = {v: {k: round(statistics.mean(t) * 1e3, 3) for k, t in got.items()}
                for v, got in phase_s.items()}
    spread = {v: [round(min(per_block[v]), 1), round(max(per_block[v]), 1)] for v in variants}
    commit_ms = statistics.median(commit_s) * 1e3
    nbytes = stores["jit_k1"][0].latest().layout.nbytes  # type: ignore[union-attr]
    # `cycles`: a lazy block is a whole cycle of LAZY_FULL_EVERY steps (not in the smoke run)
    sharded_cfg = ({"width": 256, "depth": 2, "batch": 8, "block": 2, "rounds": 1, "cycles": 0}
                   if smoke else
                   {"width": 512, "depth": 4, "batch": 16, "block": 16, "rounds": 5, "cycles": 1}
                   if quick else
                   {"width": 1664, "depth": 3, "batch": 16, "block": 16, "rounds": 5, "cycles": 1})
    sharded = replication_sharded.measure(tuple(replication_sharded.MESHES), sharded_cfg)
    summary = {"bench": "replication", "overhead_pct": headline["mean_pct"],
               "overhead_ci95": headline["mean_ci95"],
               "overhead_paired_median_pct": headline["median_pct"],
               "overhead_paired_median_ci95": headline["median_ci95"],
               "overhead_spread": headline["spread"], "pairs": len(paired),
               "persisted_in_pairs": persisted_in_pairs, "default_mode": default,
               **{f"overhead_{kind}_{par}": res[f"overhead_{kind}_{res['default_variant']}"]
                  for par, res in sharded.items() for kind in ("pct", "spread")},
               "overhead_pct_by_mode": pct,
               "min_k_for_3pct": max(1, math.ceil(commit_ms / (BUDGET_PCT / 100 * step_s["off"] * 1e3))),
               "commit_ms": round(commit_ms, 2),
               "step_ms": {v: round(s * 1e3, 2) for v, s in step_s.items()},
               "state_mb": round(nbytes / 1e6, 1), "disk_write_mb_s": round(disk_mb_s),
               "persist_every": persisting[default],
               # per step, in the headline's pairs: each phase's mean (ms), and what the
               # documented adoption adds to each (the full commits and files included, in
               # their share of the steps)
               "step_phases_ms": phase_ms,
               "added_ms_by_phase": {k: round(phase_ms[default][k] - phase_ms["off"][k], 3)
                                     for k in PHASES}}
    write_result(out_dir, "replication", {**summary, "quick": quick, "smoke": smoke, "k": k,
                                          "overhead_spread_by_mode": spread,
                                          "sharded": sharded, "sharded_config": sharded_cfg,
                                          "block_steps": block,
                                          "rounds": rounds, "last_acked_step": acked,
                                          "carried_steps_verified": carried_steps,
                                          "per_block_step_s": times,
                                          "paired_block_s": paired})
    # the headline's bar is its paired figure (the rounds' median of it is in the JSON)
    labels = [f"ddp {v}" + (" (paired)" if v == default else "") for v in variants if v != "off"]
    values = [headline["mean_pct"] if v == default else pct[v] for v in variants if v != "off"]
    for par, res in sharded.items():
        # lazy holds need another holder of each shard: not a recovery mode of 1-D FSDP
        for v in ("overlap", "sync") if res["ring_push"] else ("lazy", "overlap", "sync"):
            labels.append(f"{par} {v}")
            values.append(res[f"overhead_pct_{v}"])
    plot_bars(Path(out_dir) / "replication.png", labels, values, "% over no recovery state",
              f"Cost of recovery state per step\n(ddp: {nbytes / 1e6:.0f} MB, one process; "
              f"fsdp/hsdp: {sharded['fsdp']['state_mb_total']:.0f} MB model+AdamW, 4 ranks)")
    return summary


def paired_overhead(paired: list[tuple[float, float]], resamples: int = 2000) -> dict:
    """The overhead of the B side of (A seconds, B seconds) pairs of adjacent blocks, in %:
    `mean_pct`, the ratio of the totals (every cost counted, the rare ones too: a persisted
    file lands in one pair in dozens), and `median_pct`, the median pair's ratio (the
    typical step, unmoved by a rare cost or a rare stall), each with a 95 % interval from
    resampling the pairs (a fixed seed: the same pairs give the same interval), and
    `spread`, the lowest and highest pair's ratio."""
    if not paired:
        raise ValueError("no pairs measured")
    ratios = [(b / a - 1) * 100 for a, b in paired]

    def mean(sample: list[tuple[float, float]]) -> float:
        return (sum(b for _, b in sample) / sum(a for a, _ in sample) - 1) * 100

    rng = random.Random(0)
    means, medians = [], []
    for _ in range(resamples):
        idx = [rng.randrange(len(paired)) for _ in paired]
        means.append(mean([paired[i] for i in idx]))
        medians.append(statistics.median(ratios[i] for i in idx))
    means.sort()
    medians.sort()
    lo, hi = int(0.025 * resamples), int(0.975 * resamples) - 1

    def r(x: float) -> float:
        return round(x, 1)

    return {"mean_pct": r(mean(paired)), "mean_ci95": [r(means[lo]), r(means[hi])],
            "median_pct": r(statistics.median(ratios)),
            "median_ci95": [r(medians[lo]), r(medians[hi])],
            "spread": [r(min(ratios)), r(max(ratios))]}


def _disk_write_rate(store: Any, out_dir: Path, key: bytes) -> float:
    """MB/s of writing one full snapshot to disk the way the persistence does (its own
    `write_snapshot`: past the page cache, fsynced, renamed): what its cost follows on this
    machine. The digest is the snapshot's, sealed before the clock starts."""
    from ..recovery.persist import write_snapshot
    snap = store.latest()
    digest = snap.digest()
    root = Path(out_dir) / "replication-disk-rate"
    t0 = time.perf_counter()
    write_snapshot(root, 0, snap.step, snap.layout, snap.data, digest, key=key)
    rate = snap.layout.nbytes / 1e6 / (time.perf_counter() - t0)
    shutil.rmtree(root, ignore_errors=True)
    return rate
