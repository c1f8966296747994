"""`hpct-slurm bench peers` without a cluster (issues 29, 44): the numbers it prints come from
every system's `bench.step` records by the same yardstick, logged at the same point of every
script's loop; tested here on recorded shapes of each peer's recovery; the crash schedule, the
seconds-lost arithmetic and the record's shape; a peer that is missing is reported with its
exact error."""
from __future__ import annotations

import ast
import json

import pytest
from test_adoption import _code as adoption_code, changed_lines as adoption_changed_lines

from hpct_slurm.bench import peers as P
from hpct_slurm.errors import HpctError

T_KILL = 100.0


def _ev(rank, step, t, world=4, committed=True, generation=0, started=50.0):
    return {"event": "bench.step", "rank": rank, "step": step, "t": t, "world": world,
            "committed": committed, "generation": generation, "started": started}


def reference(steps=12, dt=1.0):
    return [_ev(r, s, 90 + s * dt + r * 0.01) for s in range(steps) for r in range(4)]


def torchft_spare_shape():
    """Steps 0-5 by shards 0-3 (group 4 the spare, logging -1), the crash after step 5; step
    6 fails (not committed) on the survivors and is retried with the spare as shard 3: 6-11
    at full world, 1 s a step again from step 7."""
    ev = [_ev(r, s, 90 + s + r * 0.01) for s in range(6) for r in range(4)]
    ev += [_ev(-1, s, 90 + s, world=4) for s in range(6)]
    ev += [_ev(r, 6, 100.5, committed=False) for r in (0, 1, 3)]
    ev += [_ev(r, 6, 101.5 + r * 0.01) for r in range(4)]
    ev += [_ev(r, s, 101.5 + (s - 6) + r * 0.01) for s in range(7, 12) for r in range(4)]
    return ev


def torchft_relaunch_shape():
    """Steps 0-5 at 4 groups, the crash after step 5; groups 0, 1, 3 go on alone (an
    uncommitted step at the stall, then steps 6-8 at world 3); group 2 relaunched, heals at
    step 9 (its first step does not take part: -1), all four commit 10 and 11 together."""
    ev = [_ev(r, s, 90 + s + r * 0.01) for s in range(6) for r in range(4)]
    for r in (0, 1, 3):
        ev.append(_ev(r, 6, 101.0, world=3, committed=False))
        ev += [_ev(r, s, 102.0 + s - 6, world=3) for s in (6, 7, 8)]
        ev.append(_ev(r, 9, 105.0, world=3))
    ev.append(_ev(-1, 9, 105.0, world=3))
    ev += [_ev(r, s, 106.5 + (s - 10) + r * 0.1) for s in (10, 11) for r in range(4)]
    return ev


def nvrx_inprocess_shape():
    """Steps 0-5 in restart iteration 0, the crash after step 5; iteration 1 (the reserve now
    rank 3) resumes from the checkpoint of step 5: 6-11, the first one slow."""
    ev = [_ev(r, s, 90 + s + r * 0.01) for s in range(6) for r in range(4)]
    ev += [_ev(r, s, 104.0 + (s - 6) + (0.8 if s > 6 else 0) + r * 0.01, generation=1)
           for s in range(6, 12) for r in range(4)]
    return ev


def nvrx_injob_shape():
    """Steps 0-5 at restart 0, the crash after step 5; every rank restarts from the checkpoint
    of step 3 (restart 1; the spare's launcher, now rank 2, at restart 0): steps 4, 5 computed
    again, then 6-11."""
    ev = [_ev(r, s, 90 + s + r * 0.01) for s in range(6) for r in range(4)]
    ev += [_ev(r, s, 115.0 + s + r * 0.01, generation=0 if r == 2 else 1, started=110.0)
           for s in range(4, 12) for r in range(4)]
    return ev


# ---- the measuring point ---------------------------------------------------------------

def _log_step_follows_optimizer_step(text):
    """The statement right after every `opt.step()` statement of the script is a call of
    steplog.log_step (imported from hpct_slurm.bench.steplog), and there is one such place."""
    tree = ast.parse(text)
    imported = any(isinstance(n, ast.ImportFrom) and n.module == "hpct_slurm.bench.steplog"
                   and any(a.name == "log_step" for a in n.names) for n in ast.walk(tree))
    places = []
    for node in ast.walk(tree):
        body = getattr(node, "body", None)
        if not isinstance(body, list):
            continue
        for i, stmt in enumerate(body):
            call = getattr(stmt, "value", None)
            if isinstance(call, ast.Call) and isinstance(call.func, ast.Attribute) and \
                    call.func.attr == "step" and isinstance(call.func.value, ast.Name) and \
                    call.func.value.id == "opt":
                nxt = body[i + 1] if i + 1 < len(body) else None
                places.append(isinstance(nxt, ast.Expr) and isinstance(nxt.value, ast.Call)
                              and getattr(nxt.value.func, "id", None) == "log_step")
    return imported, places


@pytest.mark.parametrize("system", P.SYSTEMS)
def test_every_system_logs_its_step_right_after_the_optimizer_step(system):
    imported, places = _log_step_follows_optimizer_step(P.script_text(system))
    assert imported and places == [True], (system, places)


def test_the_measuring_point_check_fails_on_a_script_that_logs_elsewhere():
    # the earlier torchft script: the step logged after the schedule's step
    bad = ('"""doc"""\nfrom hpct_slurm.bench.steplog import log_step\n'
           "for x in y:\n    opt.step()\n    sched.step()\n    log_step(0, 0, 0.0, 4)\n")
    assert _log_step_follows_optimizer_step(bad) == (True, [False])
    # and hpct-slurm's script as adopted, without the bench's record, has none
    assert _log_step_follows_optimizer_step(P.SCRIPTS["hpct-slurm"].read_text()) == \
        (False, [False])


def test_the_script_run_for_hpct_slurm_is_adopted_inline_plus_the_step_record(tmp_path):
    ran = P.script_text("hpct-slurm").splitlines()
    adopted = P.SCRIPTS["hpct-slurm"].read_text().splitlines()
    assert [ln for ln in ran if not ln.endswith("# bench")] == adopted
    assert len(ran) == len(adopted) + 2
    compile(P.script_text("hpct-slurm"), "hpct_inline.py", "exec")


def test_the_changed_lines_are_the_adoption_tests_count_without_the_bench_lines():
    plain = adoption_code(P.PLAIN)
    for system, script in P.SCRIPTS.items():
        mine = [ln for ln in adoption_code(script) if not ln.rstrip().endswith("# bench")]
        assert P.script_changes(system) == adoption_changed_lines(plain, mine, True)
    assert P.script_changes("hpct-slurm") == 8
    # the peers' scripts keep their instrumentation on marked lines only
    for system in P.SYSTEMS[1:]:
        assert not [ln for ln in P._code(P.SCRIPTS[system]) if "steplog" in ln
                    or "log_step" in ln or "start_barrier" in ln]


# ---- the crashes -----------------------------------------------------------------------

def test_the_crash_schedule_comes_from_the_seed_alone_and_spans_a_step():
    cfg = P.Config(epochs=20, kill_at=40, step_sleep=0.25, crashes=40)
    first, again = P.schedule(cfg), P.schedule(cfg)
    assert first == again and len(first) == 40
    assert all(40 <= c.after_step < 40 + cfg.spread and 0 <= c.fraction < 1 for c in first)
    # uniform over the step, one crash in each 40th of it: early and late moments both
    assert sorted(int(c.fraction * 40) for c in first) == list(range(40))
    five = P.schedule(P.FULL)
    assert sorted(int(c.fraction * 5) for c in five) == [0, 1, 2, 3, 4]
    assert max(c.fraction for c in five) >= 0.8  # the forward, backward and all-reduce
    other = P.schedule(P.Config(epochs=20, kill_at=40, step_sleep=0.25, crashes=40, seed=45))
    assert other != first
    assert len(P.schedule(P.FULL)) >= 5


# ---- the yardstick ---------------------------------------------------------------------

def test_seconds_lost_counts_wall_time_and_skipped_batches_at_the_reference_pace():
    # 3 s longer, 4 batches skipped at 1 s a step of 4 batches: 1 s more
    assert P.seconds_lost(14.0, 11.0, 4, 1.0) == pytest.approx(4.0)
    assert P.seconds_lost(11.0, 11.0, 0, 1.0) == 0.0
    # training on without the lost batches is not free: 2 s saved, 12 batches = 3 s
    assert P.seconds_lost(9.0, 11.0, 12, 1.0) == pytest.approx(1.0)


def test_torchft_spare_is_back_at_the_retried_step_and_back_to_speed_a_step_later():
    ref = reference()
    rec = P.analyse("torchft", torchft_spare_shape(), ref, T_KILL, 11)
    assert rec["back_to_full_world_s"] == pytest.approx(101.53 - T_KILL)
    # step 6 took 101.53 - 95.03: slow; step 7 took 1 s: at speed
    assert rec["back_to_speed_s"] == pytest.approx(102.53 - T_KILL)
    assert rec["lost_steps"] == 0 and rec["skipped_batches"] == 0  # the spare's -1 not a rank
    assert rec["k_last"] == 5
    assert rec["seconds_lost"] == pytest.approx((106.53 - 95.03) - 6 * 1.0)
    # the pace is the run's own before the crash: a reference run that ran slower (another
    # moment of a loaded machine) does not make the loss negative; it is kept beside
    slow_ref = reference(dt=1.5)
    again = P.analyse("torchft", torchft_spare_shape(), slow_ref, T_KILL, 11)
    assert again["seconds_lost"] == rec["seconds_lost"] and again["pace_s"] == 1.0
    assert again["seconds_lost_vs_reference"] == pytest.approx(11.5 - 6 * 1.5)


def test_torchft_relaunch_counts_the_reduced_world_steps_as_skipped_batches():
    rec = P.analyse("torchft-relaunch", torchft_relaunch_shape(), reference(), T_KILL, 11)
    assert rec["back_to_full_world_s"] == pytest.approx(106.8 - T_KILL)  # step 10, rank 3
    assert rec["lost_steps"] == 0
    assert (rec["reduced_world_steps"], rec["skipped_batches"]) == (4, 4)  # 6-9, 1 each
    assert rec["seconds_lost"] == pytest.approx((107.8 - 90.0) - (101.03 - 90.0) + 4 * 1 / 4)


def test_torchft_never_back_at_full_world_is_an_error_not_a_number():
    ev = [e for e in torchft_relaunch_shape() if e["step"] < 10]
    with pytest.raises(HpctError, match=r"rank\(s\) \[0, 1, 2, 3\]"):
        P.analyse("torchft-relaunch", ev + [_ev(r, 11, 108.0, world=3) for r in (0, 1, 3)],
                  reference(), T_KILL, 11)


def test_nvrx_inprocess_is_back_in_the_next_restart_iteration():
    rec = P.analyse("nvrx", nvrx_inprocess_shape(), reference(), T_KILL, 11)
    assert rec["back_to_full_world_s"] == pytest.approx(104.03 - T_KILL)
    # step 7 took 1.8 s (slow), step 8 1 s
    assert rec["back_to_speed_s"] == pytest.approx(106.83 - T_KILL)
    assert rec["lost_steps"] == 0 and rec["skipped_batches"] == 0


def test_the_loss_is_counted_up_to_the_step_back_at_speed_not_the_load_after_it():
    rec = P.analyse("nvrx", nvrx_inprocess_shape(), reference(), T_KILL, 11)
    # from step 5's end (95.03) to step 8's (106.83), 3 steps at 1 s
    assert rec["at_speed_step"] == 8
    assert rec["seconds_lost"] == pytest.approx(106.83 - 95.03 - 3)
    # other engineers' load slows the steps after it by 8 % (within the 10 %): no loss
    drift = nvrx_inprocess_shape()
    for e in drift:
        if e["step"] > 8:
            e["t"] += (e["step"] - 8) * 0.08
    again = P.analyse("nvrx", drift, reference(), T_KILL, 11)
    assert again["seconds_lost"] == rec["seconds_lost"]
    assert again["seconds_lost_vs_reference"] > rec["seconds_lost_vs_reference"]


def test_nvrx_injob_counts_recomputed_steps_and_a_missing_rank_is_an_error():
    rec = P.analyse("nvrx-injob", nvrx_injob_shape(), reference(), T_KILL, 11)
    assert rec["back_to_full_world_s"] == pytest.approx(121.03 - T_KILL)  # step 6
    assert rec["lost_steps"] == 2  # steps 4 and 5
    ev = [e for e in nvrx_injob_shape() if not (e["rank"] == 1 and e["started"] > T_KILL)]
    with pytest.raises(HpctError, match=r"rank\(s\) \[1\]"):
        P.analyse("nvrx-injob", ev, reference(), T_KILL, 11)


def test_never_back_to_speed_is_an_error():
    slow = [e for e in nvrx_inprocess_shape()]
    for e in slow:
        if e["generation"] == 1:
            e["t"] = 104.0 + (e["step"] - 6) * 2.0 + e["rank"] * 0.01  # 2 s a step
    with pytest.raises(HpctError, match="never back to speed"):
        P.analyse("nvrx", slow, reference(), T_KILL, 11)


# ---- the record ------------------------------------------------------------------------

def test_the_summary_has_median_and_range_and_the_ratio_reads_the_medians():
    runs = [{"seconds_lost": s, "back_to_full_world_s": s / 2, "back_to_speed_s": s,
             "lost_steps": 0, "skipped_batches": 0, "bitwise_equal": True}
            for s in (1.0, 3.0, 2.0)] + [{"error": "boom"}]
    out = P.summarise(runs)
    assert out["seconds_lost_median"] == 2.0 and out["seconds_lost_range"] == [1.0, 3.0]
    assert out["failed_runs"] == 1 and out["bitwise_equal"] is True and len(out["runs"]) == 4
    peer = P.summarise([dict(r, seconds_lost=r["seconds_lost"] * 5) for r in runs[:3]])
    assert P.ratios({"hpct-slurm": out, "torchft": peer}) == {"torchft": 5.0}
    failed = P.summarise([{"error": "boom"}])
    assert failed["error"] == "boom" and "seconds_lost_median" not in failed


class _NoCluster:
    def heal(self):
        pass


def test_a_missing_peer_carries_its_exact_error_and_the_others_still_run(monkeypatch,
                                                                           tmp_path):
    monkeypatch.setitem(P.PACKAGES, "torchft", ("torchft_not_here", "torchft"))
    # whether or not NVRx is installed here, a package that is: the peer that can run must run
    monkeypatch.setitem(P.PACKAGES, "nvrx", ("torch", "torch"))
    monkeypatch.setitem(P.PACKAGES, "nvrx-injob", ("torch", "torch"))
    ran = []
    keys = {"runs": [], "seconds_lost_median": 1.0, "back_to_speed_s_median": 1.0,
            "lost_steps_median": 0, "bitwise_equal": True}
    monkeypatch.setattr(P, "measure", lambda cluster, system, work, cfg:
                        ran.append(system) or P.version(system) and
                        dict(keys, given=P.configuration(cfg)[system]))
    out = P.compare(_NoCluster(), tmp_path, P.QUICK, P.SYSTEMS)
    assert out["torchft"]["error"] == ("torchft: ModuleNotFoundError: No module named "
                                       "'torchft_not_here'; " + P.INSTALL_HINT)
    assert out["torchft"]["changed_lines"] == P.script_changes("torchft")
    assert ran == list(P.SYSTEMS) and "error" not in out["nvrx"]
    summary = P.write(tmp_path / "out", out, P.QUICK, True, tmp_path, 0.0,
                      load=((1.0, 2.0, 3.0), (1.5, 2.0, 3.0)))
    # the command's last line: every system, each with its runs, medians and given settings
    line = json.loads(json.dumps(summary))
    assert list(line["systems"]) == list(P.SYSTEMS)
    for name in ("hpct-slurm", "torchft-relaunch", "nvrx", "nvrx-injob"):
        assert set(line["systems"][name]) >= {"runs", "seconds_lost_median",
                                              "back_to_speed_s_median", "lost_steps_median",
                                              "bitwise_equal", "given"}
    assert all(line["systems"][n]["given"] for n in P.SYSTEMS)
    record = json.loads(open(summary["json"]).read())
    assert record["load_avg_1_5_15"]["before"] == [1.0, 2.0, 3.0]
    assert record["schedule"] == [{"after_step": c.after_step, "fraction": c.fraction}
                                  for c in P.schedule(P.QUICK)]
    assert (tmp_path / "out" / "peers.png").exists()


def test_reanalyse_derives_the_numbers_again_from_the_runs_records(tmp_path):
    def run_dir(name, events):
        d = tmp_path / name
        (d / "events").mkdir(parents=True)
        (d / "events" / "n1-bench1.jsonl").write_text(
            "".join(json.dumps(e) + "\n" for e in events))
        (d / "results").mkdir()
        for r in range(4):
            (d / "results" / f"rank{r}.json").write_text(json.dumps({"params_sha256": "a"}))
        return d
    ref, crash = run_dir("ref", reference()), run_dir("crash", nvrx_inprocess_shape())
    cfg = P.Config(epochs=1, kill_at=5, step_sleep=0.0, crashes=1)
    stale = {"seconds_lost": 99.0, "back_to_full_world_s": 1.0, "back_to_speed_s": 1.0,
             "lost_steps": 0, "skipped_batches": 0, "bitwise_equal": True, "t_kill": T_KILL,
             "run_dir": str(crash), "after_step": 5, "fraction": 0.5, "moment": 0.5}
    system = dict(P.summarise([stale]), reference_dir=str(ref), given={"mode": "x"})
    P.write(tmp_path, {"nvrx": system}, cfg, True, tmp_path, 1.0)
    # STEPS_PER_EPOCH 8 x 1 epoch: the last step is 7 here
    out = P.reanalyse(tmp_path / "peers.json")
    run, = out["systems"]["nvrx"]["runs"]
    assert run["seconds_lost"] == pytest.approx(106.83 - 95.03 - 3)
    assert run["bitwise_equal"] is True and run["t_kill"] == T_KILL
    assert out["systems"]["nvrx"]["seconds_lost_median"] == run["seconds_lost"]
    assert out["systems"]["nvrx"]["given"] == {"mode": "x"}
