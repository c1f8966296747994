"""Issue 29: the demo's back-to-speed yardstick counts every rank of the group after the crash.

A rank is back once it completed any step after k (the last step reached before the crash), in
the generation that follows the crash; every rank of that generation must be back. Checked on
event logs of both shapes: every rank logs k+1 (the restore is at or before k), and the
replacement restored the state captured at the fault, after k+1, and goes on from k+2 (the
demo's `--parallel hsdp` run printed 0.067 s where the controller's recovery took 0.405 s)."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from hpct_slurm.bench import recovery as R
from hpct_slurm.errors import HpctError
from hpct_slurm.localcluster.jobs import back_to_speed

FIXTURE = Path(__file__).parent / "data" / "report-run"
T_KILL = 100.0
MEMBERS0 = ["n1", "n2", "n3", "n4"]
MEMBERS1 = ["n1", "n2", "n5", "n4"]


def _ev(t: float, event: str, **fields) -> dict:
    return {"t": t, "event": event, **fields}


def _write(run: Path, controller: list[dict], ranks: dict[str, list[dict]]) -> Path:
    (run / "events").mkdir(parents=True)
    (run / "controller.jsonl").write_text("".join(json.dumps(e) + "\n" for e in controller))
    for name, evs in ranks.items():
        (run / "events" / f"{name}.jsonl").write_text("".join(json.dumps(e) + "\n"
                                                              for e in evs))
    return run


def _hpct_run(run: Path, restore: int, survivors_finish_k1: bool) -> Path:
    """Crash of n3 (rank 2) at T_KILL after every rank completed step 5 (k = 5) in
    generation 0; n5 takes rank 2 in generation 1, which restores `restore` and trains on.
    `survivors_finish_k1`: the survivors completed step 6 in generation 0 after the crash (the
    state captured at the fault)."""
    controller = [
        _ev(0.0, "controller.start", job_id=3, active=MEMBERS0, spares=["n5"],
            tasks_per_node=1),
        _ev(1.0, "generation.start", generation=0, members=MEMBERS0, restore_step=-1),
        _ev(T_KILL + 0.05, "fault.detected", node="n3", reason="connection lost",
            generation=0, role="active"),
        _ev(T_KILL + 0.3, "recovery.assign", generation=1, restore_step=restore,
            taken={"n3": "n5"}, members=MEMBERS1),
        _ev(T_KILL + 0.3, "generation.start", generation=1, members=MEMBERS1,
            restore_step=restore),
    ]
    ranks: dict[str, list[dict]] = {}
    for rank, node in enumerate(MEMBERS0):
        ranks[f"{node}-0"] = [_ev(T_KILL - 1 + 0.1 * s, "rank.step", rank=rank, generation=0,
                                  step=s) for s in range(6)]
        if survivors_finish_k1 and node != "n3":
            ranks[f"{node}-0"].append(_ev(T_KILL + 0.01, "rank.step", rank=rank,
                                          generation=0, step=6))
    for rank, node in enumerate(MEMBERS1):
        ranks.setdefault(f"{node}-0", []).extend(
            _ev(T_KILL + 0.4 + 0.1 * (s - restore) + 0.01 * rank, "rank.step", rank=rank,
                generation=1, step=s) for s in range(restore + 1, 10))
    return _write(run, controller, ranks)


def test_every_rank_logs_the_step_after_k(tmp_path: Path) -> None:
    # generation 1 restores step 5 and every rank's first step is 6: rank 3's, the last
    run = _hpct_run(tmp_path / "a", restore=5, survivors_finish_k1=False)
    took, k = back_to_speed(run, T_KILL)
    assert k == 5 and took == pytest.approx(0.4 + 0.1 + 0.03)
    # a rank of the new generation that never completes a step is an error, not a rank that
    # drops out of the yardstick
    (run / "events" / "n5-0.jsonl").write_text("")
    with pytest.raises(HpctError, match=r"rank\(s\) \[2\] completed no step from step 6 on"):
        back_to_speed(run, T_KILL)


def test_the_replacement_that_goes_on_from_k_plus_2_counts(tmp_path: Path) -> None:
    # the survivors completed step 6 in generation 0 just after the crash; generation 1
    # restores step 6 and goes on from step 7: nobody logs step 6 in it. Back when every rank
    # of generation 1 completed step 7, not when the dying generation's survivors logged 6.
    run = _hpct_run(tmp_path / "b", restore=6, survivors_finish_k1=True)
    took, k = back_to_speed(run, T_KILL)
    assert k == 5 and took == pytest.approx(0.4 + 0.1 + 0.03)


def test_the_recorded_run_whose_replacement_never_logs_k_plus_1(tmp_path: Path) -> None:
    """tests/data/report-run as recorded: n3 (rank 2) died after step 20; n1, n2, n4 logged
    step 21 in generation 0 after it; generation 1 restored step 21 and every rank, n5
    included, went on from step 22."""
    t_kill = 1795318816.15             # after every rank's step 20, before any step 21
    took, k = back_to_speed(FIXTURE, t_kill)
    assert k == 20
    assert took == pytest.approx(1795318818.088966 - t_kill)   # n4's step 22, the last
    # the controller's own recovery.done came 0.1 ms later: the same yardstick
    assert took > 1.8259029388427734


def test_restart_all_relaunch_is_the_group_after_the_crash(tmp_path: Path) -> None:
    """The baseline (no generations): the relaunched ranks' steps, from their restart's
    checkpoint on; every rank of the relaunch counts."""
    controller = [_ev(0.0, "baseline.launch", attempt=0, nodes=MEMBERS0),
                  _ev(T_KILL + 1.0, "baseline.step_exit", attempt=0, code=1, done=False),
                  _ev(T_KILL + 2.0, "baseline.launch", attempt=1, nodes=MEMBERS1)]
    ranks = {f"{node}-0": [_ev(T_KILL - 1 + 0.1 * s, "rank.step", rank=r, step=s)
                           for s in range(6)] for r, node in enumerate(MEMBERS0)}
    for r, node in enumerate(MEMBERS1):      # resumed from step 3's checkpoint: 4, 5, then 6
        ranks.setdefault(f"{node}-0", []).extend(
            _ev(T_KILL + 10 + s + 0.01 * r, "rank.step", rank=r, step=s) for s in (4, 5, 6))
    run = _write(tmp_path / "base", controller, ranks)
    took, k = back_to_speed(run, T_KILL)
    assert k == 5 and took == pytest.approx(16.03)
    # n5 relaunched but never got past the checkpoint: the relaunch is not back
    (run / "events" / "n5-0.jsonl").write_text("")
    with pytest.raises(HpctError, match=r"rank\(s\) \[2\] completed no step"):
        back_to_speed(run, T_KILL)


def test_the_recovery_bench_uses_the_same_yardstick() -> None:
    """bench recovery: old and new incarnations by generation; a replacement that starts after
    k+1 is back at its first step."""
    steps = [_ev(1 + 0.1 * s, "rank.step", rank=r, generation=0, step=s)
             for r in range(R.WORLD) for s in range(6)]
    steps += [_ev(5.0 + 0.01 * r, "rank.step", rank=r, generation=1, step=7)
              for r in range(R.WORLD)]
    t_end, k = R.back_to_speed(steps, lambda e: e["generation"] >= 1)
    assert (t_end, k) == (pytest.approx(5.0 + 0.01 * (R.WORLD - 1)), 5)
