"""Script shapes people write (hpct_slurm/examples/zoo.py), adopted as docs/adoption.md says,
on the real local cluster: a BatchNorm CNN, a BatchNorm MLP with a hand-written Lion optimizer
and an EMA that averages buffers, a compiled causal LM with tied weights and a warm-up
schedule (the raw model registered, the compiled one in DDP). Each
through a node crash and through an in-place fault raised after the step's forward (its peers
are then in the gradient all-reduce, waiting for it): every registered object's whole state on
every rank (parameters, BatchNorm's running statistics, optimizer moments, the EMA) is the one
of the run without a fault, every step ran once, and no survivor waited out the collective
timeout."""
from __future__ import annotations

import sys

import pytest

from hpct_slurm.localcluster.jobs import (TEMPLATE, UNPACED, VICTIM, collect, controller_events,
                                          rank_events, recomputed_steps, step_events, submit,
                                          wait_job)

pytestmark = pytest.mark.cluster
EPOCHS, STEPS = 4, 32  # 512 samples / (4 ranks x batch 16) = 8 steps an epoch
# Far beyond a recovery: a survivor that waited on a peer gone to recovery would fail with
# gloo's "Timed out" instead of a closed connection
SLOW_TIMEOUT = {"HPCT_COLLECTIVE_TIMEOUT_S": "60"}


def _zoo(shape: str, *args: str) -> list[str]:
    return [sys.executable, "-m", "hpct_slurm.examples.zoo", "--shape", shape,
            "--epochs", str(EPOCHS), *args]


def _states(run_dir) -> dict[int, str]:
    return {r: res["state_sha256"] for r, res in collect(run_dir, 4).items()}


@pytest.mark.parametrize("shape", ["bn_cnn", "ema_lion", "compile_lm"])
def test_a_script_shape_comes_back_bit_identical_from_a_crash_and_an_in_place_fault(
        cluster, tmp_path, shape):
    ref = tmp_path / "reference"
    wait_job(cluster, submit(cluster, ref, TEMPLATE, _zoo(shape, *UNPACED)), ref, 240,
             label=f"{shape}-reference")
    want = _states(ref)
    # data parallel: BatchNorm's statistics too are the same on every rank at a step's end
    assert len(set(want.values())) == 1

    in_place = tmp_path / "in-place"
    wait_job(cluster, submit(cluster, in_place, TEMPLATE,
                             _zoo(shape, "--fail-at", "13", "--fault-rank", "1", *UNPACED),
                             env=SLOW_TIMEOUT), in_place, 240, label=f"{shape}-in-place")
    crash = tmp_path / "crash"
    assert wait_job(cluster, submit(cluster, crash, TEMPLATE, _zoo(shape, "--step-sleep", "0.1"),
                                    env=SLOW_TIMEOUT), crash, 240, kill_at=17,
                    label=f"{shape}-crash")
    for run, taken in ((in_place, {}), (crash, {VICTIM: "n5"})):
        assert _states(run) == want, run.name
        assert {e["step"] for e in step_events(run)} >= set(range(STEPS))
        assert recomputed_steps(run) == 0
        done = [e for e in controller_events(run) if e["event"] == "recovery.done"]
        assert [e["taken"] for e in done] == [taken], run.name
        faults = [e for e in rank_events(run) if e["event"] == "rank.fault"]
        assert faults and not [e for e in faults if "Timed out" in e["error"]], run.name


def test_a_bug_in_the_script_fails_the_job_at_once_and_fences_no_node(cluster, tmp_path):
    """A TypeError in rank 1's step, which any node would raise again: the job fails as the
    script's error in the same generation, with no node fenced, drained or replaced and no
    restart in place, and the nodes go back to Slurm idle for the next job."""
    wait_job(cluster, submit(cluster, tmp_path, TEMPLATE,
                             _zoo("bn_cnn", "--type-error-at", "5", *UNPACED)), tmp_path, 120,
             label="script-bug")
    evs = controller_events(tmp_path)
    [failed] = [e for e in evs if e["event"] == "job.failed"]
    assert failed["cause"] == "script" and "TypeError" in failed["reason"]
    assert [e for e in evs if e["event"] in ("fault.detected", "fault.fenced",
                                             "recovery.assign")] == []
    told = [e for e in rank_events(tmp_path) if e["event"] == "rank.script_error"]
    assert [e["rank"] for e in told] == [1]
    states = cluster.client().node_states()
    assert not [n for n, st in states.items() if "drain" in st or "down" in st], states
