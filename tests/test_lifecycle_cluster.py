"""The node lifecycle (issue 17) on the real local cluster: an admin drains an active node and
its ranks move to the spare (no fault, nothing lost, bit-identical); a job that shrank grows
back to its full size; and the job's own Slurm record says what happened."""
from __future__ import annotations

import os
import signal
import sys
import time

import pytest

from hpct_slurm.localcluster.jobs import (TEMPLATE, bitwise_equal, collect, controller_events,
                                          crash_at, recomputed_steps, submit, wait_job,
                                          wait_step)

pytestmark = pytest.mark.cluster


def train(steps: int, *extra: str) -> list[str]:
    # long enough for Slurm's node poll (every 5 s) to see the drain while training runs
    return [sys.executable, "-m", "hpct_slurm.examples.train", "--steps", str(steps),
            "--step-sleep", "0.1", *extra]


def events(run_dir, name: str) -> list[dict]:
    return [e for e in controller_events(run_dir) if e["event"] == name]


def test_draining_an_active_node_moves_its_ranks_to_the_spare_bit_identical(cluster, tmp_path):
    args = train(100, "--position")
    ref = tmp_path / "reference"
    wait_job(cluster, submit(cluster, ref, TEMPLATE, args), ref, 240, label="reference")
    run = tmp_path / "drain"
    jid = submit(cluster, run, TEMPLATE, args)
    wait_step(run, 10)
    cluster.client().update_node("n3", "DRAIN", "test: planned maintenance")
    wait_job(cluster, jid, run, 240, label="drain")

    got = collect(run, 4)
    assert bitwise_equal(collect(ref, 4), got, run)
    assert got[2]["node"] == "n5"  # the spare holds the drained node's rank
    [done] = events(run, "move.done")
    assert done["taken"] == {"n3": "n5"} and done["lost_steps"] == 0
    assert recomputed_steps(run) == 0
    assert events(run, "fault.detected") == [] and events(run, "recovery.done") == []
    node = cluster.client().show_node("n3")
    assert "DRAIN" in node.flags
    assert node.reason == f"test: planned maintenance; hpct: job {jid} moved its ranks to n5"
    # the record in Slurm, without our tools
    comment = cluster.client().show_job(jid).comment
    assert comment is not None and "1 move(s)" in comment and "replaced n3>n5" in comment
    assert "lost steps 0" in comment


def test_shrink_then_grow_back_to_the_full_world(cluster, tmp_path):
    jid = submit(cluster, tmp_path, TEMPLATE, train(200, "--micro"),
                 env={"HPCT_ON_NO_SPARE": "shrink"})
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
    comment = cluster.client().show_job(jid).comment
    assert comment is not None and "2 fault(s)" in comment and "1 grow(s)" in comment
