"""Recovery on the real local cluster: the shipped template, the demo model, real faults.

Each run is compared bit for bit with an uninterrupted run of the same job and seed."""
from __future__ import annotations

import os
import signal
import sys
import time

import pytest

from hpct_slurm.localcluster.jobs import (TEMPLATE, UNPACED, VICTIM, back_to_speed, bitwise_equal,
                                          collect, controller_events, rank_events,
                                          recomputed_steps, rolled_back_steps, step_events,
                                          submit, wait_job)
from hpct_slurm.recovery.snapshot_policy import LAZY_FULL_EVERY

pytestmark = pytest.mark.cluster
STEPS = 40
TRAIN = [sys.executable, "-m", "hpct_slurm.examples.train", "--steps", str(STEPS),
         "--step-sleep", "0.1"]


@pytest.fixture(scope="module")
def reference(_session_cluster, tmp_path_factory):
    _session_cluster.heal()
    d = tmp_path_factory.mktemp("reference")
    jid = submit(_session_cluster, d, TEMPLATE, [*TRAIN, "--position", *UNPACED])
    wait_job(_session_cluster, jid, d, 240, label="reference")
    return collect(d, 4)


def _no_survivor_waited_out_the_collective_timeout(run_dir) -> None:
    """Every survivor left the failed collective through the STOP or its peers' teardown,
    none through gloo's collective timeout (10 s, "Application timeout caused pair closure"):
    a rank that gave up a step kept its connections open while works it never waited for
    held its gloo context (the carry's all-reduce, recovery/gradients.py), and the survivor
    waiting on it sat out the timeout (seen in the relay test in 2 of 3 runs before the fix,
    and in CI's node-crash and drain tests: not deterministic, so this can pass on the old
    code)."""
    timed_out = [e for e in rank_events(run_dir) if e["event"] == "rank.fault"
                 and "Application timeout" in e.get("error", "")]
    assert not timed_out, timed_out


def test_node_crash_warm_spare_takes_over_bit_identical(cluster, reference, tmp_path):
    jid = submit(cluster, tmp_path, TEMPLATE, [*TRAIN, "--position"])
    t_kill = wait_job(cluster, jid, tmp_path, 240, kill_at=12, label="node-crash")
    assert t_kill is not None
    got = collect(tmp_path, 4)
    assert bitwise_equal(reference, got, tmp_path)
    # at most the one step the lost rank finished but never committed (its data position for
    # that step existed only in its memory); usually none
    assert len(rolled_back_steps(tmp_path)) <= 1
    assert got[2]["node"] == "n5"  # the spare holds the crashed node's rank
    done = [e for e in controller_events(tmp_path) if e["event"] == "recovery.done"]
    assert len(done) == 1 and done[0]["taken"] == {VICTIM: "n5"}
    _, k_last = back_to_speed(tmp_path, t_kill)
    assert k_last - done[0]["restore_step"] <= 1
    node = cluster.client().show_node(VICTIM)
    assert node.state == "DOWN" and node.reason.startswith("hpct:")
    # just-in-time mode: the big shared state came from a survivor, rank 2's own data
    # position from n1, its ring holder half the ring away (not n3's neighbour n4, which
    # may share its failure domain), which holds a few KB a step of it, not the model
    assert got[2]["consumed"] == reference[2]["consumed"] is not None
    n1 = cluster.client().show_node("n1").addr
    fetched = [e for e in rank_events(tmp_path, "n5") if e["event"] == "transfer.fetched"]
    assert any(e["rank"] == 2 and e["source"].split(":")[0] == n1 for e in fetched)
    stored = [e for e in rank_events(tmp_path, "n1") if e["event"] == "replica.stored"]
    assert stored and max(e["nbytes"] for e in stored) < 64 * 1024
    _no_survivor_waited_out_the_collective_timeout(tmp_path)


def test_rank_process_kill_recovers_in_process(cluster, reference, tmp_path):
    jid = submit(cluster, tmp_path, TEMPLATE, TRAIN)
    deadline = time.monotonic() + 120
    while max((e["step"] for e in step_events(tmp_path)), default=-1) < 12:
        assert time.monotonic() < deadline, "training never reached step 12"
        time.sleep(0.1)
    reg = [e for e in controller_events(tmp_path)
           if e["event"] == "rank.register" and e["node"] == "n2"]
    os.kill(reg[0]["pid"], signal.SIGKILL)  # only the rank process: the node stays up
    wait_job(cluster, jid, tmp_path, 240, label="rank-kill")
    assert bitwise_equal(reference, collect(tmp_path, 4), tmp_path)
    assert recomputed_steps(tmp_path) == 0
    evs = controller_events(tmp_path)
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
    got = collect(tmp_path, 4)
    assert bitwise_equal(reference, got, tmp_path)  # every loss recorded equals the reference's
    assert recomputed_steps(tmp_path) == 0
    # the spare that took rank 2 over read back the losses of the steps n3 trained: its
    # job.losses covers the run (but a step n3 finished and died before logging)
    assert len(got[2]["losses"]) >= len(reference[2]["losses"]) - 1
    done = [e for e in controller_events(tmp_path) if e["event"] == "recovery.done"]
    assert len(done) == 1
    # without the SPANK plugin (this cluster has none) ranks run with the controller's
    # settings: the same as with it (tests/test_spank_cluster.py)
    from hpct_slurm.controller.controller import Options
    settings = [e["settings"] for n in ("n1", "n2", "n3", "n4", "n5")
                for e in rank_events(tmp_path, n) if e["event"] == "rank.registered"]
    assert len(settings) == 5 and all(
        s == {"collective_timeout_s": Options.collective_timeout_s,
              "init_timeout_s": Options.init_timeout_s, "store": "rootless"}
        for s in settings), settings


def test_replicated_mode_restores_from_the_ring_neighbour(cluster, reference, tmp_path):
    """Forced replicated mode: every commit goes to the ring holder half the ring away (n3's
    ranks to n1); after n3 crashes, the spare pulls exactly rank 2's state (model, optimizer,
    data position) from n1's replica, not from disk and not from another rank's copy."""
    jid = submit(cluster, tmp_path, TEMPLATE, [*TRAIN, "--position"],
                 env={"HPCT_RECOVERY_MODE": "replicated"})
    wait_job(cluster, jid, tmp_path, 240, kill_at=12, label="replicated")
    got = collect(tmp_path, 4)
    assert bitwise_equal(reference, got, tmp_path)  # data positions included
    assert got[2]["consumed"] == reference[2]["consumed"] is not None
    assert len(rolled_back_steps(tmp_path)) <= 1  # see the node-crash test
    registered = [e for e in rank_events(tmp_path, "n5") if e["event"] == "rank.registered"]
    assert registered and registered[0]["mode"] == "replicated"
    adopted = [e for e in rank_events(tmp_path, "n5")
               if e["event"] == "rank.adopted" and e["restore_step"] >= 0]
    n1 = cluster.client().show_node("n1").addr
    assert len(adopted) == 1 and adopted[0]["source"].split(":")[0] == n1
    stored = [e for e in rank_events(tmp_path, "n1") if e["event"] == "replica.stored"]
    assert {e["rank"] for e in stored} == {2}  # n1 holds n3's rank, nobody else's



def test_a_rotten_source_is_caught_by_its_checksum_and_the_next_one_used(cluster, reference,
                                                                         tmp_path):
    """Rank 0's memory rots (a byte flipped after its digest was sealed, in each stripe it
    serves) while the spare pulls from every survivor at once: the spare's per-stripe check
    catches it, drops rank 0 and takes its stripes from the other survivors."""
    jid = submit(cluster, tmp_path, TEMPLATE, TRAIN, env={"HPCT_FAULT_CORRUPT_SERVE": "0"})
    wait_job(cluster, jid, tmp_path, 240, kill_at=12, label="rotten-source")
    assert bitwise_equal(reference, collect(tmp_path, 4), tmp_path)
    assert recomputed_steps(tmp_path) == 0
    n1 = cluster.client().show_node("n1").addr
    spare = rank_events(tmp_path, "n5")
    dropped = [e for e in spare if e["event"] == "transfer.source_dropped"]
    assert [e["source"].split(":")[0] for e in dropped] == [n1]
    assert "digest" in dropped[0]["error"]
    [striped] = [e for e in spare if e["event"] == "transfer.striped"]
    # every byte came from the others (this small model is one stripe: one of them)
    assert striped["dropped"] == 1 and striped["sources"]
    assert sum(striped["sources"].values()) == striped["nbytes"]
    assert all(s.split(":")[0] != n1 for s in striped["sources"])
    assert any(e["event"] == "transfer.fault_injected" for e in rank_events(tmp_path, "n1"))


def test_two_ranks_per_node_go_through_one_relay_and_recover_bit_identical(cluster, tmp_path):
    """Issue 16: with several ranks on a node, the controller speaks to the node's relay (one
    connection per node) instead of to each rank; a node crash loses both of its ranks, the
    spare's two ranks take their places, and the run is bit-identical to one without a fault
    (real srun, real torch, two tasks per node)."""
    tpn = {"HPCT_TASKS_PER_NODE": "2", "HPCT_ACTIVE_NODES": "3"}
    args = [*TRAIN, "--position"]
    ref = tmp_path / "reference"
    jid = submit(cluster, ref, TEMPLATE, [*args, *UNPACED], nodes=3,
                 env={**tpn, "HPCT_SPARE_NODES": "0"})
    wait_job(cluster, jid, ref, 240, label="relay-reference")
    run = tmp_path / "run"
    jid = submit(cluster, run, TEMPLATE, args, nodes=5, env={**tpn, "HPCT_SPARE_NODES": "2"})
    assert wait_job(cluster, jid, run, 240, kill_at=12, label="relay-crash") is not None
    got = collect(run, 6)
    assert bitwise_equal(collect(ref, 6), got, run)
    evs = controller_events(run)
    # every node, spares included, registered one relay, and every rank came through one
    relays = [e["node"] for e in evs if e["event"] == "relay.register"]
    assert sorted(relays) == sorted(set(relays)) and set(relays) >= {"n1", "n2", "n3", "n4"}
    assert {e["node"] for e in evs if e["event"] == "rank.register"} <= set(relays)
    [done] = [e for e in evs if e["event"] == "recovery.done"]
    assert done["taken"] == {VICTIM: "n4"}
    # From memory: the newest step or the one before. The lost ranks' positions reach their
    # holders in each step's gradient all-reduce (carry.py), so the window in which a crash
    # left them a step behind the lazily held shared state is closed; a crash inside a step's
    # optimizer update restores the last full commit (every LAZY_FULL_EVERY steps), every position at it
    # pinned in memory: never the disk, never a wrong state.
    assert not [e for e in evs if e["event"] == "recovery.disk_fallback"]
    assert done["lost_steps"] <= 1 or done["restore_step"] % LAZY_FULL_EVERY == 0, done
    assert (got[4]["node"], got[5]["node"]) == ("n4", "n4")
    _no_survivor_waited_out_the_collective_timeout(run)
