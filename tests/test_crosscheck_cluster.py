"""Replicas check each other, on the real cluster (issue 42, item 8): one bit of one rank's
parameter flips between two steps (HPCT_FAULT_FLIP_RANK/STEP: silent data corruption, nothing
else happens). At the next full commit the replicas' digests disagree: the group rolls back
to the last commit they agreed on, recomputes the steps since (counted), the diverging node
is moved onto the warm spare and drained with the reason, and the run ends bit-identical to
one without the flip. A flip after the last full commit is found by the last comparison,
before the job ends; with no spare left the node is drained at once and trains on."""
from __future__ import annotations

import sys

import pytest

from hpct_slurm.localcluster.jobs import (TEMPLATE, UNPACED, bitwise_equal, collect,
                                          controller_events, rank_events, recomputed_steps,
                                          submit, wait_job)

pytestmark = pytest.mark.cluster
STEPS, EVERY, FLIP_AT, WORLD = 64, 16, 20, 4   # full commits at 0, 16, 32, 48
LAST_COMMIT = (STEPS - 1) // EVERY * EVERY
ENV = {"HPCT_SNAPSHOT_EVERY": str(EVERY)}
NO_SPARE = {"HPCT_SPARE_NODES": "0"}


def _train() -> list[str]:
    return [sys.executable, "-m", "hpct_slurm.examples.train", "--steps", str(STEPS),
            "--step-sleep", "0.1"]


def _flip(at: int) -> dict[str, str]:
    return {**ENV, "HPCT_FAULT_FLIP_RANK": "1", "HPCT_FAULT_FLIP_STEP": str(at)}


@pytest.fixture(scope="module")
def reference(_session_cluster, tmp_path_factory) -> dict[int, dict]:
    """The run without a flip, which every flipped run must end equal to."""
    _session_cluster.heal()
    ref = tmp_path_factory.mktemp("crosscheck") / "reference"
    wait_job(_session_cluster, submit(_session_cluster, ref, TEMPLATE, [*_train(), *UNPACED],
                                      env=ENV), ref, 240, label="crosscheck-reference")
    return collect(ref, WORLD)


def _diverged(run) -> list[dict]:
    return [e for e in rank_events(run) if e["event"] == "replica.diverged"]


def _node_of_rank_1(run) -> str:
    [node] = {f.name.split("-")[0] for f in (run / "events").glob("*.jsonl")
              if any(e["event"] == "replica.diverged" and e.get("this_rank")
                     for e in rank_events(run, f.name.split("-")[0]))}
    return node


def test_a_flipped_bit_is_found_at_the_next_full_commit_rolled_back_and_moved_out(
        cluster, reference, tmp_path):
    run = tmp_path / "flip"
    jid = submit(cluster, run, TEMPLATE, _train(), env=_flip(FLIP_AT))
    wait_job(cluster, jid, run, 240, label="crosscheck-flip")
    # the final state (and every loss a result keeps) is the uninterrupted run's
    assert bitwise_equal(reference, collect(run, WORLD))
    diverged = _diverged(run)
    detected = EVERY * (FLIP_AT // EVERY + 1)  # the first full commit after the flip
    assert {(e["rank"], e["this_rank"]) for e in diverged} == {(0, False), (1, True)}
    assert all(e["step"] == detected and e["diverged"] == [1] and e["rollback_to"] ==
               detected - EVERY for e in diverged)
    ctl = controller_events(run)
    # the rollback is the first round's: the in-place round every rank's report starts, or,
    # where the controller read the rank's move request before that round began (its Slurm
    # poll against the 0.5 s grace, seen once in CI), the move itself, which then restores
    # the agreed step as it moves the node out (one round instead of two)
    rounds = [e for e in ctl if e["event"] in ("recovery.assign", "move.assign")]
    assert rounds and rounds[0]["restore_step"] == detected - EVERY
    assert [e["restore_step"] for e in rounds if e["event"] == "recovery.assign"] in \
        ([detected - EVERY], [])
    # the steps after the last agreeing commit, recomputed on every rank and counted
    assert recomputed_steps(run) == WORLD * (EVERY - 1)
    moves = [e for e in ctl if e["event"] == "move.done"]
    victim = next(e["node"] for e in ctl if e["event"] == "move.requested")
    assert moves and moves[0]["taken"] == {victim: "n5"}
    info = cluster.client().show_node(victim)
    assert "DRAIN" in info.flags and "silent data corruption" in (info.reason or "")
    assert not [e for e in rank_events(run) if e["event"] == "restore.unproven"]


def test_a_bit_flipped_after_the_last_full_commit_is_found_before_the_job_ends(
        cluster, reference, tmp_path):
    """The job's last step is no full commit: the replicas compare once more at the end,
    before any rank reports done, so the flip is rolled back like one found at a commit."""
    late = LAST_COMMIT + 4
    run = tmp_path / "late-flip"
    wait_job(cluster, submit(cluster, run, TEMPLATE, _train(), env=_flip(late)), run, 240,
             label="crosscheck-late-flip")
    assert bitwise_equal(reference, collect(run, WORLD))
    diverged = _diverged(run)
    assert {(e["rank"], e["this_rank"]) for e in diverged} == {(0, False), (1, True)}
    assert all(e["step"] == STEPS - 1 and e["rollback_to"] == LAST_COMMIT for e in diverged)
    assert recomputed_steps(run) == WORLD * (STEPS - 1 - LAST_COMMIT)


def test_a_corrupt_node_with_no_spare_left_is_drained_at_once_and_trains_on(
        cluster, reference, tmp_path):
    run = tmp_path / "flip-no-spare"
    wait_job(cluster, submit(cluster, run, TEMPLATE, _train(), nodes=4,
                             env={**_flip(FLIP_AT), **NO_SPARE}), run, 240,
             label="crosscheck-no-spare")
    # the rollback fixed the state; the node trained on to the end, drained
    assert bitwise_equal(reference, collect(run, WORLD))
    victim = _node_of_rank_1(run)
    ctl = controller_events(run)
    [said] = [e for e in ctl if e["event"] == "node.corrupt"]
    assert said["node"] == victim and "no warm spare" in said["action"]
    info = cluster.client().show_node(victim)
    assert "DRAIN" in info.flags and "silent data corruption" in (info.reason or "")
    # the drain carries the move now: no request is left behind
    assert not list((run / "requests").glob("move-*"))


def test_a_node_whose_kernels_round_otherwise_turns_the_check_off_and_is_not_blamed(
        cluster, tmp_path):
    """n2's torch dispatches its CPU kernels at the baseline level (ATEN_CPU_CAPABILITY=default
    there only): Adam rounds otherwise on it from step 0 on. One rollback tells it from a flip
    (its recompute differs again); then the check is off, the job ends done and nobody is
    moved or drained."""
    python = tmp_path / "python"
    python.write_text(f'#!/bin/sh\n[ "$SLURMD_NODENAME" = n2 ] && export '
                      f'ATEN_CPU_CAPABILITY=default\nexec {sys.executable} "$@"\n')
    python.chmod(0o755)
    run = tmp_path / "aten"
    wait_job(cluster, submit(cluster, run, TEMPLATE, [str(python), *_train()[1:]], env=ENV),
             run, 240, label="crosscheck-aten")
    collect(run, WORLD)  # every rank trained to the end
    ctl = controller_events(run)
    assert [e["event"] for e in ctl if e["event"].startswith("job.")] == ["job.done"]
    [off] = [e for e in rank_events(run) if e["event"] == "replica.check_off"]
    assert off["step"] == 0 and off["diverged"] == [1]
    assert [e["action"] for e in _diverged(run) if e["rank"] == 0] == ["rollback", "off"]
    assert not [e for e in ctl if e["event"] in ("move.requested", "node.corrupt")]
    assert "DRAIN" not in cluster.client().show_node("n2").flags


def test_the_inline_form_compares_its_last_step_before_the_job_ends(cluster, tmp_path):
    """Job.main: the last comparison comes once main() returned; its disagreement rolls back
    as a fault there does, main() runs again from the agreed step and ends bit-identical. The
    job ends moments later, before the controller's next poll: its node is drained at the
    run's end all the same."""
    epochs, per_epoch = 5, 8  # adopted_inline: 512 samples / (4 ranks x batch 16)
    last = epochs * per_epoch - 1
    inline = [sys.executable, "-m", "hpct_slurm.examples.adopted_inline", "--epochs",
              str(epochs), "--step-sleep", "0.1"]
    ref = tmp_path / "reference"
    wait_job(cluster, submit(cluster, ref, TEMPLATE, [*inline, *UNPACED], env=ENV), ref, 240,
             label="crosscheck-inline-reference")
    run = tmp_path / "late-flip"
    late = last // EVERY * EVERY + 3
    wait_job(cluster, submit(cluster, run, TEMPLATE, inline, env=_flip(late)), run, 240,
             label="crosscheck-inline-late-flip")
    assert {r: x["params_sha256"] for r, x in collect(run, WORLD).items()} == \
        {r: x["params_sha256"] for r, x in collect(ref, WORLD).items()}
    diverged = _diverged(run)
    assert diverged and all(e["step"] == last and e["rollback_to"] == last // EVERY * EVERY
                            for e in diverged)
    assert [e for e in rank_events(run) if e["event"] == "rank.main_again"]
    info = cluster.client().show_node(_node_of_rank_1(run))
    assert "DRAIN" in info.flags and "silent data corruption" in (info.reason or "")
    assert not list((run / "requests").glob("move-*"))
