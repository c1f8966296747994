"""The pure part of `bench failslow`: the job's step times, the phases before / during / after,
steps to detection, the move's pause and goodput, read from a small synthetic event list; and
the command registered. The benchmark itself runs on the cluster (`hpct-slurm bench failslow`)."""
from __future__ import annotations

import inspect
import subprocess
import sys
from pathlib import Path

import pytest

from hpct_slurm.bench import failslow as F
from hpct_slurm.bench.cli import BENCHMARKS, CLUSTER_BENCHMARKS
from hpct_slurm.errors import HpctError

HPCT_SLURM = str(Path(sys.executable).with_name("hpct-slurm"))
T0, FAST, SLOW, PAUSE = 100.0, 0.2, 0.4, 0.5
SLOW_FROM, DETECT, MOVE, STEPS = 10, 35, 40, 60


def _run(moved: bool, step_field: bool = True, slow_node: str = "n2") -> tuple[list, list]:
    """4 ranks, 60 steps of FAST s; SLOW s from step 10 (n2 slowed). `moved`: node.slow once
    step 35 is done, the move STOPs after step 40 (nothing lost), its first step after takes
    PAUSE more, then FAST again. Rank r finishes each step r ms after rank 0."""
    ranks, ctl, t = [], [], T0
    for k in range(STEPS):
        slowed = SLOW_FROM <= k and not (moved and k > MOVE)
        t += SLOW if slowed else FAST
        if moved and k == MOVE + 1:
            t += PAUSE
        ranks += [{"event": "rank.step", "rank": r, "generation": int(moved and k > MOVE),
                   "step": k, "t": t + 0.001 * r} for r in range(4)]
        if moved and k == DETECT:
            said = {"event": "node.slow", "t": t + 0.01, "node": slow_node, "ratio": 2.0,
                    "node_s": 0.4, "job_s": 0.2, "window": 20, "action": "move"}
            if step_field:
                said["step"] = DETECT
            ctl += [said, {"event": "move.requested", "t": t + 0.011, "node": slow_node}]
        if moved and k == MOVE:
            ctl.append({"event": "move.assign", "t": t + 0.05, "generation": 1,
                        "restore_step": MOVE, "newest_done": MOVE, "taken": {"n2": "n5"}})
        if moved and k == MOVE + 1:
            ctl.append({"event": "move.done", "t": t + 0.004, "recovery_s": PAUSE + 0.1,
                        "lost_steps": 0})
    return ctl, ranks


def test_job_step_ends_are_the_last_rank_and_step_times_the_differences():
    _, ranks = _run(moved=False)
    ends = F.job_step_ends(ranks)
    assert ends[0] == pytest.approx(T0 + FAST + 0.003)
    times = F.step_times(ends)
    assert 0 not in times  # no step before it
    assert times[5] == pytest.approx(FAST) and times[SLOW_FROM] == pytest.approx(SLOW)


def test_a_detected_and_moved_run_phases_detection_pause_and_goodput():
    ctl, ranks = _run(moved=True)
    a = F.analyse_run(ctl, ranks, SLOW_FROM, ref_step_s=FAST)
    assert a["detected"] and a["moved"] and not a["escalated"]
    assert a["detect_step"] == DETECT and a["steps_to_detection"] == DETECT - SLOW_FROM
    assert (a["ratio"], a["window"], a["action"]) == (2.0, 20, "move")
    assert a["move_pause_s"] == pytest.approx(PAUSE + 0.1) and a["lost_steps"] == 0
    assert a["move_step"] == MOVE and a["move_done_step"] == MOVE + 1
    assert a["move_step_s"] == pytest.approx(FAST + PAUSE)  # the step that holds the move
    # the first step after the move (it holds the pause) is in no phase
    assert a["step_s"] == pytest.approx({"before": FAST, "during": SLOW, "after": FAST})
    assert a["false_detections"] == 0 and a["node_slow_events"] == 1
    # steps 1..59 at FAST, except 10..40 at SLOW, plus the pause: against 59 x FAST
    wall = 59 * FAST + (MOVE - SLOW_FROM + 1) * (SLOW - FAST) + PAUSE
    assert a["train_wall_s"] == pytest.approx(wall)
    assert a["goodput"] == pytest.approx(59 * FAST / wall)
    assert a["steps"] == STEPS


def test_an_undetected_run_is_slow_to_the_end_and_says_so():
    """1.1x below the ratio, or detection off: no node.slow, no move, no steps to detection;
    'during' runs to the last step and there is no 'after'."""
    ctl, ranks = _run(moved=False)
    a = F.analyse_run(ctl, ranks, SLOW_FROM, ref_step_s=FAST)
    assert not a["detected"] and not a["moved"]
    assert "steps_to_detection" not in a and "move_pause_s" not in a
    assert a["step_s"] == pytest.approx({"before": FAST, "during": SLOW, "after": None})
    wall = 59 * FAST + (STEPS - SLOW_FROM) * (SLOW - FAST)
    assert a["goodput"] == pytest.approx(59 * FAST / wall)


def test_detection_step_from_the_clock_when_the_event_carries_none():
    ctl, ranks = _run(moved=True, step_field=False)
    assert F.analyse_run(ctl, ranks, SLOW_FROM, FAST)["detect_step"] == DETECT


def test_a_node_slow_naming_another_node_or_any_in_the_reference_is_false():
    ctl, ranks = _run(moved=True, slow_node="n4")
    a = F.analyse_run(ctl, ranks, SLOW_FROM, FAST)
    assert a["false_detections"] == 1 and not a["detected"] and not a["moved"]
    ctl, ranks = _run(moved=True)
    ref = F.analyse_run(ctl, ranks, None, None)  # as if it came in a run with no slowdown
    assert ref["false_detections"] == 1 and ref["goodput"] is None
    assert ref["steps_to_detection"] is None
    assert ref["step_s"]["during"] is None


def test_a_failed_move_or_escalation_is_flagged():
    ctl, ranks = _run(moved=True)
    ctl.append({"event": "move.failed", "t": T0 + 50, "error": "x"})
    assert F.analyse_run(ctl, ranks, SLOW_FROM, FAST)["escalated"]


def test_a_run_with_no_step_is_an_error():
    with pytest.raises(HpctError, match="no step"):
        F.analyse_run([], [], SLOW_FROM, FAST)


def test_side_by_side_reads_on_against_off():
    on = F.analyse_run(*_run(moved=True), SLOW_FROM, FAST)
    off = F.analyse_run(*_run(moved=False), SLOW_FROM, FAST)
    on["bit_identical"] = off["bit_identical"] = True
    row = F.side_by_side(2.0, on, off)
    assert row["goodput_on_over_off"] == pytest.approx(on["goodput"] / off["goodput"], abs=1e-4)
    assert row["goodput_on_over_off"] > 1  # moved out: the job got its pace back
    assert row["on_after_over_before"] == pytest.approx(1.0)
    assert row["off_during_over_before"] == pytest.approx(SLOW / FAST)
    assert row["steps_to_detection"] == DETECT - SLOW_FROM and row["bit_identical"]
    assert row["move_step_s"] == pytest.approx(FAST + PAUSE)
    # a failed run (its record is an error) leaves its side empty, never a crash
    failed = F.side_by_side(1.25, {"error": "boom"}, off)
    assert failed["goodput_on"] is None and failed["goodput_on_over_off"] is None
    assert not failed["bit_identical"]


def test_the_command_is_registered_as_a_cluster_benchmark():
    assert "failslow" in BENCHMARKS and "failslow" in CLUSTER_BENCHMARKS
    assert {"out_dir", "quick", "root", "down"} <= set(inspect.signature(F.run).parameters)
    proc = subprocess.run([HPCT_SLURM, "bench", "--help"], capture_output=True, text=True,
                          timeout=60)
    assert proc.returncode == 0 and "failslow" in proc.stdout


def test_the_meters_cost_per_step_is_measured():
    from hpct_slurm.bench.failslow import meter_cost_us
    cost = meter_cost_us(2000)
    assert 0.0 < cost < 1000.0  # microseconds per step: a clock read or three and a median
