"""The controller's pure decisions: allocation split, replacement, restore step, shrink."""
from __future__ import annotations

import dataclasses

import pytest
from hypothesis import given
from hypothesis import strategies as st

from hpct_slurm.controller.policy import (PHASES, Action, Held, RecoveryRecord, SurvivorReport,
                                          World, data_ranks, decide_recovery, initial_shards,
                                          plan_restore, replace, shrink, split_allocation)
from hpct_slurm.errors import HpctError

NODES = [f"n{i}" for i in range(1, 9)]


def test_split_keeps_the_batch_host_active_and_the_rest_as_spares():
    assert split_allocation(["n1", "n2", "n3", "n4", "n5"], "n3", spares=1) == \
        (["n3", "n1", "n2", "n4"], ["n5"])
    assert split_allocation(["n1", "n2", "n3"], "n1", spares=0, active=2) == \
        (["n1", "n2"], ["n3"])


@pytest.mark.parametrize("kwargs, message", [
    ({"spares": -1}, "must not be negative"),
    ({"spares": 3}, "cannot keep 3 spare"),
    ({"spares": 0, "active": 4}, "--active 4 but the allocation has only 3"),
    ({"spares": 0, "active": 0}, "--active 0 must be at least 1"),
])
def test_split_refuses_impossible_layouts(kwargs, message):
    with pytest.raises(HpctError, match=message):
        split_allocation(["n1", "n2", "n3"], "n1", **kwargs)


def test_split_refuses_a_batch_host_outside_the_allocation():
    with pytest.raises(HpctError, match="batch host 'x9'"):
        split_allocation(["n1", "n2"], "x9", spares=0)


@given(st.integers(2, 8), st.integers(1, 4), st.data())
def test_replacement_keeps_every_position_and_rank(n_active, tpn, data):
    active, spares = NODES[:n_active], NODES[n_active:]
    world = World(list(active), list(spares), tpn)
    lost = data.draw(st.lists(st.sampled_from(active), unique=True, max_size=len(spares)))
    rep = replace(world, lost, spares)
    assert len(rep.members) == n_active and rep.generation == 1
    for i, node in enumerate(active):
        new = rep.members[i]
        assert (new == node) == (node not in lost)  # only lost positions change hands
    assert set(rep.taken) == set(lost) and not set(rep.taken.values()) & set(rep.spares)


def test_replacement_without_enough_spares_is_refused():
    with pytest.raises(HpctError, match=r"2 node\(s\) lost \(n2, n3\) but only 1 warm spare"):
        replace(World(["n1", "n2", "n3"], ["n4"], 1), ["n2", "n3"], ["n4"])


def _held(own=(), rank_own=(), replicas=None):
    return Held(frozenset(own), frozenset(rank_own),
                {r: frozenset(v) for r, v in (replicas or {}).items()})


def test_restore_step_is_the_newest_every_survivor_holds():
    # a fault mid-step: ranks 0 and 3 committed 12, rank 1 only 11; rank 2 is lost (DDP)
    held = {0: _held([11, 12]), 1: _held([10, 11]), 3: _held([11, 12])}
    plan = plan_restore({r: r for r in range(4)}, held, mode="jit", rank_state=False)
    assert plan.step == 12 and plan.sources == {0: "own", 1: "peer", 2: "peer", 3: "own"}


def test_per_rank_state_limits_the_step_to_what_the_lost_rank_left():
    # ring replica of rank 2 (on rank 0) holds only 34; rank 2 itself is gone
    held = {0: _held([34, 35], [34, 35], {2: [33, 34]}), 1: _held([34, 35], [34, 35]),
            3: _held([34, 35], [34, 35])}
    plan = plan_restore({r: r for r in range(4)}, held, mode="jit", rank_state=True)
    assert plan.step == 34 and plan.sources[2] == "peer" and not plan.from_disk


def test_owner_and_holder_lost_together_falls_back_to_the_newest_persisted_step():
    # issue 19: ranks 1 and 2 lost; rank 2's replica lived on rank 1. Memory holds 35, disk
    # has rank 2's own state at 30 only: 30 for everyone, stated as a disk fallback, not 35
    # and never -1.
    held = {0: _held([34, 35], [34, 35]), 3: _held([34, 35], [34, 35], {1: [34, 35]})}
    plan = plan_restore({r: r for r in range(4)}, held, mode="jit", rank_state=True,
                        disk_shared={20, 30}, disk_rank={r: {20, 30} for r in range(4)})
    assert plan.step == 30 and plan.from_disk == [0, 1, 2, 3]


def test_no_consistent_state_is_an_error_not_a_restart_from_scratch():
    held = {0: _held([34, 35], [34, 35]), 3: _held([34, 35], [34, 35])}
    with pytest.raises(HpctError, match=r"rank\(s\) \[1, 2\] have no copy"):
        plan_restore({r: r for r in range(4)}, held, mode="jit", rank_state=True)
    # mid-run, the state at creation is no way out: survivors no longer hold it
    with pytest.raises(HpctError, match=r"at step 35 .* rank\(s\) \[1, 2\]"):
        plan_restore({r: r for r in range(4)},
                     {0: _held([34, 35], [34, 35]), 3: _held([34, 35], [34, 35])},
                     mode="jit", rank_state=True, disk_rank={1: {30}})


def test_a_fault_while_the_first_group_forms_starts_everyone_at_creation():
    # nobody trained or restored anything yet: every process stands at its creation state
    plan = plan_restore({r: r for r in range(4)}, {0: _held(), 1: _held(), 3: _held()},
                        mode="jit", rank_state=True)
    assert plan.step == -1 and set(plan.sources.values()) == {"creation"}


def test_a_fault_in_step_zero_restores_the_state_at_creation():
    # survivors hold their creation snapshot (-1); the newcomer's own state at creation is
    # its constructor's, so it needs no copy of it
    held = {0: _held([-1], [-1]), 1: _held([-1], [-1]), 3: _held([-1], [-1])}
    plan = plan_restore({r: r for r in range(4)}, held, mode="jit", rank_state=True)
    assert plan.step == -1 and plan.sources[2] == "creation"


def test_a_newcomer_whose_restore_failed_holds_nothing():
    # an in-place round: the newcomer at rank 2 reports empty holdings; it must not pull the
    # restore step down to -1 (issue 19) nor count as a source
    held = {0: _held([34, 35], [34, 35], {3: [34, 35]}), 1: _held([34, 35], [34, 35]),
            2: _held(), 3: _held([34, 35], [34, 35], {2: [34, 35]})}
    plan = plan_restore({r: r for r in range(4)}, held, mode="jit", rank_state=True)
    assert plan.step == 35 and plan.sources[2] == "peer"


def test_replicated_mode_needs_the_ranks_own_copy():
    held = {0: _held([5, 6]), 1: _held([5, 6], replicas={0: [5, 6]}),
            2: _held([5, 6], replicas={1: [6]})}
    plan = plan_restore({0: 0, 1: 1, 2: 2, 3: 3}, {**held, 3: _held([6], replicas={2: [6]})},
                        mode="replicated", rank_state=True)
    assert plan.step == 6
    with pytest.raises(HpctError, match=r"\[1\]"):  # rank 1 lost, its replica only at 6... gone
        plan_restore({0: 0, 1: 1, 2: 2}, {0: _held([5, 6]), 2: _held([5, 6])},
                     mode="replicated", rank_state=False)


def test_replicated_mode_falls_back_to_disk_when_a_rank_and_its_ring_holder_are_lost():
    """Issue 30.2: FSDP (replicated), ranks 1 and 3 lost together (3 held 1's ring copy, 1 held
    3's): memory cannot serve them, but every key's step 30 is on disk. The group restores
    30 in place, every rank from disk where memory no longer has it, instead of a requeue
    that would restore the same files ("no copy in memory or on disk" was false)."""
    needs = {r: r for r in range(4)}
    held = {0: _held([33, 34], replicas={2: [33, 34]}), 2: _held([33, 34], replicas={0: [34]})}
    disk = {k: {20, 30} for k in range(4)}
    plan = plan_restore(needs, held, mode="replicated", rank_state=False, disk_shared=disk,
                        shard_keys=[0, 1, 2, 3])
    assert plan.step == 30 and set(plan.sources.values()) == {"disk"}
    # with per-rank state, its file must be there too
    plan = plan_restore(needs, held, mode="replicated", rank_state=True, disk_shared=disk,
                        disk_rank={r: {30} for r in range(4)}, shard_keys=[0, 1, 2, 3])
    assert plan.step == 30
    with pytest.raises(HpctError, match="no step is held for every rank"):
        plan_restore(needs, held, mode="replicated", rank_state=True, disk_shared=disk,
                     disk_rank={0: {30}, 2: {30}, 3: {30}}, shard_keys=[0, 1, 2, 3])


@given(st.integers(2, 6), st.integers(0, 20), st.data())
def test_the_plan_is_reachable_by_every_rank(world, newest, data):
    """Property: whatever is held, the chosen step is one every rank has a copy of."""
    needs = {r: r for r in range(world)}
    steps = st.frozensets(st.integers(-1, newest), max_size=3)
    held = {r: Held(data.draw(steps), data.draw(steps),
                    {q: data.draw(steps) for q in data.draw(st.sets(st.sampled_from(
                        list(range(world))), max_size=2))})
            for r in data.draw(st.sets(st.sampled_from(list(range(world))), min_size=1))}
    disk = data.draw(steps)
    disk_rank = {r: data.draw(steps) for r in range(world)}

    try:
        plan = plan_restore(needs, held, mode="jit", rank_state=True, disk_shared=disk,
                            disk_rank=disk_rank)
    except HpctError:
        return
    for r in range(world):
        mine = held.get(r)
        newcomer_at_creation = plan.step == -1 and (mine is None or not (mine.own or mine.rank_own))
        shared = any(plan.step in h.own for h in held.values()) or plan.step in disk \
            or newcomer_at_creation
        own = (mine is not None and plan.step in mine.rank_own) \
            or any(plan.step in h.replicas.get(r, ()) for h in held.values()) \
            or plan.step in disk_rank[r] or newcomer_at_creation
        assert shared and own, (r, plan)


@given(st.integers(2, 8), st.integers(1, 3), st.data())
def test_shrink_keeps_every_data_shard_exactly_once(n_active, tpn, data):
    active = NODES[:n_active]
    world = World(list(active), [], tpn)
    shards = initial_shards(active)
    lost = data.draw(st.lists(st.sampled_from(active), unique=True, min_size=1,
                              max_size=n_active - 1))
    rep, new = shrink(world, lost, shards)
    assert rep.members == [n for n in active if n not in lost]
    owned = sorted(p for n in rep.members for p in new[n])
    assert owned == list(range(n_active))
    ranks = sorted(r for n in rep.members for j in range(tpn)
                   for r in data_ranks(new[n], j, tpn))
    assert ranks == list(range(n_active * tpn))  # the global batch is unchanged


def test_shrink_with_nothing_left_is_refused():
    with pytest.raises(HpctError, match="every active node is lost"):
        shrink(World(["n1"], [], 1), ["n1"], initial_shards(["n1"]))


def test_controller_defaults_come_from_the_spank_options():
    from hpct_slurm.controller.cli import defaults_from_spank

    assert defaults_from_spank(None, None, {}) == (1, "rootless")
    env = {"HPCT_SPARES": "2", "HPCT_STORE": "tcpstore"}
    assert defaults_from_spank(None, None, env) == (2, "tcpstore")
    assert defaults_from_spank(0, "rootless", env) == (0, "rootless")  # the command line wins
    # the name a SPANK plugin built before the rename exports, for one release
    assert defaults_from_spank(None, None, {"HPCT_RENDEZVOUS": "tcpstore"}) == (1, "tcpstore")
    with pytest.raises(HpctError, match="HPCT_SPARES 'two'"):
        defaults_from_spank(None, None, {"HPCT_SPARES": "two"})
    with pytest.raises(HpctError, match="HPCT_STORE 'etcd' is not one of rootless, tcpstore"):
        defaults_from_spank(None, None, {"HPCT_STORE": "etcd"})
    with pytest.raises(HpctError, match="HPCT_RENDEZVOUS 'etcd'"):
        defaults_from_spank(None, None, {"HPCT_RENDEZVOUS": "etcd"})


def test_progress_timeout_comes_from_the_environment_and_is_checked():
    from hpct_slurm import config as C

    assert C.read({}, C.PROGRESS_TIMEOUT_S) == 300.0
    assert C.read({"HPCT_PROGRESS_TIMEOUT_S": "4"}, C.PROGRESS_TIMEOUT_S) == 4.0
    for bad in ("abc", "0", "-3", "nan"):
        with pytest.raises(C.SettingError, match=f"HPCT_PROGRESS_TIMEOUT_S '{bad}' is not a "
                                                 f"positive number of seconds"):
            C.read({"HPCT_PROGRESS_TIMEOUT_S": bad}, C.PROGRESS_TIMEOUT_S)


# ---- one recovery round: decide_recovery ------------------------------------------------------

def _world(active=("n1", "n2", "n3"), spares=("s1", "s2"), generation=0) -> World:
    return World(list(active), list(spares), 1, generation)


def _report(node, rank, own=(4, 5), rank_own=(), replicas=None, **kw) -> SurvivorReport:
    return SurvivorReport(node, 0, _held(own, rank_own, replicas), rank, **kw)


def _survivors(world, lost, **kw):
    return [_report(n, i, **kw) for i, n in enumerate(world.members) if n not in lost]


def test_a_planned_move_counts_what_the_leaving_rank_itself_holds():
    """Issue 17: n2 leaves alive. It finished step 5 and pushed its position for 5 to its ring
    holder n3 (rank 2) after n3 had already sent its Holdings (they listed 4): counting only the
    holder would restore 4 and lose a step. The leaving rank serves its own copy: 5."""
    w = _world()
    reports = [_report("n1", 0, rank_own=(4, 5), rank_state=True),
               _report("n2", 1, rank_own=(4, 5), rank_state=True),
               _report("n3", 2, rank_own=(4, 5), replicas={1: (3, 4)}, rank_state=True)]
    moved = decide_recovery(w, ["n2"], ["s1"], initial_shards(w.members), reports,
                            leaving={"n2"})
    assert moved.restore_step == 5 and moved.plan.sources[1] == "peer"
    # a fault (nobody leaving alive): a lost rank's copies are not counted, whatever its report
    lost = decide_recovery(w, ["n2"], ["s1"], initial_shards(w.members), reports)
    assert lost.restore_step == 4
    # replicated mode: the leaving rank's whole state, not only its position
    rep = [dataclasses.replace(r, mode="replicated") for r in reports]
    assert decide_recovery(w, ["n2"], ["s1"], initial_shards(w.members), rep,
                           leaving={"n2"}).restore_step == 5
    assert decide_recovery(w, ["n2"], ["s1"], initial_shards(w.members),
                           rep).restore_step == 4


def test_a_lost_member_is_replaced_by_the_first_ready_spare():
    w = _world()
    d = decide_recovery(w, ["n2"], ["s1", "s2"], initial_shards(w.members),
                        _survivors(w, ["n2"]))
    assert (d.action, d.lost, d.taken, d.restore_step) == (Action.REPLACE, ["n2"],
                                                           {"n2": "s1"}, 5)
    assert d.replacement.members == ["n1", "s1", "n3"] and d.replacement.generation == 1
    assert d.spares == ["s2"] and d.shards == {"n1": [0], "n3": [2], "s1": [1]}
    assert d.plan.sources == {0: "own", 1: "peer", 2: "own"}
    assert not d.escalates and not d.shrunk and d.reason == "s1 takes n2's place"
    assert w.members == ["n1", "n2", "n3"]  # pure: the world is the caller's to change


def test_nothing_lost_restarts_everyone_in_place():
    w = _world()
    d = decide_recovery(w, [], ["s1"], initial_shards(w.members), _survivors(w, []))
    assert (d.action, d.taken, d.restore_step) == (Action.REPLACE, {}, 5)
    assert d.replacement.members == w.members and d.spares == ["s1", "s2"]
    assert d.reason == "every rank restarts in place"


@pytest.mark.parametrize("on_no_spare, action", [("requeue", Action.REQUEUE),
                                                 ("fail", Action.FAIL)])
def test_more_lost_than_ready_spares_escalates_per_on_no_spare(on_no_spare, action):
    w = _world()
    d = decide_recovery(w, ["n2", "n3"], ["s1"], initial_shards(w.members),
                        _survivors(w, ["n2", "n3"]), on_no_spare=on_no_spare)
    assert d.action == action and d.escalates and not d.script
    assert d.reason == "2 node(s) lost (n2, n3) but only 1 warm spare(s) ready"
    assert d.replacement is None and d.plan is None


def test_no_spare_with_shrink_spreads_the_lost_shards_over_the_survivors():
    w = _world(spares=())
    d = decide_recovery(w, ["n2"], [], initial_shards(w.members), _survivors(w, ["n2"]),
                        on_no_spare="shrink")
    assert d.action == Action.SHRINK and d.shrunk and not d.escalates
    assert d.replacement.members == ["n1", "n3"] and d.taken == {}
    assert d.shards == {"n1": [0, 1], "n3": [2]}
    # a shrink renumbers the survivors: n3 (rank 2) is rank 1 now and restores its own state
    assert d.restore_step == 5 and d.plan.sources == {0: "own", 1: "own"}
    assert "1 node(s) lost (n2), 0 warm spare(s) ready" in d.reason


def test_a_shrink_onto_nothing_escalates():
    w = _world(spares=())
    d = decide_recovery(w, list(w.members), [], initial_shards(w.members), [],
                        on_no_spare="shrink")
    assert d.action == Action.FAIL and "nothing to shrink onto" in d.reason


def test_both_holders_of_a_ranks_state_lost_escalates_to_requeue():
    # n2's per-rank state lived on n2 and its ring copy on n3: both are lost
    w = _world()
    survivors = [_report("n1", 0, rank_own=(4, 5), replicas={2: [4, 5]}, rank_state=True)]
    d = decide_recovery(w, ["n2", "n3"], ["s1", "s2"], initial_shards(w.members), survivors)
    assert d.action == Action.REQUEUE and not d.script
    assert d.reason.startswith("no step is held for every rank") and "[1]" in d.reason
    assert d.taken == {"n2": "s1", "n3": "s2"} and d.plan is None  # the layout was possible
    # with rank 1's own state on disk at step 3 (and the shared state): a disk fallback
    d = decide_recovery(w, ["n2", "n3"], ["s1", "s2"], initial_shards(w.members), survivors,
                        disk_shared={0: {3}}, disk_rank={r: {3} for r in range(3)})
    assert d.action == Action.REPLACE and d.restore_step == 3 and d.plan.from_disk == [0, 1, 2]


def test_restarts_in_place_that_make_no_progress_are_the_scripts_error():
    w = _world()
    reports = [_report(n, i, error="RuntimeError: boom" if n == "n2" else "")
               for i, n in enumerate(w.members)]
    kw = dict(previous_restore=5, max_stalled_restarts=3)
    d = decide_recovery(w, [], [], initial_shards(w.members), reports, stalled_restarts=1, **kw)
    assert d.action == Action.REPLACE and d.stalled_restarts == 2
    d = decide_recovery(w, [], [], initial_shards(w.members), reports, stalled_restarts=2, **kw)
    assert (d.action, d.script, d.stalled_restarts) == (Action.FAIL, True, 3)
    assert d.reason == "3 restarts in place made no progress past step 5: RuntimeError: boom"
    # progress (another restore step), or a node lost in the round, resets the count
    for lost, previous in ([], 4), (["n2"], 5):
        d = decide_recovery(w, lost, ["s1"], initial_shards(w.members), reports,
                            stalled_restarts=2, previous_restore=previous)
        assert d.action == Action.REPLACE and d.stalled_restarts == 0


# What the ranks reported when a stranger claimed a rank's gloo pairs at a formation (issue 45):
# the first all-reduce timed out there, the others' pairs closed, the rest were stopped.
GLOO_TIMEOUT = ("RuntimeError: [../third_party/gloo/gloo/transport/tcp/unbound_buffer.cc:81] "
                "Timed out waiting 10000ms for recv operation to complete")
GLOO_CLOSED = ("RuntimeError: [../third_party/gloo/gloo/transport/tcp/pair.cc:534] Connection "
               "closed by peer [10.77.0.12]:40123")
STOPPED = "_Stopped: rank 1 fault: " + GLOO_TIMEOUT


def test_a_formation_broken_from_outside_is_never_the_scripts_error():
    """Restarts in place whose every error is the transport's (gloo's, the store's) with all
    members alive: each round says so (`outside`), and at the limit the job escalates as an
    infrastructure failure (requeue), never as the script's own error."""
    w = _world()
    errors = {"n1": GLOO_CLOSED, "n2": GLOO_TIMEOUT, "n3": STOPPED}
    reports = [_report(n, i, error=errors.get(n, "")) for i, n in enumerate(w.members)]
    kw = dict(previous_restore=5, max_stalled_restarts=3)
    d = decide_recovery(w, [], [], initial_shards(w.members), reports, stalled_restarts=1, **kw)
    assert d.action == Action.REPLACE and d.outside == (GLOO_CLOSED, GLOO_TIMEOUT)
    d = decide_recovery(w, [], [], initial_shards(w.members), reports, stalled_restarts=2, **kw)
    assert (d.action, d.script, d.stalled_restarts) == (Action.REQUEUE, False, 3)
    assert d.reason.startswith("formation broken by something other than a member: 3 restarts "
                               "in place made no progress past step 5: ")
    assert d.outside == (GLOO_CLOSED, GLOO_TIMEOUT) and d.plan is not None
    d = decide_recovery(w, [], [], initial_shards(w.members), reports, stalled_restarts=2,
                        on_no_spare="fail", **kw)  # the user's choice not to retry: still not
    assert (d.action, d.script) == (Action.FAIL, False)  # the script's


@pytest.mark.parametrize("errors", [
    ["RuntimeError: boom", GLOO_TIMEOUT],  # the script raised too
    ["RuntimeError: injected failure in step 5", STOPPED],
    ["TimeoutError: timed out", "ConnectionRefusedError: [Errno 111] Connection refused"],
    [STOPPED],  # only survivors stopped for someone: whose error is unknown
    [],
])
def test_a_restart_with_an_error_of_the_script_stays_its_own(errors):
    w = _world()
    reports = [_report(n, i, error=errors[i] if i < len(errors) else "")
               for i, n in enumerate(w.members)]
    d = decide_recovery(w, [], [], initial_shards(w.members), reports, stalled_restarts=2,
                        previous_restore=5, max_stalled_restarts=3)
    assert (d.action, d.script, d.outside) == (Action.FAIL, True, ())


def test_a_lost_member_is_not_a_formation_broken_from_outside():
    w = _world()
    reports = [_report(n, i, error=GLOO_CLOSED) for i, n in enumerate(w.members) if n != "n2"]
    d = decide_recovery(w, ["n2"], ["s1"], initial_shards(w.members), reports)
    assert d.action == Action.REPLACE and d.outside == ()


def test_a_member_fenced_alive_and_back_as_a_spare_stays_a_spare():
    # n2 was fenced alive in this round and its fresh spare step registered already
    w = _world(spares=("s1", "n2"))
    d = decide_recovery(w, ["n2"], ["s1"], initial_shards(w.members), _survivors(w, ["n2"]))
    assert d.taken == {"n2": "s1"} and d.spares == ["n2"]
    d = decide_recovery(w, ["n2"], ["s1"], initial_shards(w.members), _survivors(w, ["n2"]),
                        unusable={"n2"})
    assert d.spares == []


def test_a_survivor_whose_connection_dropped_holds_nothing():
    w = _world()
    survivors = [_report("n1", 0, own=(4, 5)), _report("n3", 2, own=(5, 6), live=False)]
    d = decide_recovery(w, ["n2"], ["s1"], initial_shards(w.members), survivors)
    # n3's 6 is not reachable by anyone else; it restores 5 from n1 like the newcomer
    assert d.restore_step == 5 and d.plan.sources == {0: "own", 1: "peer", 2: "peer"}


def test_a_sharded_job_cannot_change_size():
    w = _world(spares=())
    survivors = [_report(n, i, shard_keys=(0, 1, 0)) for i, n in enumerate(w.members)
                 if n != "n2"]
    d = decide_recovery(w, ["n2"], [], initial_shards(w.members), survivors,
                        on_no_spare="shrink")
    assert d.action == Action.FAIL and d.shrunk and d.replacement.members == ["n1", "n3"]
    assert "a sharded job cannot change size" in d.reason


def test_the_recovery_record_says_its_phases_in_the_reports_order():
    from hpct_slurm.report import model

    rec = RecoveryRecord(t_detect=100.0, t_stop=100.5, t_fenced=101.0, t_ready=103.0,
                         t_assigned=103.5, generation=2, restore_step=7, lost=["n2"],
                         taken={"n2": "s1"}, reasons={"n2": "connection lost"})
    assert rec.first_step == 8
    assert rec.phases(110.0) == {"detect_to_stop": 0.5, "fence": 0.5, "survivors_ready": 2.0,
                                 "reform_restore_first_step": 6.5}
    fields = rec.done_fields(110.0)
    assert list(fields) == ["generation", "restore_step", "lost", "taken", "reasons",
                            "recovery_s", "phases", "lost_steps"]
    assert fields["recovery_s"] == 10.0 and tuple(fields["phases"]) == PHASES == model.PHASES
