"""Replicas check each other (issue 42, item 8): the pure parts of recovery/crosscheck.py, and
what one rank's Integrity does with a sequence of comparisons (the all-gather faked). The
whole path, a bit flipped on one rank of the real cluster, is in
tests/test_crosscheck_cluster.py."""
from __future__ import annotations

import io
import json
from types import SimpleNamespace

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from hpct_slurm.errors import HpctError
from hpct_slurm.events import EventLog
from hpct_slurm.recovery import integrity
from hpct_slurm.recovery.crosscheck import (MAX_ROLLBACKS, History, Verdict, compare, judge,
                                            shared_digest)
from hpct_slurm.recovery.integrity import Integrity
from hpct_slurm.recovery.state import TrainState

A, B, C = b"a" * 16, b"b" * 16, b"c" * 16


def _state(seed: int = 0) -> tuple[TrainState, torch.nn.Module]:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Linear(16, 2))
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    model(torch.randn(4, 8)).sum().backward()
    opt.step()
    return TrainState(model=model, optimizer=opt), model


def test_one_flipped_bit_anywhere_changes_the_digest_and_rank_state_does_not():
    state, model = _state()
    before = shared_digest(state)
    assert shared_digest(_state()[0]) == before  # the same state on another rank
    for p in model.parameters():
        for bit in (0, 13, 31):
            with torch.no_grad():
                p.view(-1)[-1:].view(torch.int32)[0] ^= 1 << bit
            assert shared_digest(state) != before, (p.shape, bit)
            with torch.no_grad():
                p.view(-1)[-1:].view(torch.int32)[0] ^= 1 << bit
    assert shared_digest(state) == before
    opt = state.get("optimizer")
    opt.param_groups[0]["lr"] = 0.5  # a scalar of the structure counts too
    assert shared_digest(state) != before
    opt.param_groups[0]["lr"] = 1e-2
    state.extras["position"] = 7  # the rank's own state is not a replica's business
    assert shared_digest(state) == before


def test_the_order_of_registration_is_no_part_of_the_state():
    """A spare's Job registers the loop's position after the positional objects, a survivor
    kept it registered from its last run of main() and registers the script's objects anew
    after it: the same state in another order, which the replicas must find equal."""
    state, model = _state()
    opt = state.get("optimizer")
    sched = torch.optim.lr_scheduler.StepLR(opt, 3)
    state.register(sched=sched)
    other = TrainState(sched=sched)
    other.register(optimizer=opt)
    other.register(model=model)
    assert other.names() != state.names()
    assert shared_digest(other) == shared_digest(state)


def test_buffers_count_by_shape_only():
    """BatchNorm's running statistics follow each rank's own batch until DDP's next buffer
    broadcast: replicas differ there at a step's end without anything being wrong."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.BatchNorm1d(4))
    state = TrainState(model=model)
    before = shared_digest(state)
    model(torch.randn(8, 4))  # train mode: the running statistics move
    assert shared_digest(state) == before
    with torch.no_grad():
        model[0].weight.view(-1)[:1].view(torch.int32)[0] ^= 1
    assert shared_digest(state) != before


@pytest.mark.parametrize("digests, keys, diverged, undecided", [
    ([A, A, A, A], [0, 0, 0, 0], (), ()),
    ([A, A, B, A], [0, 0, 0, 0], (2,), ()),
    ([A, B, B, B], [0, 0, 0, 0], (0,), ()),
    ([A, B], [0, 0], (), (0,)),                    # two replicas: nobody can tell which
    ([A, B, A, A, C], [0, 0, 0, 0, 0], (1, 4), ()),
    ([A, B, A, C], [0, 0, 0, 0], (), (0,)),       # a half is no majority
    ([A, B, C, C], [0, 1, 2, 2], (), ()),           # 1-D FSDP keys and a pair that agrees
    ([A, B, A, C], [0, 1, 0, 1], (), (1,)),         # HSDP 2 x 2: key 1's pair disagrees
])
def test_compare_names_the_ranks_outside_their_keys_strict_majority(digests, keys, diverged,
                                                                     undecided):
    v = compare(digests, lambda r: keys[r])
    assert (v.diverged, v.undecided) == (diverged, undecided)
    assert v.agreed == (not diverged and not undecided)


@given(st.lists(st.sampled_from([A, B, C]), min_size=1, max_size=12),
       st.integers(min_value=1, max_value=4))
def test_compare_never_names_a_rank_of_the_majority(digests, n_keys):
    v = compare(digests, lambda r: r % n_keys)
    for r in v.diverged:
        mates = [digests[q] for q in range(len(digests)) if q % n_keys == r % n_keys]
        assert 2 * mates.count(digests[r]) < len(mates)
        assert max(mates.count(d) for d in mates) * 2 > len(mates)


# ---- what the group does about a disagreement (judge), and one rank living through it --------

FLIP, SAME = "flip", "same"  # rank 1's digest in one comparison: differs from the others', or not


@given(st.lists(st.sampled_from([Verdict((1,), (), 1), Verdict((), (0,), 1),
                                 Verdict((), (), 1)]), max_size=12))
def test_rollbacks_are_bounded_and_nobody_is_blamed_before_the_replicas_agreed(verdicts):
    h, in_a_row, agreed = History(), 0, False
    for v in verdicts:
        j = judge(v, h)
        assert j.blamed == () or (agreed and j.blamed == v.diverged)
        in_a_row = in_a_row + 1 if j.action == "rollback" else 0
        assert in_a_row <= MAX_ROLLBACKS
        if h.off:
            assert j.action == "ignored"
        agreed = agreed or v.agreed
        h = j.history
        assert History.decode(h.encode()) == h


def test_a_rank_that_joined_later_knows_what_the_group_knows():
    new, old = History(), History(agreed_once=True, rollbacks=1)
    assert History.merge([new, old, new]) == old
    assert History.merge([new, History(off=True)]).off


class _Policy:
    def __init__(self) -> None:
        self.cross_check = None
        self.rolled_back_to: list[int] = []

    def distrust_after(self, step: int) -> None:
        self.rolled_back_to.append(step)


def _rank(tmp_path, monkeypatch, rank: int, world: int = 4):
    """Rank `rank`'s Integrity over a group whose all-gather is faked: `run(step, how)` makes
    one comparison where rank 1's digest differs from the others' (FLIP) or not (SAME), each
    other rank sending what this one sends; it returns whether the step failed (a rollback)."""
    tmp_path.mkdir(exist_ok=True)
    (tmp_path / "secret").write_bytes(b"s")
    out = io.StringIO()
    state, _ = _state()
    policy = _Policy()
    me = Integrity(state, policy, SimpleNamespace(rank=rank, generation=0), EventLog(stream=out),
                   key=lambda r: 0, run_dir=tmp_path, node=f"n{rank + 1}")
    monkeypatch.setattr(integrity.dist, "get_world_size", lambda: world)
    how = [SAME]

    def exchange(mine: bytes, n: int) -> list[bytes]:
        other = bytes([mine[0] ^ 1]) + mine[1:]
        return [other if r == 1 and how[0] == FLIP and rank != 1 else
                other if r != 1 and how[0] == FLIP and rank == 1 else mine for r in range(n)]
    monkeypatch.setattr(integrity, "exchange", exchange)

    def run(step: int, kind: str) -> bool:
        how[0] = kind
        try:
            me.cross_check(step)
        except HpctError:
            return True
        return False

    def events() -> list[dict]:
        return [json.loads(line) for line in out.getvalue().splitlines()]
    asked = tmp_path / "requests" / f"move-n{rank + 1}"
    return run, events, asked, policy


def test_replicas_that_differ_from_their_first_comparison_on_turn_the_check_off(
        tmp_path, monkeypatch):
    """One node's kernels give other bits (ATEN_CPU_CAPABILITY=default there): its replicas
    differ at step 0, and again when step 0 is recomputed. One rollback, then the check is
    off: no more rollbacks (which made the job fail as the script's error), and the node,
    healthy, is not moved out."""
    for rank in (0, 1):
        run, events, asked, policy = _rank(tmp_path / str(rank), monkeypatch, rank)
        assert run(0, FLIP)           # maybe a flip in step 0: one rollback, to creation
        assert policy.rolled_back_to == [-1]
        assert not run(0, FLIP)       # the recompute differs again: it computes otherwise
        assert not run(16, FLIP) and not run(32, FLIP) and policy.rolled_back_to == [-1]
        assert not asked.exists()
        off = [e for e in events() if e["event"] == "replica.check_off"]
        assert len(off) == (rank == 0) and all(e["step"] == 0 for e in off)


def test_a_later_flip_is_rolled_back_and_blamed_and_one_that_comes_back_turns_the_check_off(
        tmp_path, monkeypatch):
    run, events, asked, policy = _rank(tmp_path, monkeypatch, 1)
    assert not run(0, SAME) and not run(16, SAME)
    assert run(32, FLIP) and policy.rolled_back_to == [16] and asked.exists()
    asked.unlink()
    assert not run(32, SAME)          # the recompute agrees: it was a flip
    assert run(48, FLIP) and policy.rolled_back_to == [16, 32]  # another flip, another rollback
    asked.unlink()
    assert not run(48, FLIP) and asked.exists()  # it comes back: the node blamed, check off
    assert policy.rolled_back_to == [16, 32]
    assert [e["action"] for e in events() if e["event"] == "replica.diverged"] == \
        ["rollback", "rollback", "off"]
