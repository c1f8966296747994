"""Fail-slow (issue 47) without Slurm: a rank's own time per step (recovery/own_time.py), the
rule that names a slow node (controller/slowness.py), the controller acting on its ranks'
heartbeats (the real Controller with test_controller_fast's in-process fake ranks), the spare
pool leaving a node drained for slowness to the admin, and the settings' bad values."""
from __future__ import annotations

import asyncio
import math
import time

import pytest

from hpct_slurm import config as C
from hpct_slurm import protocol as P
from hpct_slurm.controller.connections import Conn, refusal
from hpct_slurm.controller.slowness import (Confirmed, Figure, Hold, Slow, drain_reason,
                                            find_slow, node_figures, screen)
from hpct_slurm.events import RankState
from hpct_slurm.recovery.loop import StepLoop
from hpct_slurm.recovery.own_time import DeviceOwnTime, OwnTime
from hpct_slurm.spares.pool import loop_stage, slow_drained
from test_controller_fast import FakeCluster, run
from test_lifecycle_fast import node


# ---- a rank's own time --------------------------------------------------------------------

def steps(meter: OwnTime, own: list[float], wait: float, generation: int = 0,
          t0: float = 100.0, first: bool = True, after: float = 0.0,
          fetch: float = 0.0) -> float:
    """Steps of `own` seconds of own work, each followed by `wait` seconds in a collective,
    then `after` seconds of work after it and a `fetch` of the next batch, from `t0`;
    `first`: the generation's first step ends at t0 (else the step before did)."""
    t = t0
    if first:
        meter.step_ends(generation, t)
    for o in own:
        t += o
        meter.wait_begins(t)
        t += wait
        meter.wait_ends(t)
        t += after + fetch
        if fetch:
            meter.fetched(fetch)
        meter.step_ends(generation, t)
    return t


def test_own_time_is_the_step_less_its_waits_and_a_median_over_the_window():
    m = OwnTime(window=5)
    assert m.figure == (-1.0, 0)
    t = steps(m, [0.2, 0.2, 0.2, 3.0, 0.2], wait=0.5)
    med, n = m.figure
    assert n == 5 and med == pytest.approx(0.2)  # the waits are not its own; one slow step
    steps(m, [0.4] * 5, wait=0.1, t0=t, first=False)  # moves no median
    assert m.figure[0] == pytest.approx(0.4) and m.figure[1] == 5  # the window slides


def test_a_new_generation_starts_a_new_window_and_its_first_step_is_not_measured():
    m = OwnTime(window=4)
    steps(m, [0.2] * 4, wait=0.0)
    assert m.figure[1] == 4
    m.step_ends(1, 500.0)  # the new generation's first step: formation and restore
    assert m.figure == (-1.0, 0)
    steps(m, [0.3], wait=0.0, generation=1, t0=500.0, first=False)
    assert m.figure == (pytest.approx(0.3), 1)


def test_a_rank_computing_several_shards_reports_its_time_per_shard():
    m = OwnTime(window=3)
    m.step_ends(0, 0.0)
    m.step_ends(0, 0.6, shards=2)
    assert m.figure == (pytest.approx(0.3), 1)


def test_nested_waits_count_once():
    m = OwnTime(window=3)
    m.step_ends(0, 0.0)
    m.wait_begins(0.1)
    m.wait_begins(0.2)
    m.wait_ends(0.3)
    m.wait_ends(0.5)
    m.wait_ends(0.6)  # an unmatched end (a wait from before the window) subtracts nothing
    m.step_ends(0, 1.0)
    assert m.figure == (pytest.approx(0.1), 1)  # to the outer wait's end, less its 0.4 s


def test_work_after_the_last_collective_is_not_own_time_but_the_next_batch_fetch_is():
    # rank 0 evaluates (or logs, or writes a checkpoint) after its update, alone: 0.8 s a
    # step its peers then wait for at the next collective, as for a slow node
    evaluating, peer = OwnTime(window=5), OwnTime(window=5)
    steps(evaluating, [0.1] * 5, wait=0.02, after=0.8)
    steps(peer, [0.1] * 5, wait=0.82)
    assert evaluating.figure == (pytest.approx(0.1), 5) == peer.figure
    # job.steps fetches the next batch before it ends a step: a slow loader still shows
    loading = OwnTime(window=5)
    steps(loading, [0.1] * 5, wait=0.02, after=0.01, fetch=0.05)
    assert loading.figure == (pytest.approx(0.15), 5)
    # a fetch before the step's collective is inside its count already, not added again
    early = OwnTime(window=3)
    early.step_ends(0, 0.0)
    early.fetched(0.05)
    early.wait_begins(0.15), early.wait_ends(0.2)
    early.step_ends(0, 0.3)
    assert early.figure == (pytest.approx(0.15), 1)
    # no wait seen in a step (a script reducing its own gradients): the whole step counts
    blind = OwnTime(window=3)
    blind.step_ends(0, 0.0)
    blind.step_ends(0, 0.9)
    assert blind.figure == (pytest.approx(0.9), 1)


def test_the_scripts_loop_times_each_batch_it_fetches():
    fetched: list[float] = []
    loop = StepLoop(lambda step: None, lambda: None, lambda step: None,
                    lambda given=None: (0, 1), fetched.append)

    def slow_loader():
        for i in range(3):
            time.sleep(0.02)
            yield i
    assert list(loop.steps(slow_loader())) == [0, 1, 2]
    assert len(fetched) == 3 and min(fetched) >= 0.02


class MockCudaEvent:
    """A stand-in for torch.cuda.Event(enable_timing=True), at the GPU boundary this machine
    lacks: `record()` stamps the time the GPU will reach it (`gpu`: the test's schedule of
    the queue), `query()` says whether it has by `MockCudaEvent.now`."""

    now = 0.0
    queue: list[float] = []

    def record(self) -> None:
        self.at = MockCudaEvent.queue.pop(0)

    def query(self) -> bool:
        return self.at <= MockCudaEvent.now

    def elapsed_time(self, other: "MockCudaEvent") -> float:
        return (other.at - self.at) * 1000.0


def test_on_a_gpu_the_events_time_a_step_once_the_gpu_reached_its_end():
    MockCudaEvent.now, MockCudaEvent.queue = 0.0, []
    m = DeviceOwnTime(window=5, event=MockCudaEvent)
    # the GPU's schedule: a step of 0.2 s own work then a 0.5 s wait, twice; host time unused
    MockCudaEvent.queue = [0.0, 0.2, 0.7, 0.7, 0.9, 1.4, 1.4]
    m.step_ends(0, 99.0)                          # generation 0's first step ends (t=0)
    m.wait_begins(99.1), m.wait_ends(99.2)        # around the collective: 0.2 -> 0.7
    m.step_ends(0, 99.3)                          # the GPU has not reached 0.7 yet
    assert m.figure == (-1.0, 0)
    MockCudaEvent.now = 1.4
    m.wait_begins(99.4), m.wait_ends(99.5)        # 0.9 -> 1.4
    m.step_ends(0, 99.6)                          # both steps are read now
    assert m.figure == (pytest.approx(0.2), 2)
    MockCudaEvent.queue = [5.0]
    m.step_ends(1, 99.7)                          # a new generation: nothing pending is read
    assert m.figure == (-1.0, 0) and not m._pending


def test_on_a_gpu_work_after_the_last_collective_is_not_own_time_but_a_fetch_is():
    MockCudaEvent.now, MockCudaEvent.queue = 10.0, []
    m = DeviceOwnTime(window=5, event=MockCudaEvent)
    # 0.2 s own, a 0.1 s wait, then 0.9 s of rank 0's evaluation; a 0.05 s fetch the host
    # timed after it, in the second step
    MockCudaEvent.queue = [0.0, 0.2, 0.3, 1.2, 1.4, 1.5, 2.45]
    m.step_ends(0, 0.0)
    m.wait_begins(0.0), m.wait_ends(0.0)
    m.step_ends(0, 0.0)
    m.wait_begins(0.0), m.wait_ends(0.0)
    m.fetched(0.05)
    m.step_ends(0, 0.0)
    assert m.figure == (pytest.approx(0.25), 2)   # samples 0.2 and 0.25


# ---- which node is slow -------------------------------------------------------------------

def figs(per_node: dict[str, list[float]], n: int = 50) -> list[Figure]:
    return [Figure(node, s, n) for node, ranks in per_node.items() for s in ranks]


def test_a_node_above_the_ratio_of_the_others_median_is_slow():
    [s] = find_slow(figs({"a": [0.10], "b": [0.10, 0.102], "c": [0.15], "d": [0.099]}),
                    1.2, 50)
    assert (s.node, s.window) == ("c", 50)
    assert s.ratio == pytest.approx(0.15 / 0.10) and s.job_s == pytest.approx(0.10)


def test_one_slow_rank_makes_its_node_slow():
    [s] = find_slow(figs({"a": [0.10, 0.10], "b": [0.10, 0.14], "c": [0.10, 0.10]}), 1.2, 50)
    assert s.node == "b" and s.node_s == pytest.approx(0.14)


def test_a_job_wide_slowdown_names_no_node():
    assert find_slow(figs({"a": [0.30], "b": [0.31], "c": [0.29], "d": [0.30]}), 1.2, 50) == []


def test_two_nodes_compare_with_each_other_and_the_faster_is_never_slow():
    [s] = find_slow(figs({"a": [0.10], "b": [0.13]}), 1.2, 50)
    assert s.node == "b"


def test_below_the_ratio_or_without_a_full_window_nothing_is_slow():
    assert find_slow(figs({"a": [0.10], "b": [0.10], "c": [0.119]}), 1.2, 50) == []
    part = [Figure("a", 0.1, 50), Figure("b", 0.1, 50), Figure("c", 0.2, 49)]
    assert find_slow(part, 1.2, 50) == []
    # one rank of a node without a full window leaves the whole node out
    assert "c" not in node_figures(part + [Figure("c", 0.2, 50)], 50)
    assert find_slow([Figure("a", 0.1, 50), Figure("c", 0.3, 50)], 1.2, 50) != []


def test_tiny_steps_and_non_numbers_are_not_judged():
    assert find_slow(figs({"a": [0.0002], "b": [0.0002], "c": [0.0009]}), 1.2, 50) == []
    assert find_slow(figs({"a": [0.1], "b": [0.1], "c": [math.nan]}), 1.2, 50) == []
    assert find_slow(figs({"a": [0.1], "b": [0.1], "c": [-1.0]}), 1.2, 50) == []


def test_a_figure_that_cannot_be_a_measurement_is_refused_and_its_node_not_judged():
    # an authentic rank reporting 1e308 s once drained its node as "inf x job median"
    got = figs({"a": [0.1], "b": [0.1], "c": [0.1, 1e308]})
    assert [s.node for s in find_slow(got, 1.2, 50)] == ["c"]  # the rule alone would
    ok, refused = screen(got, 50, elapsed_s=600.0)
    assert [r.node for r in refused] == ["c"] and "since the generation began" in refused[0].why
    assert {f.node for f in ok} == {"a", "b"} and find_slow(ok, 1.2, 50) == []
    # more own time than the generation has lasted: 25 of 50 steps of 2 s in 40 s
    ok, refused = screen(figs({"a": [0.1], "b": [2.0]}), 50, elapsed_s=40.0)
    assert [r.node for r in refused] == ["b"] and [f.node for f in ok] == ["a"]
    assert screen(figs({"a": [0.1], "b": [2.0]}), 50, elapsed_s=60.0)[1] == []
    ok, refused = screen(figs({"a": [0.1], "b": [math.inf]}), 50, elapsed_s=60.0)
    assert refused[0].why == "not a finite number"
    # no full window yet, or nothing measured: not refused, not judged either
    assert screen([Figure("a", 9.0, 10), Figure("b", -1.0, 0)], 50, 1.0) == ([], [])


def test_a_zero_reference_judges_no_node():
    assert find_slow(figs({"a": [0.0], "b": [0.0], "c": [0.05]}), 1.2, 50) == []


def sweeps(hold: Hold, per_step: list[list[Slow]], step_s: float, every: int = 5):
    """A sweep every `every` of the job's steps of `step_s` s; per_step[k]: found slow at
    step k. What each sweep confirmed and dismissed, all together."""
    confirmed, dismissed = [], []
    for k in range(0, len(per_step), every):
        c, d = hold.sweep(per_step[k], k, k * step_s)
        confirmed += c
        dismissed += d
    return confirmed, dismissed


def slow(ratio: float, job_s: float = 0.1) -> Slow:
    return Slow("n2", ratio, ratio * job_s, job_s, 50)


def test_a_loaded_machines_transient_readings_are_dismissed_not_confirmed():
    # what a loaded local cluster showed in a run without a fault: one healthy node read
    # 1.24 x, another 1.25 x, for a while (here 40 steps), then fell back
    for ratio in (1.24, 1.25):
        found = [[]] * 20 + [[slow(ratio)]] * 40 + [[]] * 100
        confirmed, [d] = sweeps(Hold(50), found, step_s=0.1 * ratio)
        assert confirmed == [] and d.held_steps < 50 and "no longer found slow" in d.why
    # a hold starts again from nothing: two spells of 30 steps are not one of 60
    found = [[slow(1.25)]] * 30 + [[]] * 5 + [[slow(1.25)]] * 30
    assert sweeps(Hold(50), found, step_s=0.125)[0] == []


def test_a_slowdown_that_holds_and_shows_in_the_jobs_step_rate_is_confirmed():
    found = [[]] * 10 + [[slow(1.5)]] * 80
    [c], [] = sweeps(Hold(50), found, step_s=0.155)  # the job runs at the slow node's pace
    assert c.held_steps == 50 and c.job_step_s == pytest.approx(0.155)
    assert c.slow.node == "n2" and c.slow.ratio == pytest.approx(1.5)


def test_a_figure_the_jobs_step_rate_does_not_show_is_dismissed():
    # the node claims 0.05 s a step more than the others, the job's steps take 0.11 s
    found = [[slow(1.5)]] * 80
    [], [d] = sweeps(Hold(50), found, step_s=0.11)
    assert d.held_steps == 50 and "step rate does not show it" in d.why


def test_the_drain_reason_is_finite_and_says_what_was_measured():
    got = drain_reason(Confirmed(Slow("n2", 1.5, 0.15, 0.1, 50), 50, 0.155))
    assert got == ("fail-slow: own time 0.15 s/step, 1.50 x the other nodes' 0.1 s, held 50 "
                   "steps (job 0.155 s/step)")
    assert "inf" not in got and "nan" not in got


def test_a_single_slow_step_on_one_node_moves_no_median():
    meters = {n: OwnTime(50) for n in "abcd"}
    for n, m in meters.items():
        own = [0.1] * 60
        if n == "c":
            own[40] = 5.0  # one step 50 x slower: a hiccup
        steps(m, own, wait=0.05)
    assert find_slow([Figure(n, *m.figure) for n, m in meters.items()], 1.2, 50) == []


# ---- what the controller takes from a heartbeat -------------------------------------------

def conn(generation: int = 0, rank: int = 0) -> Conn:
    return Conn("a", 0, "active", 1, "10.0.0.1", 1, None, None, rank=rank,  # type: ignore
                generation=generation, state=RankState.RUNNING)


@pytest.mark.parametrize("own_s,own_n,field", [(math.nan, 5, "own_s"), (math.inf, 5, "own_s"),
                                               (-0.5, 5, "own_s"), (0.1, -1, "own_n")])
def test_a_heartbeat_with_a_bad_own_time_is_refused_naming_the_field(own_s, own_n, field):
    got = refusal(conn(), P.Heartbeat(0, 0, 3, "running", own_s, own_n))
    assert got is not None and got[0] == field


def test_a_heartbeat_without_an_own_time_is_a_rank_that_measured_nothing():
    hb = P.Heartbeat(0, 0, 3, "running")
    assert (hb.own_s, hb.own_n) == (-1.0, 0) and refusal(conn(), hb) is None


# ---- settings -----------------------------------------------------------------------------

@pytest.mark.parametrize("name,value", [(C.SLOW_RATIO, "1"), (C.SLOW_RATIO, "0.9"),
                                        (C.SLOW_RATIO, "nan"), (C.SLOW_RATIO, "1e3"),
                                        (C.SLOW_WINDOW, "4"), (C.SLOW_WINDOW, "fifty"),
                                        (C.FAILSLOW, "drain")])
def test_bad_fail_slow_settings_are_refused_naming_the_variable(name, value):
    with pytest.raises(C.SettingError, match=name):
        C.read({name: value}, name)


def test_fail_slow_defaults():
    # report, not move: a rank the script gives more to do before its step's last collective
    # reads as a slow node, and a drained node stays out of later jobs
    assert (C.read({}, C.FAILSLOW), C.read({}, C.SLOW_RATIO), C.read({}, C.SLOW_WINDOW)) == \
        ("report", 1.2, 50)


# ---- the spare pool -----------------------------------------------------------------------

def test_the_pool_leaves_a_node_drained_for_slowness_to_the_admin():
    slow = node("n2", "IDLE+DRAIN", "hpct: fail-slow: 1.50 x job median over 50 steps; "
                                    "hpct: job 7 moved its ranks to n5")
    assert slow_drained(slow)
    stage, then = loop_stage(slow, in_pool=False)
    assert stage == "fail-slow: drained" and "spares return NODE" in then
    assert not slow_drained(node("n3", "IDLE+DRAIN", "hpct: job 7 moved its ranks to n5"))
    assert not slow_drained(node("n4", "IDLE", "fail-slow: old"))  # resumed by hand


# ---- the controller -----------------------------------------------------------------------

def slow_figures(c: FakeCluster, per_node: dict[str, float], n: int = 50) -> None:
    for name, own in per_node.items():
        c.rank(name).own_time = (own, n)


async def train_until(c: FakeCluster, nodes: list[str], done, step_s: float = 0.02,
                      most: int = 400) -> int:
    """Steps on `nodes` at the pace of one per `step_s` s until `done()` (or `most` steps):
    the job's step rate the controller reads. The last step trained."""
    step = c.rank(nodes[0]).step
    for _ in range(most):
        if done():
            break
        step += 1
        await c.train(nodes, step)
        await asyncio.sleep(step_s)
    return step


# Figures of a few milliseconds: a figure must fit in the time the generation has run (a
# median over 50 steps of 0.15 s claims 3.75 s of it), and these tests last a few seconds.
FAST, SLOWER = 0.010, 0.015
# The fake ranks' figures appear at once: a generation this old has room for their windows.
GROWN = 0.6


def test_a_slow_node_is_named_drained_and_moved_onto_the_spare(tmp_path, monkeypatch):
    monkeypatch.setenv(C.FAILSLOW, "move")

    async def scenario():
        async with FakeCluster(tmp_path, ["localhost", "a1", "a2", "s1"], spares=1) as c:
            await c.started()
            await c.train(["localhost", "a1", "a2"], 4)
            slow_figures(c, {"localhost": FAST, "a1": SLOWER, "a2": FAST})
            last = await train_until(c, ["localhost", "a1", "a2"],
                                     lambda: c.events("node.slow"))
            [slow] = c.events("node.slow")
            assert (slow["node"], slow["window"], slow["threshold"]) == ("a1", 50, 1.2)
            assert slow["ratio"] == pytest.approx(1.5, abs=0.02)
            assert slow["held_steps"] >= 50 and slow["job_step_s"] >= 0.02
            assert "moving its ranks onto a warm spare" in slow["action"]
            a = await c.assigned("s1", 1)
            assert a.members == ["localhost", "s1", "a2"] and a.restore_step == last
            await c.train(["localhost", "s1", "a2"], last + 1)
            [done] = await c.until(lambda: c.events("move.done"), "move.done")
            assert done["taken"] == {"a1": "s1"} and done["lost_steps"] == 0
            await c.until(lambda: "moved its ranks" in c.reason.get("a1", ""), "the reason")
            assert c.reason["a1"].startswith(
                "hpct: fail-slow: own time 0.015 s/step, 1.50 x the other nodes' 0.01 s, "
                f"held {slow['held_steps']} steps (job ")
            assert c.reason["a1"].endswith(" s/step); hpct: job 4242 moved its ranks to s1")
            assert c.events("fault.detected") == []
            assert len(c.events("node.slow")) == 1  # said once
            assert await c.finish() == 0
            assert "a1" in c.ctl.dead_nodes and "a1" not in c.ctl.world.spares
    run(scenario)


def test_without_a_spare_the_slow_node_is_drained_and_trains_on(tmp_path, monkeypatch):
    monkeypatch.setenv(C.FAILSLOW, "move")

    async def scenario():
        async with FakeCluster(tmp_path, ["localhost", "a1", "a2"], spares=0) as c:
            await c.started()
            await c.train(["localhost", "a1", "a2"], 2)
            slow_figures(c, {"localhost": FAST, "a1": FAST, "a2": 2 * FAST})
            last = await train_until(c, ["localhost", "a1", "a2"],
                                     lambda: c.events("node.slow"))
            [slow] = c.events("node.slow")
            assert slow["node"] == "a2" and "no warm spare ready" in slow["action"]
            await c.until(lambda: "fail-slow" in c.reason.get("a2", ""), "the drain")
            assert c.reason["a2"].startswith("hpct: fail-slow: own time 0.02 s/step, 2.00 x "
                                             "the other nodes' 0.01 s, held ")
            await c.until(lambda: c.events("move.skipped"), "move.skipped")
            assert c.rank("a2").stops == []
            await c.train(["localhost", "a1", "a2"], last + 2)
            assert await c.finish() == 0
    run(scenario)


@pytest.mark.parametrize("mode", ["move", None])
def test_a_job_wide_slowdown_or_part_windows_move_nothing(tmp_path, monkeypatch, mode):
    if mode:
        monkeypatch.setenv(C.FAILSLOW, mode)

    async def scenario():
        async with FakeCluster(tmp_path, ["localhost", "a1", "a2", "s1"], spares=1) as c:
            await c.started()
            await c.train(["localhost", "a1", "a2"], 2)
            slow_figures(c, {"localhost": 0.030, "a1": 0.031, "a2": 0.030})  # all slower
            slow_figures(c, {"a2": 0.09}, n=49)  # and one not judged yet
            await train_until(c, ["localhost", "a1", "a2"], lambda: False, most=70)
            await asyncio.sleep(0.5)  # sweeps and Slurm polls
            assert c.events("node.slow") == [] and c.events("move.requested") == []
            assert "a2" not in c.reason
            assert await c.finish() == 0
    run(scenario)


@pytest.mark.parametrize("mode", ["move", None])
def test_an_implausible_figure_is_refused_and_drains_nothing(tmp_path, monkeypatch, mode):
    # an authentic rank's heartbeat says 1e308 s a step: once "inf x job median", drained
    if mode:
        monkeypatch.setenv(C.FAILSLOW, mode)

    async def scenario():
        async with FakeCluster(tmp_path, ["localhost", "a1", "a2", "s1"], spares=1) as c:
            await c.started()
            await c.train(["localhost", "a1", "a2"], 2)
            await asyncio.sleep(GROWN)
            slow_figures(c, {"localhost": FAST, "a1": 1e308, "a2": FAST})
            await train_until(c, ["localhost", "a1", "a2"], lambda: False, most=70)
            [refused] = await c.until(lambda: c.events("node.slow_figure_refused"),
                                      "node.slow_figure_refused")
            assert refused["node"] == "a1" and refused["own_s"] == 1e308
            assert "since the generation began" in refused["why"]
            assert c.events("node.slow") == [] and c.events("move.requested") == []
            assert "a1" not in c.reason
            assert await c.finish() == 0
    run(scenario)


@pytest.mark.parametrize("mode", ["move", None])
def test_a_transient_reading_is_dismissed_and_drains_nothing(tmp_path, monkeypatch, mode):
    # a loaded machine: one healthy node reads 1.25 x for some 25 steps, then falls back
    if mode:
        monkeypatch.setenv(C.FAILSLOW, mode)

    async def scenario():
        async with FakeCluster(tmp_path, ["localhost", "a1", "a2", "s1"], spares=1) as c:
            await c.started()
            nodes = ["localhost", "a1", "a2"]
            await c.train(nodes, 2)
            await asyncio.sleep(GROWN)
            slow_figures(c, {"localhost": FAST, "a1": 1.25 * FAST, "a2": FAST})
            await train_until(c, nodes, lambda: False, most=25)
            slow_figures(c, {"a1": FAST})
            await train_until(c, nodes, lambda: c.events("node.slow_dismissed"))
            [d] = c.events("node.slow_dismissed")
            assert d["node"] == "a1" and d["held_steps"] < 50
            assert "no longer found slow" in d["why"]
            await train_until(c, nodes, lambda: False, most=60)
            assert c.events("node.slow") == [] and c.events("move.requested") == []
            assert "a1" not in c.reason
            assert await c.finish() == 0
    run(scenario)


@pytest.mark.parametrize("mode", ["report", "off", None])
def test_report_names_the_node_only_and_off_does_nothing(tmp_path, monkeypatch, mode):
    if mode:  # None: the default, report
        monkeypatch.setenv(C.FAILSLOW, mode)

    async def scenario():
        async with FakeCluster(tmp_path, ["localhost", "a1", "s1"], spares=1) as c:
            await c.started()
            await c.train(["localhost", "a1"], 2)
            slow_figures(c, {"localhost": FAST, "a1": 3 * FAST})
            await train_until(c, ["localhost", "a1"], lambda: c.events("node.slow"),
                              step_s=0.04, most=80)
            if mode != "off":
                [slow] = c.events("node.slow")
                assert slow["action"] == "reported only (HPCT_FAILSLOW=report)"
            await asyncio.sleep(0.5)
            assert c.events("move.requested") == [] and "a1" not in c.reason
            assert len(c.events("node.slow")) == (mode != "off")
            assert await c.finish() == 0
    run(scenario)


def test_a_job_of_pipeline_stages_measures_nothing():
    m = OwnTime(window=3)
    m.off = True  # generation.adopt_built: a mesh with a stage dimension above 1
    steps(m, [0.2] * 5, wait=0.1)
    assert m.figure == (-1.0, 0)


def test_a_node_found_slow_reads_its_slowdown_not_half_of_it():
    m = OwnTime(window=50)
    steps(m, [0.1] * 25 + [0.2] * 25, wait=0.05)  # the first moment half the window is slow
    assert m.figure == (pytest.approx(0.2), 50)    # 2 x, where a plain median said 1.5 x
