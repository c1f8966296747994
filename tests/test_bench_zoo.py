"""The pure parts of `bench zoo`: the seeded crash moments, the shapes' commands, a crash's
recovery from its recovery.done events, the per-shape summary against the demo's median and its
table. The benchmark itself runs on the cluster; these check what it computes from the events."""
from __future__ import annotations

import json

import pytest
from hypothesis import given
from hypothesis import strategies as st

from hpct_slurm.bench import zoo as Z
from hpct_slurm.bench.cli import BENCHMARKS, CLUSTER_BENCHMARKS
from hpct_slurm.errors import HpctError


def _run(shape: str, s: float, lost: int = 0, identical: bool = True, rounds: int = 1) -> dict:
    return {"shape": shape, "recovery_s": s, "crash_to_done_s": s + 0.1, "lost_steps": lost,
            "phases": {p: s / len(Z.PHASES) for p in Z.PHASES}, "rounds": rounds,
            "bit_identical": identical}


def test_zoo_is_a_cluster_benchmark():
    assert "zoo" in BENCHMARKS and "zoo" in CLUSTER_BENCHMARKS
    assert Z.SHAPES[0] == Z.DEMO and set(Z.SHAPES[1:]) == {"bn_cnn", "ema_lion", "compile_lm"}


def test_crash_moments_are_seeded_and_the_same_for_every_shape():
    a = Z.crash_moments(0, 3, Z.FULL.steps, 0.1)
    assert a == Z.crash_moments(0, 3, Z.FULL.steps, 0.1)  # a rerun crashes at the same moments
    assert a != Z.crash_moments(1, 3, Z.FULL.steps, 0.1)
    assert len(a) == 3 and Z.FULL.crashes >= 3


@given(st.integers(0, 2**32), st.integers(1, 8), st.integers(6, 200),
       st.floats(0, 2, allow_nan=False))
def test_a_crash_moment_leaves_steps_to_recover_in(seed, n, steps, step_s):
    for m in Z.crash_moments(seed, n, steps, step_s):
        assert 1 <= m.step <= steps - 5 and 0 <= m.delay_s <= step_s + 1e-3


def test_a_run_too_short_for_a_crash_is_refused():
    with pytest.raises(HpctError, match="at least 6"):
        Z.crash_moments(0, 1, 5, 0.1)


def test_every_shape_runs_as_many_steps():
    cfg = Z.Config(epochs=3, crashes=1)
    assert Z.argv(Z.DEMO, cfg, 0.1)[-4:] == ["--steps", "24", "--step-sleep", "0.1"]
    assert Z.argv("bn_cnn", cfg, 0.0)[-6:] == ["--shape", "bn_cnn", "--epochs", "3",
                                               "--step-sleep", "0.0"]
    assert cfg.steps == 3 * Z.STEPS_PER_EPOCH == 24


def test_same_state_compares_every_rank_digest():
    ref = {r: {"state_sha256": "a"} for r in range(4)}
    assert Z.same_state(ref, {r: {"state_sha256": "a"} for r in range(4)})
    assert not Z.same_state(ref, {**ref, 3: {"state_sha256": "b"}})
    assert not Z.same_state(ref, {r: ref[r] for r in range(3)})


def _done(t: float, s: float, lost: int = 0) -> dict:
    return {"event": "recovery.done", "t": t, "recovery_s": s, "lost_steps": lost,
            "phases": {p: s / len(Z.PHASES) for p in Z.PHASES}}


def test_the_crash_round_is_the_recovery_and_later_rounds_are_counted_apart():
    one = Z.crash_round([_done(10.0, 0.4)])
    assert (one["rounds"], one["later_rounds_s"]) == (1, 0)
    assert one["recovery_s"] == 0.4 and one["phases"]["fence"] == pytest.approx(0.1)
    # a rollback at the end of the job, 3 s of training after the crash's round
    two = Z.crash_round([_done(10.0, 0.4), _done(13.0, 0.3, lost=17)])
    assert (two["rounds"], two["recovery_s"], two["later_rounds_s"]) == (2, 0.4, 0.3)


def test_summary_is_per_shape_with_the_ratio_to_the_demos_median():
    runs = [_run("demo", s) for s in (0.3, 0.2, 0.5)]
    runs += [_run("bn_cnn", s) for s in (0.4, 0.9, 0.5)]
    runs += [_run("ema_lion", 0.5, lost=1), _run("ema_lion", 0.7, identical=False, rounds=2)]
    s = Z.summarize(runs, [{"shape": "ema_lion", "step": 14, "error": "escalated"}])
    json.dumps(s)  # one JSON line
    demo, cnn, ema = (s["shapes"][k] for k in ("demo", "bn_cnn", "ema_lion"))
    assert s["demo_median_s"] == 0.3 and demo["ratio"] == 1.0
    assert (cnn["median"], cnn["min"], cnn["max"], cnn["ratio"]) == (0.5, 0.4, 0.9, 1.67)
    assert ema["runs"] == 2 and ema["failed"] == 1 and ema["median"] == 0.6
    assert ema["ratio"] == 2.0 and s["within_2x"] is True  # 2x is still within
    assert ema["lost_steps"] == 1 == s["lost_steps"] and ema["rounds"] == 2 == s["rounds"]
    assert ema["bit_identical"] is False and s["all_bit_identical"] is False
    assert cnn["phases"]["fence"] == pytest.approx(0.5 / len(Z.PHASES), abs=1e-4)
    assert s["failed_runs"] == 1


def test_a_shape_over_2x_or_with_no_good_run_is_not_within():
    base = [_run("demo", 0.2)]
    assert Z.summarize([*base, _run("bn_cnn", 0.41)])["within_2x"] is False
    s = Z.summarize(base, [{"shape": "compile_lm", "step": 3, "error": "no recovery.done"}])
    assert s["within_2x"] is False and s["shapes"]["compile_lm"]["ratio"] is None
    assert Z.summarize([_run("bn_cnn", 0.4)])["within_2x"] is None  # no demo: no yardstick


def test_table_has_a_row_per_shape_and_dashes_for_a_shape_with_no_good_run():
    s = Z.summarize([_run("demo", 0.2), _run("bn_cnn", 0.3)],
                    [{"shape": "compile_lm", "step": 3, "error": "x"}])
    lines = Z.table(s).splitlines()
    assert len(lines) == 2 + 3
    assert len({line.count("|") for line in lines}) == 1  # every row has every column
    assert lines[3].startswith("| bn_cnn | 1 | 0.300 | 0.300 | 0.300 | 1.5 |")
    assert lines[4].startswith("| compile_lm | 0 (+1 failed) | - |")
