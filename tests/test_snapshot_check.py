"""Never silently wrong (issue 27): a lazily held or overlapped snapshot proves it is the step
it claims through the in-place version counters of what it copies, and every optimizer that
updates registered state is watched, not only the one given to Job.

Each case is code a user writes (SAM, weight decay by hand, a GAN's second optimizer) with the
snapshot store driven exactly as Job drives it: `prepare_lazy` after step K and
`finish_pending` at the fault; `commit_async` with the optimizers' pre-hooks.
"""
from __future__ import annotations

import threading
from types import SimpleNamespace

import torch

from hpct_slurm.config import JobSettings
from hpct_slurm.recovery import snapshot as S
from hpct_slurm.recovery.snapshot import SnapshotStore
from hpct_slurm.recovery.snapshot_policy import SnapshotPolicy
from hpct_slurm.recovery.state import TrainState

from test_hostile_network import Events  # an EventLog into memory, read back by name


def _net(seed: int = 0) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.Tanh(), torch.nn.Linear(64, 4))
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2)


def _step(model, opt, x) -> None:
    opt.zero_grad()
    model(x).pow(2).mean().backward()
    opt.step()


def _values(*objs) -> list[torch.Tensor]:
    out = []
    for o in objs:
        if isinstance(o, torch.nn.Module):
            out += [t.detach().clone() for t in o.state_dict().values()]
        else:
            out += [t.clone() for st in o.state.values() for t in st.values()
                    if isinstance(t, torch.Tensor)]
    return out


def _lazy_store(model, opt) -> tuple[SnapshotStore, list]:
    store = SnapshotStore(TrainState(model=model, optimizer=opt), scopes=("shared",))
    refused: list = []
    store.on_not_the_step = lambda step, detail: refused.append((step, detail))
    opt.register_step_pre_hook(lambda *_: store.before_optimizer_step())
    return store, refused


def test_a_sam_perturbation_makes_the_held_step_refused_not_wrong():
    """SAM's first half-step adds e(w) to every weight in place, outside optimizer.step(),
    before its second forward and backward; a fault there must not capture those weights."""
    model, opt = _net()
    x = torch.randn(8, 32)
    store, refused = _lazy_store(model, opt)
    _step(model, opt, x)
    store.prepare_lazy(0)  # the end of step 0: held where it lies
    # step 1 begins: SAM's ascent step, then the fault (before the real optimizer step)
    model(x).pow(2).mean().backward()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.05 * p.grad / (p.grad.norm() + 1e-12))
    snap = store.finish_pending()
    assert snap is None  # before the check: the perturbed weights, published as step 0
    assert refused and refused[0][0] == 0 and "changed in place" in refused[0][1]
    assert store.slots.steps() == []  # nothing claims to be step 0


def test_weight_decay_by_hand_before_the_update_is_caught_too():
    model, opt = _net()
    x = torch.randn(8, 32)
    store, refused = _lazy_store(model, opt)
    _step(model, opt, x)
    store.commit(0)
    _step(model, opt, x)
    store.prepare_lazy(1)
    with torch.no_grad():
        model[0].weight.mul_(1 - 1e-2)  # decoupled decay, applied before the next update
    assert store.finish_pending() is None
    assert len(refused) == 1 and store.slots.steps() == [0]  # the older commit still held


def test_an_untouched_hold_is_captured_exactly():
    """The check costs nothing where the rule holds: a fault in the next forward/backward."""
    model, opt = _net()
    x = torch.randn(8, 32)
    store, refused = _lazy_store(model, opt)
    _step(model, opt, x)
    store.prepare_lazy(0)
    expected = _values(model, opt)
    model(x).pow(2).mean().backward()  # the next step's forward and backward, then the fault
    snap = store.finish_pending()
    assert snap is not None and snap.step == 0 and refused == []
    model2, opt2 = _net(seed=3)
    _step(model2, opt2, x)
    TrainState(model=model2, optimizer=opt2).restore_from(snap.layout, snap.data)
    assert all(torch.equal(a, b) for a, b in zip(_values(model2, opt2), expected))


def _gan(tmp_path):
    """A GAN-style job: the generator's optimizer given to Job, the discriminator and its
    optimizer registered as extra (shared) state; the policy wired as Job wires it."""
    torch.manual_seed(0)
    g = torch.nn.Linear(256, 256)
    d = torch.nn.Linear(256, 1024)  # big enough that its copy takes a while
    g_opt = torch.optim.SGD(g.parameters(), lr=0.1)
    d_opt = torch.optim.SGD(d.parameters(), lr=0.1)
    state = TrainState(model=g, optimizer=g_opt)
    state.register(scope="shared", disc=d, disc_opt=d_opt)  # replicated like the generator
    events = Events()
    settings = JobSettings(controller="127.0.0.1:9", secret_file="unused", run_dir=tmp_path,
                           snapshot_overlap="1")
    policy = SnapshotPolicy(state, settings, "jit", None, persist_every=0, events=events.log,
                            secret=b"k" * 32, job_id="27", run_dir=tmp_path,
                            standing=SimpleNamespace(rank=0, world_size=1, data_ranks=[0]),
                            on_gpu=lambda: False)
    policy.watch_optimizer(g_opt)
    return g, d, g_opt, d_opt, policy, events


def test_a_second_optimizer_cannot_race_an_overlapped_copy(tmp_path, monkeypatch):
    """The discriminator's update lands while the overlapped copy of the last commit has not
    read its weights yet. Its optimizer is not the one given to Job: before, nothing held it
    back, and the published snapshot mixed two steps. Now torch's global pre-hook holds it
    until the copy is done (and were it not, the version check would refuse the snapshot)."""
    g, d, g_opt, d_opt, policy, events = _gan(tmp_path)
    x = torch.randn(4, 256)
    d(x).sum().backward()
    g(x).sum().backward()
    d_opt.step()
    g_opt.step()
    expected = _values(g, d)
    d_stepped = threading.Event()
    issue = S.issue_copies

    def late_copy(pairs, ready=None):
        if threading.current_thread().name == "hpct-snapshot":
            d_stepped.wait(1.0)  # the copy thread is slow to start: the update comes first
        return issue(pairs, ready)

    monkeypatch.setattr(S, "issue_copies", late_copy)
    policy.snapshots.commit_async(7)
    d(x).sum().backward()
    d_opt.step()  # the discriminator's update: waits for the copy (global hook)
    d_stepped.set()
    policy.snapshots.wait()
    snap = policy.snapshots.latest()
    try:
        assert snap is not None and snap.step == 7
        g2, d2 = torch.nn.Linear(256, 256), torch.nn.Linear(256, 1024)
        restored = TrainState(model=g2, optimizer=torch.optim.SGD(g2.parameters(), lr=0.1))
        restored.register(scope="shared", disc=d2,
                          disc_opt=torch.optim.SGD(d2.parameters(), lr=0.1))
        restored.restore_from(snap.layout, snap.data)
        assert all(torch.equal(a, b) for a, b in zip(_values(g2, d2), expected))
    finally:
        policy.close()


def test_without_the_global_watch_the_race_is_refused_never_published(tmp_path, monkeypatch):
    """The same race with the global hook gone (an optimizer torch's hook cannot see): the
    overlapped copy read weights the update had moved, and is refused."""
    g, d, g_opt, d_opt, policy, events = _gan(tmp_path)
    policy.close()  # removes the global optimizer hook
    x = torch.randn(4, 256)
    d(x).sum().backward()
    d_opt.step()
    policy.snapshots.commit(6)
    stepped = threading.Event()
    issue = S.issue_copies

    def late_copy(pairs, ready=None):
        if threading.current_thread().name == "hpct-snapshot":
            stepped.wait(5.0)
        return issue(pairs, ready)

    monkeypatch.setattr(S, "issue_copies", late_copy)
    policy.snapshots.commit_async(7)
    d(x).sum().backward()
    d_opt.step()  # unwatched now: it does not wait
    stepped.set()
    policy.snapshots.wait()
    assert policy.snapshots.slots.steps() == [6]  # 7 refused; 6 still held
    refused = events.named("snapshot.not_the_step")
    assert refused and refused[0]["step"] == 7 and refused[0]["holds"] == [6]


def test_an_optimizer_over_unregistered_state_does_not_drop_the_hold(tmp_path):
    g, d, g_opt, d_opt, policy, events = _gan(tmp_path)
    try:
        other = torch.nn.Linear(4, 4)
        other_opt = torch.optim.SGD(other.parameters(), lr=0.1)
        policy.snapshots.prepare_lazy(3)
        other(torch.randn(2, 4)).sum().backward()
        other_opt.step()  # updates nothing the snapshot holds
        assert policy.snapshots.finish_pending() is not None
        policy.snapshots.prepare_lazy(4)
        d(torch.randn(2, 256)).sum().backward()
        d_opt.step()  # updates registered state: the hold is no longer the step's
        assert policy.snapshots.finish_pending() is None
    finally:
        policy.close()
