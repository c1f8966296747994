"""The node lifecycle (issue 17) on the real local cluster: an admin drains an active node and
its ranks move to the spare (no fault, nothing lost, bit-identical); a job that shrank grows
back to its full size; and the job's own Slurm record says what happened."""
from __future__ import annotations

import os
import signal
import sys
import time

import pytest

from hpct_slurm.localcluster.jobs import (TEMPLATE, UNPACED, bitwise_equal, collect,
                                          controller_events,
                                          crash_at, rank_events, rolled_back_steps, submit,
                                          wait_job, wait_step)

pytestmark = pytest.mark.cluster


def train(steps: int, *extra: str) -> list[str]:
    # long enough for Slurm's node poll (every 5 s) to see the drain while training runs
    return [sys.executable, "-m", "hpct_slurm.examples.train", "--steps", str(steps),
            "--step-sleep", "0.1", *extra]


def events(run_dir, name: str) -> list[dict]:
    return [e for e in controller_events(run_dir) if e["event"] == name]


def wait_event(run_dir, name: str, timeout: float = 60, count: int = 1) -> list[dict]:
    deadline = time.monotonic() + timeout
    while len(found := events(run_dir, name)) < count:
        assert time.monotonic() < deadline, f"no {name} within {timeout:.0f} s"
        time.sleep(0.2)
    return found


_references: dict[tuple, dict] = {}


def reference(cluster, tmp_path, args: list[str], world: int, **submit_kw) -> dict:
    """What an uninterrupted run of `args` at `world` ranks ends with (one run per session
    for the same arguments)."""
    key = (tuple(args), world, repr(sorted(submit_kw.items())))
    if key not in _references:
        ref = tmp_path / "reference"
        wait_job(cluster, submit(cluster, ref, TEMPLATE, [*args, *UNPACED], **submit_kw), ref,
                 240, label="reference")
        _references[key] = collect(ref, world)
    return _references[key]


def test_a_fault_then_a_drain_moves_the_ranks_bit_identical_and_slurm_records_both(cluster,
                                                                                 tmp_path):
    args = train(150, "--position")
    ref = reference(cluster, tmp_path, args, 4)
    run = tmp_path / "drain"
    jid = submit(cluster, run, TEMPLATE, args)
    # a fault first: n2's training process dies (its node lives: Slurm keeps it in the job),
    # the spare n5 takes its place and n2 comes back as a warm spare
    wait_step(run, 8)
    [reg] = [e for e in events(run, "rank.register") if e["node"] == "n2"]
    os.kill(reg["pid"], signal.SIGKILL)
    [fault_done] = wait_event(run, "recovery.done")
    wait_event(run, "rank.register", count=6)  # 5 nodes, and n2 again as a spare
    # then the admin drains n3: its ranks move to n2
    cluster.client().update_node("n3", "DRAIN", "test: planned maintenance")
    wait_job(cluster, jid, run, 240, label="drain")

    got = collect(run, 4)
    assert bitwise_equal(ref, got, run)
    assert (got[1]["node"], got[2]["node"]) == ("n5", "n2")
    [done] = events(run, "move.done")
    assert done["taken"] == {"n3": "n2"} and done["lost_steps"] == 0
    # n3 left alive and served its own position to n2 (not only its ring holder's copy)
    [n3] = [e["transfer"] for e in events(run, "rank.register") if e["node"] == "n3"]
    assert [e for e in rank_events(run) if e["event"] == "transfer.fetched"
            and e["rank"] == 2 and e["step"] == done["restore_step"] and e["source"] == n3]
    # nothing recomputed since the fault's own round (at most the one step a killed rank
    # leaves without a copy of its data position)
    assert all(s <= fault_done["restore_step"] + 1 for s in rolled_back_steps(run))
    # the kill only (seen as the lost connection and as the step's exit): the move raised none
    [moving] = events(run, "move.requested")
    faults = events(run, "fault.detected")
    assert {e["node"] for e in faults} == {"n2"} and all(e["t"] < moving["t"] for e in faults)
    node = cluster.client().show_node("n3")
    assert "DRAIN" in node.flags
    assert node.reason == f"test: planned maintenance; hpct: job {jid} moved its ranks to n2"
    # the record in Slurm, without our tools
    comment = cluster.client().show_job(jid).comment
    assert comment is not None and comment.startswith("hpct: 1 fault(s), 1 move(s), ")
    # lost steps: the fault's (0, or the one step above) plus the move's (0), as the events say
    lost = fault_done["lost_steps"] + done["lost_steps"]
    assert lost <= 1
    assert "replaced n2>n5 n3>n2" in comment and f"lost steps {lost}" in comment


def test_shrink_then_grow_back_to_the_full_world(cluster, tmp_path):
    # HPCT_SPARE_WAIT_S=0: no wait for n4 to come back (it would take its own place back,
    # test_spare_arrivals.py): the round shrinks at once, and n4's return grows the job back
    jid = submit(cluster, tmp_path, TEMPLATE, train(200, "--micro"),
                 env={"HPCT_ON_NO_SPARE": "shrink", "HPCT_SPARE_WAIT_S": "0"})
    crash_at(cluster, tmp_path, 8, 120, node="n3")  # the spare n5 takes its place
    deadline = time.monotonic() + 60
    while not events(tmp_path, "recovery.done"):
        assert time.monotonic() < deadline, "no recovery.done after the first crash"
        time.sleep(0.2)
    # n4's training process dies, its node lives: no spare is ready, so the job shrinks; the
    # node comes back as a warm spare a moment later and the job grows back onto it
    [reg] = [e for e in events(tmp_path, "rank.register") if e["node"] == "n4"]
    os.kill(reg["pid"], signal.SIGKILL)
    wait_job(cluster, jid, tmp_path, 300, label="shrink-grow")

    [shrunk] = events(tmp_path, "recovery.shrink")
    assert shrunk["lost"] == ["n4"] and len(shrunk["members"]) == 3
    [grown] = events(tmp_path, "grow.done")
    assert grown["lost_steps"] == 0
    [ga] = events(tmp_path, "grow.assign")
    assert sorted(ga["members"]) == ["n1", "n2", "n4", "n5"]
    [jd] = events(tmp_path, "job.done")
    got = collect(tmp_path, 4)  # every rank of the full world finished
    assert len({r["params_sha256"] for r in got.values()}) == 1
    # The summary went out; Slurm 22.05 without accounting storage refuses any update of a
    # job that lost a node ("the DB index is being set", measured): the Comment itself is
    # checked by the test above, whose fault leaves every node in the job.
    said = [e.get("comment") or e.get("error") for e in controller_events(tmp_path)
            if e["event"] in ("slurm.comment", "slurm.error")]
    assert any("2 fault(s), 0 move(s), 1 grow(s), replaced n3>n5" in (t or "") for t in said)


def _at_once(run_dir, name: str, timeout: float = 120) -> dict:
    """The first `name` event, polled every 5 ms: a kill that follows lands within moments."""
    deadline = time.monotonic() + timeout
    while not (found := events(run_dir, name)):
        assert time.monotonic() < deadline, f"no {name} within {timeout:.0f} s"
        time.sleep(0.005)
    return found[0]


def _step_exit(run_dir, node: str) -> dict:
    return [e for e in events(run_dir, "step.exit") if e["node"] == node][0]


def test_a_leaving_node_killed_right_after_the_moves_assignment_is_fenced(cluster, tmp_path):
    """Issue 45: n3 drained, its ranks move to n5, and n3 crashes right after the move's
    assignment. It was never noticed (no longer a member, not a spare): its srun ran on and
    the job's end waited out the 15 s step grace for it. Now its loss is seen and fenced."""
    args = train(150, "--position")
    ref = reference(cluster, tmp_path, args, 4)
    run = tmp_path / "leaving"
    jid = submit(cluster, run, TEMPLATE, args)
    wait_step(run, 8)
    cluster.client().update_node("n3", "DRAIN", "test: planned maintenance")
    _at_once(run, "move.assign")
    cluster.kill_node("n3")
    lost = wait_event(run, "move.leaving_lost")[0]
    wait_job(cluster, jid, run, 240, label="leaving-lost")

    assert bitwise_equal(ref, collect(run, 4), run)
    assert lost["node"] == "n3"
    fenced = [e for e in events(run, "fault.fenced") if e["node"] == "n3"]
    assert fenced and fenced[0]["how"] == "node down"
    assert events(run, "fault.detected") == []  # n5 had n3's place already: no round
    assert not [e for e in controller_events(run) if e["event"].startswith("escalate.")]
    # its srun ended when Slurm had the node down, not at the job's end
    assert _step_exit(run, "n3")["t"] < events(run, "job.done")[0]["t"]


def test_a_fault_during_a_planned_move_releases_the_leaving_ranks(cluster, tmp_path):
    """Issue 45: 3 active nodes and 2 spares; n3 drained, its ranks move to n4, and n2 dies
    before the move's first step. The move is folded into n2's round; n3's ranks sat idle until
    the job ended. They now leave once that round is done."""
    args = train(150, "--position")
    env = {"HPCT_ACTIVE_NODES": "3", "HPCT_SPARE_NODES": "2"}
    ref = reference(cluster, tmp_path, args, 3, nodes=3, env={**env, "HPCT_SPARE_NODES": "0"})
    run = tmp_path / "fold"
    jid = submit(cluster, run, TEMPLATE, args, nodes=5, env=env)
    wait_step(run, 8)
    cluster.client().update_node("n3", "DRAIN", "test: planned maintenance")
    assign = _at_once(run, "move.assign")
    cluster.kill_node("n2")
    wait_job(cluster, jid, run, 240, label="move-fold")

    assert bitwise_equal(ref, collect(run, 3), run)
    assert assign["taken"] == {"n3": "n4"}
    [done] = events(run, "recovery.done")
    assert set(done["lost"]) == {"n2", "n3"} and done["taken"] == {"n3": "n4", "n2": "n5"}
    left = [e for e in rank_events(run, "n3") if e["event"] == "rank.exit"]
    assert left and "moved to n4" in left[0]["reason"], left
    # released when the round was done, not by the job's end
    assert _step_exit(run, "n3")["t"] < events(run, "job.done")[0]["t"]
