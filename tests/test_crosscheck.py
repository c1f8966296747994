"""Replicas check each other (issue 42, item 8): the pure parts of recovery/crosscheck.py.
The whole path, a bit flipped on one rank of the real cluster, is in
tests/test_crosscheck_cluster.py."""
from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from hpct_slurm.recovery.crosscheck import compare, shared_digest
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
