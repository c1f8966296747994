"""The adopted torchrun DDP scripts of docs/adoption.md, exactly as shipped, on the real local
cluster through a node crash: every rank's final parameters are bit-identical to a run without
a fault (issue 18). The inline form (hpct_slurm/examples/adopted_inline.py: the loop stays in
main(), which runs again after the fault; issue 31) and the loop-function form
(adopted_ddp.py) train the same model on the same data in the same order, so both must end
on the parameters of the loop-function form's run without a fault."""
from __future__ import annotations

import sys

import pytest

from hpct_slurm.localcluster.jobs import (TEMPLATE, UNPACED, VICTIM, collect, controller_events,
                                          rank_events, recomputed_steps, step_events, submit,
                                          wait_job)

pytestmark = pytest.mark.cluster
EPOCHS, STEPS_PER_EPOCH = 5, 8          # 512 samples / (4 ranks x batch 16)


def _script(name: str) -> list[str]:
    return [sys.executable, "-m", f"hpct_slurm.examples.{name}", "--epochs", str(EPOCHS),
            "--step-sleep", "0.1"]


ADOPTED = _script("adopted_ddp")


def _params(run_dir) -> dict[int, str]:
    return {r: res["params_sha256"] for r, res in collect(run_dir, 4).items()}


@pytest.fixture(scope="module")
def reference(_session_cluster, tmp_path_factory):
    _session_cluster.heal()
    d = tmp_path_factory.mktemp("adopted-reference")
    wait_job(_session_cluster, submit(_session_cluster, d, TEMPLATE, [*ADOPTED, *UNPACED]), d, 240,
             label="adopted-reference")
    return _params(d)


@pytest.mark.parametrize("script, kill_at", [
    ("adopted_inline", 0),                       # in step 0: main() again, state at creation
    ("adopted_ddp", 2 * STEPS_PER_EPOCH - 1),    # an epoch's last step
])
def test_adopted_ddp_script_survives_a_node_crash_bit_identical(cluster, reference, tmp_path,
                                                                 script, kill_at):
    jid = submit(cluster, tmp_path, TEMPLATE, _script(script))
    assert wait_job(cluster, jid, tmp_path, 240, kill_at=kill_at, label="adopted-crash")
    assert _params(tmp_path) == reference
    assert len(set(reference.values())) == 1  # data parallel: one model on every rank
    # every step of every epoch completed, none twice: the loop position came back with the
    # model (shared state), so nothing was recomputed for it
    assert {e["step"] for e in step_events(tmp_path)} == set(range(EPOCHS * STEPS_PER_EPOCH))
    assert recomputed_steps(tmp_path) == 0
    done = [e for e in controller_events(tmp_path) if e["event"] == "recovery.done"]
    assert len(done) == 1 and done[0]["taken"] == {VICTIM: "n5"}
    if script == "adopted_inline":  # the three survivors ran main() again, in place
        again = [e for e in rank_events(tmp_path) if e["event"] == "rank.main_again"]
        assert sorted(e["rank"] for e in again) == [0, 1, 3]


def _sharded(parallel: str) -> list[str]:
    return [sys.executable, "-m", "hpct_slurm.examples.adopted_fsdp", "--parallel", parallel,
            "--epochs", str(EPOCHS), "--step-sleep", "0.1"]


@pytest.mark.parametrize("parallel, kill_at", [("fsdp", 9), ("hsdp", 2 * STEPS_PER_EPOCH)])
def test_adopted_inline_fsdp_script_survives_a_node_crash_bit_identical(cluster, tmp_path,
                                                                        parallel, kill_at):
    """FSDP2 (each rank holds its own shard: a ring copy restores the lost one) and HSDP (a
    replica holds it), the loop inline: the whole model gathered at the end (a collective
    after the loop, with the group still formed) is the one of the run without a fault."""
    ref = tmp_path / "reference"
    wait_job(cluster, submit(cluster, ref, TEMPLATE, [*_sharded(parallel), *UNPACED]), ref, 240,
             label=f"{parallel}-reference")
    crash = tmp_path / "crash"
    assert wait_job(cluster, submit(cluster, crash, TEMPLATE, _sharded(parallel)), crash, 240,
                    kill_at=kill_at, label=f"{parallel}-crash")
    want = _params(ref)
    assert _params(crash) == want and len(set(want.values())) == 1  # the whole model, gathered
    assert {e["step"] for e in step_events(crash)} == set(range(EPOCHS * STEPS_PER_EPOCH))
    if parallel == "hsdp":  # a replica held the lost rank's step; nothing recomputed
        assert recomputed_steps(crash) == 0
    # FSDP: the lost rank's newest steps may still have been on their way to its ring holder
    # (pushed after each commit, off the step): the group then restores the step the holder
    # has, and the steps after it are recomputed (counted, and still bit-identical)
    done = [e for e in controller_events(crash) if e["event"] == "recovery.done"]
    assert len(done) == 1 and done[0]["taken"] == {VICTIM: "n5"}
    # one round: the survivors' main() made its mesh's sub-groups under the names the fresh
    # replacement used (an extra mesh made by Job once cost a collective timeout and a round)
    assert done[0]["generation"] == 1
    assert len([e for e in rank_events(crash) if e["event"] == "rank.main_again"]) == 3
