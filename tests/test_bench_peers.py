"""`hpct-slurm bench peers` without a cluster (issue 29): the numbers it prints come from the
ranks' step events by the same yardstick for every system, tested here on recorded shapes of
each peer's recovery; a peer that is missing is reported with its exact error."""
from __future__ import annotations

import pytest
from test_adoption import _code as adoption_code, changed_lines as adoption_changed_lines

from hpct_slurm.bench import peers as P
from hpct_slurm.errors import HpctError

T_KILL = 100.0


def _ev(rank, step, t, world=4, committed=True, generation=0, started=50.0):
    return {"event": "rank.step", "rank": rank, "step": step, "t": t, "world": world,
            "committed": committed, "generation": generation, "started": started}


def torchft_shape():
    """Steps 0-5 at 4 groups, the crash after step 5; groups 0, 1, 3 go on alone (an
    uncommitted step at the stall, then steps 6-8 at world 3); group 2 relaunched, heals at
    step 9 (its first step does not participate), all four commit 10 and 11 together."""
    ev = [_ev(r, s, 90 + s) for s in range(6) for r in range(4)]
    for r in (0, 1, 3):
        ev.append(_ev(r, 5, 101.0, world=3, committed=False))
        ev += [_ev(r, s, 102.0 + s - 6, world=3) for s in (6, 7, 8)]
        ev.append(_ev(r, 9, 106.0, world=3))
    ev.append(_ev(2, 9, 106.5, world=3))
    ev += [_ev(r, s, 107.0 + (s - 10) + r * 0.1) for s in (10, 11) for r in range(4)]
    return ev


def nvrx_shape():
    """Steps 0-5 at restart 0, the crash after step 5; every rank restarts from the checkpoint
    of step 3 (restart 1; the spare's launcher, now rank 2, starts its first worker: restart
    0): steps 3, 4, 5 computed again, then 6 and 7."""
    ev = [_ev(r, s, 90 + s) for s in range(6) for r in range(4)]
    ev += [_ev(r, s, 115.0 + s + r * 0.2, generation=0 if r == 2 else 1, started=110.0)
           for s in range(3, 8) for r in range(4)]
    return ev


def test_the_changed_lines_are_the_adoption_tests_count_without_the_bench_lines():
    plain = adoption_code(P.PLAIN)
    for system, script in P.SCRIPTS.items():
        mine = [ln for ln in adoption_code(script) if not ln.rstrip().endswith("# bench")]
        assert P.script_changes(system) == adoption_changed_lines(plain, mine, True)
    assert P.script_changes("hpct-slurm") == 8
    # the peers' scripts keep their instrumentation on marked lines only: nothing unmarked
    # mentions the bench
    for system in ("torchft", "nvrx"):
        assert not [ln for ln in P._code(P.SCRIPTS[system]) if "peer_hooks" in ln
                    or "log_step" in ln or "start_barrier" in ln]


def test_torchft_is_back_when_every_group_commits_a_full_world_step():
    ev = torchft_shape()
    took, k_last = P.yardstick("torchft", None, ev, T_KILL)
    assert k_last == 5
    assert took == pytest.approx(107.3 - T_KILL)  # step 10: group 3 last, at 107.3
    assert P.recomputed(ev) == 0                  # the uncommitted step is no recompute
    assert P.reduced([e for e in ev if e["t"] > T_KILL], 4) == (4, 4)  # steps 6-9, 1 each


def test_torchft_never_back_at_full_world_is_an_error_not_a_number():
    ev = [e for e in torchft_shape() if e["rank"] != 2 or e["t"] < T_KILL]
    ev = [e for e in ev if e["step"] < 10]
    with pytest.raises(HpctError, match=r"rank\(s\) \[0, 1, 2, 3\]"):
        P.yardstick("torchft", None, ev, T_KILL)


def test_nvrx_is_back_when_every_restarted_rank_completes_a_step_after_the_crash():
    ev = nvrx_shape()
    took, k_last = P.yardstick("nvrx", None, ev, T_KILL)
    assert k_last == 5
    assert took == pytest.approx(115.0 + 6 + 0.6 - T_KILL)  # step 6, rank 3
    assert P.recomputed(ev) == 3                 # steps 3, 4, 5
    assert P.reduced(ev, 4) == (0, 0)


def test_nvrx_rank_missing_after_the_restart_is_an_error():
    ev = [e for e in nvrx_shape() if not (e["rank"] == 1 and e["started"] > T_KILL)]
    with pytest.raises(HpctError, match=r"rank\(s\) \[1\]"):
        P.yardstick("nvrx", None, ev, T_KILL)


def test_goodput_counts_skipped_batches_and_lost_time():
    ref = [_ev(r, s, 90 + s) for s in range(12) for r in range(4)]  # 1 s a step
    ev = torchft_shape()
    # window: steps 6..11 (6 steps, 24 batches); trained 3+3+3+3+4+4 = 20 (step 9: the
    # healing group logged it, but did not participate); reference 6 s (95 -> 101); this run
    # 108.3 - 95 = 13.3 s (from step 5, the last before the crash, in both)
    assert P.goodput(ev, ref, 5, T_KILL, 11, 4) == pytest.approx(20 / 24 * 6 / 13.3)
    # NVRx: steps 3-5 computed again after the crash; the window still starts at step 5's
    # first completion (95), and ends at step 7's (122.6 + 0.6)
    assert P.goodput(nvrx_shape(), ref[:32], 5, T_KILL, 7, 4) == \
        pytest.approx(1.0 * 2 / (115.0 + 7 + 0.6 - 95))
    same = [_ev(r, s, 90 + s) for s in range(12) for r in range(4)]
    assert P.goodput(same, ref, 5, 95.0, 11, 4) == pytest.approx(1.0)


class _NoCluster:
    def heal(self):
        pass


def test_a_missing_peer_carries_its_exact_error_and_the_others_still_run(monkeypatch,
                                                                           tmp_path):
    monkeypatch.setitem(P.PACKAGES, "torchft", ("torchft_not_here", "torchft"))
    # whether or not NVRx is installed here (scripts/setup.sh installs torchft alone), a
    # package that is: the peer that can run must still run
    monkeypatch.setitem(P.PACKAGES, "nvrx", ("torch", "torch"))
    ran = []
    monkeypatch.setattr(P, "measure", lambda cluster, system, work, cfg:
                        ran.append(system) or P.version(system) and {"back_to_speed_s": 1.0})
    out = P.compare(_NoCluster(), tmp_path, P.QUICK, P.SYSTEMS)
    assert out["torchft"]["error"] == ("torchft: ModuleNotFoundError: No module named "
                                       "'torchft_not_here'; " + P.INSTALL_HINT)
    assert out["torchft"]["changed_lines"] == P.script_changes("torchft")
    assert ran == list(P.SYSTEMS) and "error" not in out["nvrx"]
    summary = P.write(tmp_path / "out", out, P.QUICK, True, tmp_path, 0.0)
    assert summary["systems"] == out and (tmp_path / "out" / "peers.png").exists()
