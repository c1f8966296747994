"""Recovery on the real local cluster: the shipped template, the demo model, real faults.

Each run is compared bit for bit with an uninterrupted run of the same job and seed."""
from __future__ import annotations

import os
import signal
import sys
import time

import pytest

from hpct_slurm.demo import (TEMPLATE, VICTIM, back_to_speed, bitwise_equal, collect,
                             step_events, submit, wait_job)
from hpct_slurm.events import read_events

pytestmark = pytest.mark.cluster
STEPS = 40
TRAIN = [sys.executable, "-m", "hpct_slurm.examples.train", "--steps", str(STEPS),
         "--step-sleep", "0.1"]


def _controller_events(run_dir):
    return list(read_events(run_dir / "controller.jsonl"))


@pytest.fixture(scope="module")
def reference(_session_cluster, tmp_path_factory):
    _session_cluster.heal()
    d = tmp_path_factory.mktemp("reference")
    jid = submit(_session_cluster, d, TEMPLATE, TRAIN)
    wait_job(_session_cluster, jid, d, 240, label="reference")
    return collect(d, 4)


def test_node_crash_warm_spare_takes_over_bit_identical(cluster, reference, tmp_path):
    jid = submit(cluster, tmp_path, TEMPLATE, TRAIN)
    t_kill = wait_job(cluster, jid, tmp_path, 240, kill_at=12, label="node-crash")
    assert t_kill is not None
    got = collect(tmp_path, 4)
    assert bitwise_equal(reference, got)
    assert got[2]["node"] == "n5"  # the spare holds the crashed node's rank
    done = [e for e in _controller_events(tmp_path) if e["event"] == "recovery.done"]
    assert len(done) == 1 and done[0]["taken"] == {VICTIM: "n5"}
    _, k_last = back_to_speed(tmp_path, t_kill)
    assert k_last - done[0]["restore_step"] <= 0  # nothing recomputed
    node = cluster.client().show_node(VICTIM)
    assert node.state == "DOWN" and node.reason.startswith("hpct:")


def test_rank_process_kill_recovers_in_process(cluster, reference, tmp_path):
    jid = submit(cluster, tmp_path, TEMPLATE, TRAIN)
    deadline = time.monotonic() + 120
    while max((e["step"] for e in step_events(tmp_path)), default=-1) < 12:
        assert time.monotonic() < deadline, "training never reached step 12"
        time.sleep(0.1)
    reg = [e for e in _controller_events(tmp_path)
           if e["event"] == "rank.register" and e["node"] == "n2"]
    os.kill(reg[0]["pid"], signal.SIGKILL)  # only the rank process: the node stays up
    wait_job(cluster, jid, tmp_path, 240, label="rank-kill")
    assert bitwise_equal(reference, collect(tmp_path, 4))
    evs = _controller_events(tmp_path)
    fenced = [e for e in evs if e["event"] == "fault.fenced"]
    assert fenced[0]["node"] == "n2" and fenced[0]["how"] == "step cancelled"
    assert cluster.client().show_node("n2").state != "DOWN"  # a live node is not drained
    # the healthy node came back as a warm spare
    assert any(e["event"] == "step.launch" and e["node"] == "n2" and e["role"] == "spare"
               for e in evs)


def test_plain_ddp_module_recovers_bit_identical(cluster, reference, tmp_path):
    """The same job through torch's DistributedDataParallel (job.ddp, re-created per
    generation with a per-parameter comm hook): identical to the reference, fault and all."""
    jid = submit(cluster, tmp_path, TEMPLATE, [*TRAIN, "--ddp"])
    wait_job(cluster, jid, tmp_path, 240, kill_at=12, label="ddp-node-crash")
    assert bitwise_equal(reference, collect(tmp_path, 4))
    done = [e for e in read_events(tmp_path / "controller.jsonl")
            if e["event"] == "recovery.done"]
    assert len(done) == 1
