"""What proving a restore costs (issue 42, item 8): a restore of the whole registered state
(the model and Adam's two moments of the recovery benchmark's MLP) into a survivor's own
objects, with and without the per-object digests the proof records, and the proof itself
(the live objects hashed the same way at the first step boundary after the restore), side by
side in one process, rounds alternating, median of each. The proof adds `digest` + `proof`
to a recovery's critical path, once per restore.

Beside it, the replicas' cross-check (recovery/crosscheck.py): the digest a rank makes of its
shared state at every full commit, against one training step of the same model (batch 64,
one thread), the share of a step it costs spread over the LAZY_FULL_EVERY steps between full
commits (its 16-byte all-gather is not in it: one small collective per interval).

Sizes: the demo's MLP (256 wide, 1 layer), the recovery benchmark's (2048 wide, 3 layers:
101.5 MB) and a larger one (2048 wide, 9 layers), each as parameters plus Adam's state.
"""
from __future__ import annotations

import statistics
import time
from pathlib import Path

from .common import plot_bars, write_result

NAME = "proof"
SIZES = {"demo": (256, 1), "recovery_100mb": (2048, 3), "larger": (2048, 9)}


def _measure(hidden: int, layers: int, rounds: int) -> dict:
    import torch

    from ..examples.train import build
    from ..recovery.state import TrainState

    torch.set_num_threads(1)
    model, opt = build(hidden, layers)
    model(torch.randn(8, 32)).sum().backward()
    opt.step()  # Adam's moments exist: the state a restore really moves
    state = TrainState(model=model, optimizer=opt)
    layout, buf = state.capture_into(None, ("shared",))
    from ..recovery.crosscheck import shared_digest
    from ..recovery.snapshot_policy import LAZY_FULL_EVERY

    plain, digest, proof, cross, step = [], [], [], [], []
    for rnd in range(rounds + 1):  # round 0 warms up
        for with_proof in ((False, True) if rnd % 2 else (True, False)):
            t0 = time.perf_counter()
            state.restore_from(layout, buf, scopes=("shared",), proof=with_proof)
            t1 = time.perf_counter()
            if with_proof:
                problems = state.prove()
                t2 = time.perf_counter()
                if problems:
                    raise RuntimeError(f"the benchmark's own restore did not prove: {problems}")
                if rnd:
                    digest.append(t1 - t0)
                    proof.append(t2 - t1)
            elif rnd:
                plain.append(t1 - t0)
        t0 = time.perf_counter()
        shared_digest(state)
        t1 = time.perf_counter()
        x = torch.randn(64, 32)
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(x), x[:, :1]).backward()
        opt.step()
        t2 = time.perf_counter()
        if rnd:
            cross.append(t1 - t0)
            step.append(t2 - t1)
    med = {k: statistics.median(v) for k, v in
           (("restore_s", plain), ("restore_with_digest_s", digest), ("proof_s", proof),
            ("crosscheck_digest_s", cross), ("step_s", step))}
    added = med["restore_with_digest_s"] - med["restore_s"] + med["proof_s"]
    return {"state_mb": round(layout.nbytes / 1e6, 1),
            **{k: round(v, 5) for k, v in med.items()},
            "added_s": round(added, 5), "added_over_restore": round(added / med["restore_s"], 2),
            "crosscheck_pct_of_step": round(
                100 * med["crosscheck_digest_s"] / (LAZY_FULL_EVERY * med["step_s"]), 3)}


def run(out_dir: Path, quick: bool = False, smoke: bool = False) -> dict:
    sizes = {"demo": SIZES["demo"]} if smoke else (
        {k: SIZES[k] for k in ("demo", "recovery_100mb")} if quick else SIZES)
    rounds = 1 if smoke else 3 if quick else 7
    per_size = {name: _measure(h, n, rounds) for name, (h, n) in sizes.items()}
    summary = {"bench": NAME, "per_size": per_size,
               "added_s": {k: v["added_s"] for k, v in per_size.items()},
               "crosscheck_pct_of_step": {k: v["crosscheck_pct_of_step"]
                                          for k, v in per_size.items()}}
    write_result(out_dir, NAME, {**summary, "quick": quick, "smoke": smoke, "rounds": rounds,
                                 "method": __doc__})
    labels, values = [], []
    for name, v in per_size.items():
        size = f"{v['state_mb']:g} MB"
        labels += [f"{size}\nrestore", f"{size}\nproven"]
        values += [v["restore_s"], v["restore_s"] + v["added_s"]]
    plot_bars(Path(out_dir) / f"{NAME}.png", labels, values, "seconds (median)",
              "A restore, and the same restore proven")
    return summary
