"""The controller's pure decisions: allocation split, replacement, restore step, shrink."""
from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from hpct_slurm.controller.policy import (World, data_ranks, initial_shards, replace,
                                          restore_step, shrink, split_allocation)
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


def test_restore_step_is_the_oldest_newest_snapshot():
    assert restore_step({0: 12, 1: 11, 3: 12}) == 11
    with pytest.raises(HpctError, match="no survivor"):
        restore_step({})


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
    env = {"HPCT_SPARES": "2", "HPCT_RENDEZVOUS": "tcpstore"}
    assert defaults_from_spank(None, None, env) == (2, "tcpstore")
    assert defaults_from_spank(0, "rootless", env) == (0, "rootless")  # the command line wins
    with pytest.raises(HpctError, match="HPCT_SPARES 'two'"):
        defaults_from_spank(None, None, {"HPCT_SPARES": "two"})
    with pytest.raises(HpctError, match="HPCT_RENDEZVOUS 'etcd'"):
        defaults_from_spank(None, None, {"HPCT_RENDEZVOUS": "etcd"})


def test_progress_timeout_comes_from_the_environment_and_is_checked():
    from hpct_slurm.errors import seconds_from_env

    assert seconds_from_env({}, "HPCT_PROGRESS_TIMEOUT_S", 300.0) == 300.0
    assert seconds_from_env({"HPCT_PROGRESS_TIMEOUT_S": "4"}, "HPCT_PROGRESS_TIMEOUT_S",
                            300.0) == 4.0
    for bad in ("abc", "0", "-3"):
        with pytest.raises(HpctError, match=f"HPCT_PROGRESS_TIMEOUT_S '{bad}' is not a "
                                            f"positive number of seconds"):
            seconds_from_env({"HPCT_PROGRESS_TIMEOUT_S": bad}, "HPCT_PROGRESS_TIMEOUT_S", 1.0)
