"""The pure parts of `bench recovery` and `bench stress`: phase cutting, the back-to-speed
yardstick, the summary's medians and shape, the stress fault plan and the job view. The
benchmarks themselves run on the cluster; these check what they compute from the events."""
from __future__ import annotations

import json

import pytest
from hypothesis import given
from hypothesis import strategies as st

from hpct_slurm.bench import recovery as R
from hpct_slurm.bench import stress as S
from hpct_slurm.errors import HpctError


def _step(rank: int, step: int, t: float, gen: int | None = None) -> dict:
    e = {"event": "rank.step", "rank": rank, "step": step, "t": t}
    if gen is not None:
        e["generation"] = gen
    return e


def _hpct_events(t0: float = 100.0) -> tuple[list[dict], list[dict]]:
    """Crash at t0 during step 6 of generation 0; rank 2 is replaced in generation 1."""
    ranks = [_step(r, s, t0 - 1 + 0.1 * s, 0) for r in range(4) for s in range(6)]
    # rank 0 finished step 6 just before the crash took effect
    ranks.append(_step(0, 6, t0 + 0.001, 0))
    ctl = [{"event": "fault.detected", "t": t0 + 0.01, "node": "n3"},
           {"event": "fault.stop_sent", "t": t0 + 0.011},
           {"event": "fault.fenced", "t": t0 + 0.03, "node": "n3"},
           {"event": "recovery.assign", "t": t0 + 0.6, "generation": 1, "restore_step": 5,
            "taken": {"n3": "n5"}},
           {"event": "recovery.done", "t": t0 + 1.0, "recovery_s": 0.99}]
    ranks += [{"event": "rank.adopted", "rank": r, "generation": 1, "t": t0 + 0.7 + 0.01 * r,
               "restore_s": 0.05 if r == 2 else 0.001, "source": "peer" if r == 2 else "own"}
              for r in range(4)]
    ranks += [_step(r, 6, t0 + 0.8 + 0.01 * r, 1) for r in range(4)]
    ranks += [_step(r, 7, t0 + 0.9 + 0.01 * r, 1) for r in range(4)]
    return ctl, ranks


def test_hpct_phases_add_up_to_back_to_speed_and_ignore_the_dying_ranks_step():
    ctl, ranks = _hpct_events()
    phases, outline = R.hpct_phases(ctl, ranks, 100.0)
    assert list(phases) == list(R.HPCT_PHASES)
    # step 6 was reached by rank 0 in generation 0, so the yardstick is step 7 of generation 1
    assert outline["k_last"] == 6
    assert outline["t_end"] == pytest.approx(100.93)
    assert sum(phases.values()) == pytest.approx(0.93)
    assert phases["detect"] == pytest.approx(0.01)
    assert phases["survivors_ready"] == pytest.approx(0.57)
    assert phases["reform"] == pytest.approx(0.73 - 0.001 - 0.6)  # slowest rank's group formed
    assert outline["restore_sources"] == ["own", "peer"]
    assert min(phases.values()) >= 0


def test_back_to_speed_needs_every_rank_of_the_new_incarnation():
    _, ranks = _hpct_events()
    missing = [e for e in ranks if not (e["event"] == "rank.step" and e["step"] == 7
                                        and e["rank"] == 3)]
    with pytest.raises(HpctError, match="step 7"):
        R.back_to_speed(missing, lambda e: e.get("generation", 0) >= 1)


def test_baseline_phases_cover_detect_relaunch_load_and_recompute():
    t0 = 100.0
    ctl = [{"event": "baseline.launch", "t": 1.0, "attempt": 0},
           {"event": "baseline.step_exit", "t": t0 + 25, "attempt": 0},
           {"event": "baseline.restart_all", "t": t0 + 25.01},
           {"event": "baseline.launch", "t": t0 + 25.05, "attempt": 1}]
    ranks = [_step(r, s, 50 + s, None) for r in range(4) for s in range(13)]
    for r in range(4):
        ranks += [{"event": "baseline.imported", "t": t0 + 30 + r, "rank": r},
                  {"event": "baseline.pg_ready", "t": t0 + 34, "rank": r},
                  {"event": "baseline.start", "t": t0 + 35, "rank": r, "start_step": 10}]
        ranks += [_step(r, s, t0 + 35 + (s - 9), None) for s in range(10, 20)]
    phases, outline = R.baseline_phases(ctl, ranks, t0)
    assert list(phases) == list(R.BASELINE_PHASES)
    assert outline["k_last"] == 12 and outline["recomputed_steps"] == 3
    assert phases["detect"] == pytest.approx(25)
    assert phases["process_start"] == pytest.approx(33 - 25.05)
    assert phases["recompute"] == pytest.approx(3)  # steps 10, 11, 12 again
    assert sum(phases.values()) == pytest.approx(outline["t_end"] - t0) == pytest.approx(39)


def test_a_missing_event_is_an_error_that_names_it():
    ctl, ranks = _hpct_events()
    with pytest.raises(HpctError, match="recovery.assign"):
        R.hpct_phases([e for e in ctl if e["event"] != "recovery.assign"], ranks, 100.0)


@given(st.lists(st.floats(-5, 5, allow_nan=False), min_size=1, max_size=8))
def test_cut_never_negative_and_sums_to_the_last_mark(offsets):
    marks = [(f"p{i}", 10.0 + o) for i, o in enumerate(offsets)]
    out = R._cut(marks, 10.0)
    assert all(v >= 0 for v in out.values())
    assert sum(out.values()) == pytest.approx(max(0.0, max(10.0 + o for o in offsets) - 10.0))


def _repeat(h: float, b: float, lost: int = 0, equal: bool = True) -> dict:
    return {"hpct": {"recovery_s": h, "lost_steps": lost, "bitwise_equal": equal,
                     "phases": {p: h / len(R.HPCT_PHASES) for p in R.HPCT_PHASES}},
            "baseline": {"recovery_s": b, "recomputed_steps": 4, "bitwise_equal": True,
                         "phases": {p: b / len(R.BASELINE_PHASES) for p in R.BASELINE_PHASES}}}


def test_summary_reports_medians_worst_lost_steps_and_every_phase():
    reps = [_repeat(1.0, 30.0), _repeat(3.0, 20.0, lost=1), _repeat(2.0, 40.0, equal=False)]
    s = R.summarize(reps, 101.46)
    json.dumps(s)  # one JSON line
    assert s["bench"] == "recovery" and s["repeats"] == 3 and s["state_mb"] == 101.5
    assert s["hpct_recovery_s"] == 2.0 and s["baseline_recovery_s"] == 30.0
    assert s["ratio"] == pytest.approx(2.0 / 30.0, abs=1e-4)
    assert s["lost_steps"] == 1  # the worst repeat, not the median
    assert s["bitwise_equal"] is False  # must hold in every repeat
    assert s["spread_s"] == {"hpct": [1.0, 3.0], "baseline": [20.0, 40.0]}
    assert set(s["phases"]["hpct"]) == set(R.HPCT_PHASES)
    assert set(s["phases"]["baseline"]) == set(R.BASELINE_PHASES)
    assert s["phases"]["hpct"]["detect"] == pytest.approx(2.0 / len(R.HPCT_PHASES), abs=1e-4)
    assert s["phases_add_up"] is True
    reps[0]["hpct"]["phases"]["detect"] += 0.5  # a phase that is not a cut of the total
    assert R.summarize(reps, 101.46)["phases_add_up"] is False


def test_summary_counts_failed_runs_per_method():
    s = R.summarize([_repeat(1.0, 30.0)], 101.5,
                    [{"repeat": 1, "method": "hpct", "error": "escalated"}])
    assert s["repeats"] == 1 and s["failed_runs"] == {"hpct": 1, "baseline": 0}


def test_spread_of_nothing_is_an_error():
    with pytest.raises(HpctError):
        R.spread([])
    assert R.spread([3.0, 1.0, 2.0]) == {"median": 2.0, "min": 1.0, "max": 3.0}


def test_full_config_state_is_at_least_100_mb():
    cfg = R.FULL
    nbytes = R.state_bytes(cfg.hidden, cfg.layers)
    h = cfg.hidden
    params = 32 * h + h + (cfg.layers - 1) * (h * h + h) + h + 1
    # parameters + Adam's exp_avg and exp_avg_sq (float32) + one step counter per parameter
    assert nbytes >= 3 * 4 * params
    assert nbytes >= 100e6
    assert R.state_bytes(256, 1) < 1e6


def test_stress_plan_is_seeded_and_holds_the_asked_faults():
    cfg = S.FULL
    a, b = S.plan(cfg), S.plan(cfg)
    assert a == b
    kinds = [f.kind for f in a]
    assert sum(f.size for f in a) == cfg.faults >= 20
    assert kinds.count("node_crash") == cfg.node_crashes <= 1
    assert kinds.count("back_to_back") == cfg.back_to_back
    assert kinds.count("hang_rank") == cfg.hangs and kinds.count("kill_spare") == cfg.kill_spares
    # after the node crash, a spare is gone for good: no back-to-back fault may follow it
    crash = kinds.index("node_crash")
    assert "back_to_back" not in kinds[crash:]
    assert all(cfg.min_gap_steps <= f.gap_steps <= cfg.max_gap_steps for f in a)
    other = S.plan(S.Config(**{**cfg.__dict__, "seed": cfg.seed + 1}))
    assert [f.kind for f in other] != kinds or [f.gap_steps for f in other] != \
        [f.gap_steps for f in a]


def test_stress_plan_rejects_too_few_faults():
    with pytest.raises(HpctError, match="faults=3"):
        S.plan(S.Config(faults=3, steps=10, step_sleep=0, back_to_back=2, node_crashes=0,
                        kill_spares=0, hangs=0))


def test_stress_view_follows_spares_and_recoveries():
    ev = [{"event": "controller.start", "t": 0, "active": ["n1", "n2", "n3"],
           "spares": ["n4", "n5"]}]
    ev += [{"event": "rank.register", "t": 1, "node": n, "pid": 100 + i,
            "role": "spare" if n in ("n4", "n5") else "active"}
           for i, n in enumerate(["n1", "n2", "n3", "n4", "n5"])]
    v = S.view(ev)
    assert v.active_pids == {"n1": 100, "n2": 101, "n3": 102}
    assert v.spare_pids == {"n4": 103, "n5": 104}
    ev += [{"event": "fault.detected", "t": 2, "node": "n2", "role": "active"},
           {"event": "recovery.assign", "t": 3, "members": ["n1", "n4", "n3"]}]
    v = S.view(ev)
    assert v.last_done_t < v.last_fault_t  # recovering
    assert v.spare_pids == {"n5": 104} and "n2" not in v.active_pids
    ev += [{"event": "recovery.done", "t": 4, "recovery_s": 0.5},
           {"event": "step.launch", "t": 5, "node": "n2", "role": "spare"}]
    v = S.view(ev)
    assert v.last_done_t >= v.last_fault_t and v.recovery_s == [0.5]
    assert "n2" not in v.spare_pids  # relaunched but not warm yet
    ev.append({"event": "rank.register", "t": 9, "node": "n2", "pid": 200, "role": "spare"})
    assert S.view(ev).spare_pids == {"n5": 104, "n2": 200}


def test_stress_outcome_matches_faults_to_their_recovery():
    ctl = [{"event": "fault.detected", "t": 10.5, "node": "n2", "role": "active",
            "reason": "connection lost"},
           {"event": "recovery.done", "t": 11.0},
           {"event": "fault.detected", "t": 20.2, "node": "n5", "role": "spare",
            "reason": "step exited (0)"},
           {"event": "fault.fenced", "t": 20.3, "node": "n5"}]
    injected = [{"kind": "kill_rank", "node": "n2", "pid": 1, "t": 10.0},
                {"kind": "kill_spare", "node": "n5", "pid": 2, "t": 20.0},
                {"kind": "hang_rank", "node": "n1", "pid": 3, "t": 30.0}]
    out = S.outcome(ctl, injected)
    assert [o["recovered"] for o in out] == [True, True, False]
    assert out[0]["fault_to_recovered_s"] == pytest.approx(1.0)
    assert out[1]["fault_to_recovered_s"] == pytest.approx(0.3)
    assert out[2]["detected"] is None


def test_all_table_shows_numbers_and_failures():
    from hpct_slurm.bench.all import table

    out = table({"transfer": {"summary": {"bench": "transfer", "gbps": 1.5, "sizes": [1]},
                              "wall_s": 12.0},
                 "recovery": {"error": "HpctError: nodes not idle", "wall_s": 3.0}})
    lines = out.splitlines()
    assert lines[1].startswith("transfer") and "gbps=1.5" in lines[1] and "sizes" not in lines[1]
    assert lines[2].startswith("recovery") and "FAILED: HpctError: nodes not idle" in lines[2]
