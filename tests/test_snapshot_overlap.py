"""Snapshots off the step's critical path: a commit whose parameter copy overlaps the next
step, and a step held lazily (copied only at a fault). Both must hold exactly the state after
their step, whatever the next step does to the live tensors."""
from __future__ import annotations

import torch

from hpct_slurm.recovery.snapshot import SnapshotStore
from hpct_slurm.recovery.state import TrainState


def _setup():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.BatchNorm1d(8))
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    state = TrainState(model=model, optimizer=opt)
    store = SnapshotStore(state, ("shared",))
    opt.register_step_pre_hook(lambda *_: store.before_optimizer_step())

    def step():
        opt.zero_grad()
        model(torch.randn(4, 8)).pow(2).mean().backward()  # moves BatchNorm's running stats
        opt.step()
    return model, opt, state, store, step


def _frozen(state: TrainState) -> list[torch.Tensor]:
    _, live = state.plan(("shared",))
    return [t.detach().clone() for t in live]


def _equal(snap, expected) -> bool:
    entries = snap.layout.entries
    flat = torch.frombuffer(bytearray(snap.data), dtype=torch.uint8)
    got = [flat[e.offset:e.offset + e.nbytes].view(getattr(torch, e.dtype)).view(e.shape)
           for e in entries]
    return len(got) == len(expected) and all(torch.equal(a, b) for a, b in zip(got, expected))


def test_an_overlapped_commit_holds_its_step_while_the_next_step_runs():
    model, opt, state, store, step = _setup()
    step()
    expected = _frozen(state)
    store.commit_async(1)
    step()  # its forward moves the buffers at once; its optimizer step waits for the copy
    store.wait()
    with store.lease(1) as snap:
        assert snap is not None and _equal(snap, expected)
    assert not _equal(snap, _frozen(state))  # the live state did move on


def test_a_lazily_held_step_is_exact_at_a_fault_and_dropped_by_the_next_update():
    model, opt, state, store, step = _setup()
    step()
    store.commit(0)
    step()
    expected = _frozen(state)
    store.prepare_lazy(1)
    # the next step's forward and backward run (buffers move), then a fault before its
    # optimizer step: the live parameters are still step 1's, the buffers were copied
    opt.zero_grad()
    model(torch.randn(4, 8)).pow(2).mean().backward()
    snap = store.finish_pending()
    assert snap is not None and snap.step == 1 and _equal(snap, expected)
    assert store.slots.steps() == [0, 1]
    # once an optimizer step starts, the live state is no step's: nothing is pending
    store.prepare_lazy(2)
    step()
    assert store.finish_pending() is None
    assert store.slots.steps() == [1]  # the older slot was given up to the dropped one
    store.commit(3)  # and the writer slot is free again
    assert store.slots.steps() == [1, 3]
