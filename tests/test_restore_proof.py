"""Never silently wrong for the scripts people write (issue 42, items 1, 2 and 8): extra state
registered after a restore gets the restored state, every restore is proven at the first step
boundary after it, and a registration that would hold one state twice is refused up front.

These run on TrainState alone (no process group); the same paths through real faults on the
real cluster are in tests/test_extra_state_cluster.py."""
from __future__ import annotations

import copy

import pytest
import torch

from hpct_slurm.errors import UsageError
from hpct_slurm.recovery.state import TrainState


def _gan(seed: int = 0):
    """A generator, its optimizer, an EMA of it, a discriminator and its optimizer."""
    torch.manual_seed(seed)
    gen = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 4))
    disc = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))
    ema = torch.optim.swa_utils.AveragedModel(
        gen, multi_avg_fn=torch.optim.swa_utils.get_ema_multi_avg_fn(0.9))
    return (gen, torch.optim.Adam(gen.parameters(), lr=1e-2), ema, disc,
            torch.optim.SGD(disc.parameters(), lr=1e-2, momentum=0.9))


def _train(gen, gopt, ema, disc, dopt, steps: int) -> None:
    for _ in range(steps):
        z = torch.randn(16, 4)
        dopt.zero_grad()
        torch.nn.functional.softplus(disc(gen(z).detach())).mean().backward()
        dopt.step()
        gopt.zero_grad()
        torch.nn.functional.softplus(-disc(gen(z))).mean().backward()
        gopt.step()
        ema.update_parameters(gen)


def _same(a: torch.nn.Module, b: torch.nn.Module) -> bool:
    return all(torch.equal(x, y) for x, y in zip(a.state_dict().values(),
                                                 b.state_dict().values()))


def test_state_registered_after_the_restore_gets_the_restored_state_and_is_proven():
    """Defect 1 and 2's pattern: main() runs again (or a spare starts), Job(...) restores,
    and only then does the script register its EMA and discriminator: they get the state
    the snapshot holds for their names, and the proof finds every object exact."""
    gen, gopt, ema, disc, dopt = _gan()
    state = TrainState(model=gen, optimizer=gopt)
    state.register(scope="shared", ema=ema, disc=disc, disc_opt=dopt)
    _train(gen, gopt, ema, disc, dopt, 3)
    layout, buf = state.capture_into(None, ("shared",))
    want = [copy.deepcopy(m) for m in (gen, ema, disc)]

    fresh = _gan(seed=1)  # main()'s next run builds everything anew
    again = TrainState(model=fresh[0], optimizer=fresh[1])
    again.restore_from(layout, buf, scopes=("shared",))
    assert not _same(fresh[2], want[1])  # not registered yet: nothing reached it
    again.register(scope="shared", ema=fresh[2], disc=fresh[3], disc_opt=fresh[4])
    assert all(_same(m, w) for m, w in zip((fresh[0], fresh[2], fresh[3]), want))
    assert fresh[4].state_dict()["state"][0]["momentum_buffer"].equal(
        dopt.state_dict()["state"][0]["momentum_buffer"])
    assert again.prove() == []
    # and the two go on identically (Job reseeds every step alike)
    torch.manual_seed(5)
    _train(gen, gopt, ema, disc, dopt, 2)
    torch.manual_seed(5)
    _train(*fresh, 2)
    assert _same(fresh[2], ema) and _same(fresh[3], disc)


def test_a_snapshot_taken_before_the_late_registration_keeps_the_restored_state():
    """A newcomer commits the step it restored before the script registers the rest: that
    snapshot must still hold the EMA (it is served to the next newcomer)."""
    gen, gopt, ema, *_ = _gan()
    state = TrainState(model=gen, optimizer=gopt)
    state.register(scope="shared", ema=ema)
    layout, buf = state.capture_into(None, ("shared",))
    fresh = _gan(seed=1)
    again = TrainState(model=fresh[0], optimizer=fresh[1])
    again.restore_from(layout, buf, scopes=("shared",))
    layout2, buf2 = again.capture_into(None, ("shared",))  # before the EMA registers
    third = _gan(seed=2)
    last = TrainState(model=third[0], optimizer=third[1])
    last.restore_from(layout2, buf2, scopes=("shared",))
    last.register(scope="shared", ema=third[2])
    assert _same(third[2], ema) and last.prove() == []


def test_the_proof_catches_an_object_swapped_or_reset_after_the_restore():
    gen, gopt, ema, disc, dopt = _gan()
    state = TrainState(model=gen, optimizer=gopt)
    state.register(scope="shared", ema=ema)
    _train(gen, gopt, ema, disc, dopt, 2)
    layout, buf = state.capture_into(None, ("shared",))

    # an EMA reset after the restore (re-initialised from the fresh generator)
    fresh = _gan(seed=1)
    again = TrainState(model=fresh[0], optimizer=fresh[1])
    again.register(scope="shared", ema=fresh[2])
    again.restore_from(layout, buf, scopes=("shared",))
    with torch.no_grad():
        for p in fresh[2].parameters():
            p.zero_()
    problems = again.prove()
    assert len(problems) == 1 and problems[0].startswith("ema: the registered AveragedModel "
                                                         "does not hold"), problems

    # one bit of one parameter is enough
    again.restore_from(layout, buf, scopes=("shared",))
    with torch.no_grad():
        w = next(fresh[0].parameters())
        w.view(torch.int32).view(-1)[0] ^= 1
    assert [p.split(":")[0] for p in again.prove()] == ["model"]

    # restored state nobody registered since, and a registered object the snapshot lacks
    other = _gan(seed=2)
    third = TrainState(model=other[0], optimizer=other[1])
    third.register(scope="shared", disc=other[3])
    third.restore_from(layout, buf, scopes=("shared",))
    problems = sorted(third.prove())
    assert problems[0].startswith("disc: registered, but the restored snapshot held no state")
    assert problems[1].startswith("ema: restored, but no object was registered")
    assert third.prove() == []  # the record is used up: one proof per restore


def test_the_proof_covers_extras_and_a_shared_restore_says_nothing_of_rank_state():
    gen, gopt, *_ = _gan()
    state = TrainState(model=gen, optimizer=gopt)
    state.extras["seen"] = [1, 2]
    layout, buf = state.capture_into(None)
    state.restore_from(layout, buf)
    state.extras["seen"].append(3)
    assert state.prove() == ["extras: state.extras changed after the restore"]
    state.restore_from(layout, buf, scopes=("shared",))  # not the rank scope: not its to say
    state.extras["seen"].append(4)
    assert state.prove() == []


@pytest.mark.parametrize("register, refused", [
    (lambda s, m, o: s.register(model=torch.nn.Linear(2, 2)), "'model' is already registered"),
    (lambda s, m, o: s.register(scope="shared", ema=m), "already registered as 'model'"),
    (lambda s, m, o: s.register(scope="shared", wrapped=torch.nn.Sequential(m)),
     "holds parameters of 'model'"),
    (lambda s, m, o: s.register(scope="everywhere", ema=torch.nn.Linear(2, 2)),
     "scope 'everywhere'"),
])
def test_a_registration_that_would_hold_one_state_twice_is_refused(register, refused):
    model = torch.nn.Linear(2, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    state = TrainState(model=model, optimizer=opt)
    with pytest.raises(UsageError, match=refused):
        register(state, model, opt)
    state.register(model=model, optimizer=opt)  # the same object again: nothing happens
    assert state.get("model") is model and sorted(state.names()) == ["model", "optimizer"]
