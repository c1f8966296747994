"""The goodput model's fail-slow term: a node that keeps working but paces the whole job."""
from __future__ import annotations

import json
from dataclasses import replace

import pytest

from hpct_slurm.cli import main
from hpct_slurm.errors import HpctError
from hpct_slurm.goodput import Curve, Params, evaluate, load_params, sweep
from hpct_slurm.goodput.model import (CkptRestartCosts, FailSlow, HpctCosts, default_doc,
                                      params_from_doc)

# Every input set by hand (not from defaults.json), so that the pinned results below do not
# move when a default does.
HAND = Params(gpus_per_node=8, node_fail_per_hour=0.0005, ckpt_interval_min=30, ckpt_stall_s=20,
              ckpt_restart=CkptRestartCosts(30, 60, 60, 60, 20, 30, Curve("linear", 0.0, 0.29)),
              hpct=HpctCosts(5, 1, Curve("log", 0.01, 0.001), 10, 25, 1, 20),
              replication_overhead=0.03, spare_fraction=0.01, min_spares=1,
              spare_refill_hours=4)
# HAND evaluated by the model before it had a fail-slow term (main at 9319605):
# gpus -> (ckpt_restart_goodput, hpct_goodput, hpct_goodput_incl_spares)
BEFORE_FAILSLOW = {16: (0.988690952951349, 0.9705949289753173, 0.6470632859835449),
                   2304: (0.9166700890917171, 0.9634964752550558, 0.9535635219019107),
                   8192: (0.49156019836476, 0.9667969935972139, 0.9565218564671952)}
# One hand-computed episode: 1.25x for 2 h undetected, 4 s steps, a 50-step window.
EPISODE = FailSlow(per_node_hour=0.001, slowdown=1.25, undetected_hours=2, step_s=4,
                   window_steps=50, threshold=1.2, move_pause_s=0.5)


def _old_fields(r) -> dict:
    return {k: v for k, v in r.to_dict().items() if "failslow" not in k}


def test_a_hand_computed_episode():
    # checkpoint-restart: 2 h at 1/1.25 of the speed = 7200 s x 0.2 = 1440 s lost;
    # hpct-slurm: 50 steps, held 50 more, of 4 s x 1.25 = 500 s to detect, x 0.2 = 100 s,
    # + 0.5 s move
    assert EPISODE.undetected_lost_s() == pytest.approx(1440)
    assert EPISODE.detect_s() == pytest.approx(500)
    assert EPISODE.moved() and EPISODE.moved_lost_s() == pytest.approx(100.5)
    # 80 GPUs = 10 nodes, no failures, spares to spare: 0.01 episodes an hour
    p = replace(HAND, node_fail_per_hour=0.0, spares=100, failslow=EPISODE)
    r = evaluate(80, p)
    assert r.failslow_per_hour == pytest.approx(0.01)
    assert r.ckpt_restart_failslow_loss == pytest.approx(0.01 * 1440 / 3600)  # 0.4 % of wall
    assert r.hpct_failslow_lost_s == pytest.approx(100.5)
    assert r.hpct_failslow_loss == pytest.approx(0.01 * 100.5 / 3600)
    # goodput = (1 - loss) / ((1 + c/tau)(1 + r)); hpct-slurm's fallback checkpoints are daily
    # (no failures: Young/Daly asks for never, capped at 24 h)
    assert r.ckpt_restart_goodput == pytest.approx((1 - 0.004) / (1 + 20 / 1800))
    assert r.hpct_ckpt_interval_min == 1440
    assert r.hpct_goodput == pytest.approx((1 - 0.01 * 100.5 / 3600)
                                           / ((1 + 20 / 86400) * 1.03))


def test_rate_zero_gives_exactly_the_results_before_the_term():
    for gpus, (cr, h, h_spares) in BEFORE_FAILSLOW.items():
        r = evaluate(gpus, HAND)  # FailSlow() by default: rate 0
        assert (r.ckpt_restart_goodput, r.hpct_goodput, r.hpct_goodput_incl_spares) == \
            (cr, h, h_spares)
    # and a zero rate makes every other fail-slow input irrelevant, bit for bit
    wild = FailSlow(per_node_hour=0.0, slowdown=3.0, undetected_hours=0.01, step_s=30,
                    window_steps=1, threshold=1.0, move_pause_s=100)
    for a, b in zip(sweep(HAND), sweep(replace(HAND, failslow=wild))):
        assert _old_fields(a) == _old_fields(b)
        assert b.ckpt_restart_failslow_loss == 0.0 and b.hpct_failslow_loss == 0.0


def test_defaults_with_rate_zero_are_the_defaults_without_the_term():
    off = load_params(failslow={"per_node_hour": 0})
    for a, b in zip(sweep(replace(off, failslow=FailSlow())), sweep(off)):
        assert _old_fields(a) == _old_fields(b)


def test_a_larger_slowdown_costs_checkpoint_restart_more():
    p = replace(HAND, failslow=EPISODE)
    results = [evaluate(2304, replace(p, failslow=replace(EPISODE, slowdown=s)))
               for s in (1.0, 1.1, 1.25, 2.0, 4.0)]
    losses = [r.ckpt_restart_failslow_loss for r in results]
    assert losses[0] == 0.0  # 1x is no slowdown at all
    assert all(a < b for a, b in zip(losses, losses[1:]))
    goodputs = [r.ckpt_restart_goodput for r in results]
    assert all(a > b for a, b in zip(goodputs, goodputs[1:]))


def test_detection_time_scales_with_the_window():
    def lost(window):
        fs = replace(EPISODE, window_steps=window)
        return evaluate(80, replace(HAND, spares=100, failslow=fs)).hpct_failslow_lost_s
    # each extra step of the window is two more slowed steps (the window, then the hold):
    # step_s x slowdown x (1 - 1/s) each
    assert lost(100) - lost(50) == pytest.approx(2 * 50 * 4 * (1.25 - 1))
    assert lost(200) - lost(100) == pytest.approx(2 * 100 * 4 * (1.25 - 1))
    # a window longer than the episode finds nothing: hpct-slurm loses what the baseline does
    long = replace(EPISODE, window_steps=2000)  # 2000 x 5 s > 2 h
    assert not long.moved()
    r = evaluate(80, replace(HAND, spares=100, failslow=long))
    assert r.hpct_failslow_lost_s == r.ckpt_restart_failslow_lost_s


def test_a_slowdown_under_the_threshold_is_never_moved():
    fs = replace(EPISODE, slowdown=1.1)  # threshold 1.2
    r = evaluate(2304, replace(HAND, failslow=fs))
    assert not fs.moved()
    assert r.hpct_failslow_lost_s == r.ckpt_restart_failslow_lost_s > 0


def test_without_spares_a_slow_node_runs_its_course():
    """No spare: the event and the drain reason only, the job keeps running slowed; with the
    same checkpoint interval and no replication hpct-slurm is then checkpoint-restart."""
    p = replace(HAND, spares=0, replication_overhead=0.0,
                hpct_ckpt_interval_min=HAND.ckpt_interval_min, failslow=EPISODE)
    for gpus in (16, 2304):
        r = evaluate(gpus, p)
        assert r.hpct_failslow_lost_s == r.ckpt_restart_failslow_lost_s
        assert r.hpct_goodput == pytest.approx(r.ckpt_restart_goodput)


def test_moves_take_spares_from_the_failures():
    """A moved node is drained like a failed one: at the same spares, fail-slow moves raise
    the chance that a failure finds none left."""
    plain = evaluate(2304, HAND)
    slow = evaluate(2304, replace(HAND, failslow=EPISODE))
    assert slow.hpct_fallback_fraction > plain.hpct_fallback_fraction
    assert slow.hpct_goodput < plain.hpct_goodput


@pytest.mark.parametrize("key,value", [("per_node_hour", -0.1), ("slowdown", 0.9),
                                       ("undetected_hours", 0), ("step_s", 0),
                                       ("window_steps", 0), ("threshold", 0.5),
                                       ("move_pause_s", -1), ("slowdown", float("nan"))])
def test_out_of_range_inputs_name_the_key(key, value):
    with pytest.raises(HpctError, match=f"failslow.{key} = "):
        FailSlow(**{key: value})
    doc = default_doc()
    doc["failslow"][key] = value
    with pytest.raises(HpctError, match=f"failslow.{key}"):
        params_from_doc(doc)


def test_every_failslow_default_has_a_source():
    doc = default_doc()
    prov = " ".join(doc["provenance"])
    for key in doc["failslow"]:
        named = "failslow.detector" if key in ("window_steps", "threshold") else f"failslow.{key}"
        assert named in prov, key


def test_the_move_bench_sets_the_pause_and_a_flag_wins(tmp_path):
    path = tmp_path / "move.json"
    path.write_text(json.dumps({"bench": "move", "move_pause_s_median": 1.5}))
    p = load_params([path])
    assert p.failslow.move_pause_s == 1.5
    assert p.measured["failslow.move_pause_s"] == str(path)
    by_hand = load_params([path], failslow={"move_pause_s": 3.0})
    assert by_hand.failslow.move_pause_s == 3.0
    assert "failslow.move_pause_s" not in by_hand.measured
    path.write_text(json.dumps({"bench": "move"}))
    with pytest.raises(HpctError, match="move_pause_s_median"):
        load_params([path])


def test_cli_flags_reach_the_model(capsys):
    assert main(["goodput", "--gpus", "2304", "--failslow-per-node-hour", "0.001",
                 "--failslow-slowdown", "2", "--failslow-undetected-hours", "3",
                 "--step-s", "2", "--failslow-window-steps", "20",
                 "--failslow-threshold", "1.5", "--move-pause-s", "1", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["params"]["failslow"] == {
        "per_node_hour": 0.001, "slowdown": 2.0, "undetected_hours": 3.0, "step_s": 2.0,
        "window_steps": 20, "threshold": 1.5, "move_pause_s": 1.0}
    assert doc["failslow_per_hour"] == pytest.approx(288 * 0.001)
    assert doc["ckpt_restart_failslow_lost_s"] == pytest.approx(3 * 3600 * 0.5)
    # 20 + 20 steps x 2 s x 2 = 160 s, half of it lost, + 1 s; with the odd fallback mixed in
    q = doc["hpct_fallback_fraction"]
    assert doc["hpct_failslow_lost_s"] == pytest.approx((1 - q) * 81 + q * 5400)


def test_cli_rate_zero_is_the_old_table(capsys):
    assert main(["goodput", "--gpus", "2304", "--failslow-per-node-hour", "0", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    want = evaluate(2304, replace(load_params(), failslow=FailSlow()))
    assert doc["ckpt_restart_goodput"] == want.ckpt_restart_goodput
    assert doc["hpct_goodput"] == want.hpct_goodput
    assert main(["goodput", "--gpus", "2304", "--failslow-per-node-hour", "0"]) == 0
    assert "fail-slow: off" in capsys.readouterr().out


def test_cli_text_says_what_an_episode_costs(capsys):
    assert main(["goodput", "--gpus", "2304", "--failslow-slowdown", "1.25",
                 "--failslow-undetected-hours", "2", "--step-s", "4"]) == 0
    out = capsys.readouterr().out
    assert "ckpt-restart loses 1440 s" in out and "found in 50 + 50 steps = 500 s" in out


@pytest.mark.parametrize("flag,value", [
    ("--failslow-per-node-hour", "-0.5"), ("--failslow-per-node-hour", "nan"),
    ("--failslow-slowdown", "0.9"), ("--failslow-slowdown", "fast"),
    ("--failslow-undetected-hours", "0"), ("--step-s", "-2"), ("--step-s", "inf"),
    ("--failslow-window-steps", "0"), ("--failslow-window-steps", "2.5"),
    ("--failslow-threshold", "0.99"), ("--move-pause-s", "-0.1")])
def test_cli_bad_input_names_the_flag_and_the_value(capsys, flag, value):
    with pytest.raises(SystemExit) as exc:
        main(["goodput", "--gpus", "16", flag, value])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert f"argument {flag}: {value!r}" in err, err


def test_the_detector_defaults_are_the_settings_the_controller_runs_with():
    import json
    from importlib import resources

    from hpct_slurm import config as C
    fs = json.loads(resources.files("hpct_slurm.goodput").joinpath("defaults.json")
                    .read_text())["failslow"]
    assert fs["window_steps"] == C.BY_NAME[C.SLOW_WINDOW].default
    assert fs["threshold"] == C.BY_NAME[C.SLOW_RATIO].default
