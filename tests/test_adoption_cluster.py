"""The adopted torchrun DDP script of docs/adoption.md (hpct_slurm/examples/adopted_ddp.py),
exactly as shipped, on the real local cluster through a node crash: every rank's final
parameters are bit-identical to the same script's run without a fault (issue 18)."""
from __future__ import annotations

import sys

import pytest

from hpct_slurm.localcluster.jobs import (TEMPLATE, VICTIM, collect, controller_events,
                                          recomputed_steps, step_events, submit, wait_job)

pytestmark = pytest.mark.cluster
EPOCHS, STEPS_PER_EPOCH = 5, 8          # 512 samples / (4 ranks x batch 16)
ADOPTED = [sys.executable, "-m", "hpct_slurm.examples.adopted_ddp", "--epochs", str(EPOCHS),
           "--step-sleep", "0.1"]


def _params(run_dir) -> dict[int, str]:
    return {r: res["params_sha256"] for r, res in collect(run_dir, 4).items()}


@pytest.fixture(scope="module")
def reference(_session_cluster, tmp_path_factory):
    _session_cluster.heal()
    d = tmp_path_factory.mktemp("adopted-reference")
    wait_job(_session_cluster, submit(_session_cluster, d, TEMPLATE, ADOPTED), d, 240,
             label="adopted-reference")
    return _params(d)


@pytest.mark.parametrize("kill_at", [12, 2 * STEPS_PER_EPOCH - 1])  # mid-epoch; at its end
def test_adopted_ddp_script_survives_a_node_crash_bit_identical(cluster, reference, tmp_path,
                                                                 kill_at):
    jid = submit(cluster, tmp_path, TEMPLATE, ADOPTED)
    assert wait_job(cluster, jid, tmp_path, 240, kill_at=kill_at, label="adopted-crash")
    assert _params(tmp_path) == reference
    assert len(set(reference.values())) == 1  # data parallel: one model on every rank
    # every step of every epoch completed, none twice: the loop position came back with the
    # model (shared state), so nothing was recomputed for it
    assert {e["step"] for e in step_events(tmp_path)} == set(range(EPOCHS * STEPS_PER_EPOCH))
    assert recomputed_steps(tmp_path) == 0
    done = [e for e in controller_events(tmp_path) if e["event"] == "recovery.done"]
    assert len(done) == 1 and done[0]["taken"] == {VICTIM: "n5"}
