"""The `gpu` tier (issue 26): what only a CUDA device can show. Skipped, with the reason
printed, where torch sees none (conftest.py); `scripts/gpu-check.sh` runs it on a GPU machine.

- an NCCL group (one rank: one GPU cannot host two) forms over the rootless store, a STOP's
  abort reaches it, teardown leaves nothing, and the next generation forms;
- an overlapped commit on the copy stream holds exactly the step it claims, although the next
  optimizer update was queued right after it (the update waits for the copy on the GPU);
- a lazily held step captured at a fault, and a restore from pinned memory into a survivor's
  own objects and into a newcomer's fresh ones, are bit-identical on the device.
"""
from __future__ import annotations

import datetime
import threading

import pytest
import torch

pytestmark = pytest.mark.gpu

SECRET = b"g" * 32


def _model(seed: int = 0) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(256, 512), torch.nn.GELU(),
                                torch.nn.Linear(512, 256)).cuda()
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2)


def _train(model, opt, steps: int) -> None:
    g = torch.Generator(device="cuda").manual_seed(123)  # the same batch in every call
    x = torch.randn(64, 256, device="cuda", generator=g)
    for _ in range(steps):
        opt.zero_grad()
        model(x).pow(2).mean().backward()
        opt.step()


def _flat(model, opt) -> list[torch.Tensor]:
    return [t.detach().cpu().clone() for t in model.state_dict().values()] + [
        t.detach().cpu().clone() for st in opt.state.values() for t in st.values()
        if isinstance(t, torch.Tensor)]


def _equal(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b))


def test_nccl_forms_aborts_tears_down_and_forms_again():
    import torch.distributed as dist
    import torch.distributed.distributed_c10d as c10d

    from hpct_slurm.rendezvous import pg
    from hpct_slurm.rendezvous.derive import derive
    from hpct_slurm.rendezvous.store import make_store, serve_shard
    from hpct_slurm.slurm.env import SlurmEnv

    env = SlurmEnv.from_environ({
        "SLURM_JOB_ID": "5", "SLURM_JOB_NODELIST": "n0", "SLURMD_NODENAME": "n0",
        "SLURM_STEP_NODELIST": "n0", "SLURM_PROCID": "0", "SLURM_LOCALID": "0",
        "SLURM_NODEID": "0", "SLURM_NTASKS": "1", "SLURM_TASKS_PER_NODE": "1"})
    for generation in range(2):
        info = derive(env, generation, ["n0"], tasks_per_node=1,
                      resolve=lambda name: "127.0.0.1")
        shard = serve_shard(info, SECRET)
        pg.init(info, make_store("rootless", info, SECRET), "nccl", shard=shard,
                device_id=torch.device("cuda", 0),
                collective_timeout=datetime.timedelta(seconds=10))
        assert pg.needs_abort(pg.backend_name())
        t = torch.full((4,), 2.0, device="cuda")
        dist.all_reduce(t)
        assert t.tolist() == [2.0] * 4
        assert pg.abort_generation(generation - 1) is False  # an older generation's STOP
        got: list[bool] = []
        thread = threading.Thread(target=lambda: got.append(pg.abort_generation(generation)))
        thread.start()  # from another thread, as the client's receiving thread does
        thread.join(30)
        assert got == [True]
        pg.teardown()  # the NCCL branch: no AssertionError, nothing left
        assert not dist.is_initialized() and c10d._world.group_count == 0


def _watched():
    """A model, its optimizer and a snapshot store wired as Job wires them."""
    from hpct_slurm.recovery.snapshot import SnapshotStore
    from hpct_slurm.recovery.state import TrainState

    model, opt = _model()
    store = SnapshotStore(TrainState(model=model, optimizer=opt), scopes=("shared",))
    opt.register_step_pre_hook(lambda *_: store.before_optimizer_step())
    return model, opt, store


def test_an_overlapped_commit_holds_its_step_while_the_next_update_is_queued():
    from hpct_slurm.recovery.state import TrainState

    model, opt, store = _watched()
    _train(model, opt, 2)
    torch.cuda.synchronize()
    expected = _flat(model, opt)
    store.commit_async(2)
    _train(model, opt, 3)  # its updates are queued at once: they must wait for the copy
    store.wait()
    snap = store.latest()
    assert snap.step == 2
    model2, opt2 = _model(seed=1)
    _train(model2, opt2, 1)
    TrainState(model=model2, optimizer=opt2).restore_from(snap.layout, snap.data)
    assert _equal(_flat(model2, opt2), expected)


def test_a_lazy_hold_captured_at_a_fault_is_the_step_it_claims():
    from hpct_slurm.recovery.state import TrainState

    model, opt, store = _watched()
    _train(model, opt, 2)
    store.prepare_lazy(1)
    torch.cuda.synchronize()
    expected = _flat(model, opt)
    snap = store.finish_pending()  # the fault came before the next optimizer step
    assert snap is not None and snap.step == 1
    model2, opt2 = _model(seed=1)
    TrainState(model=model2, optimizer=opt2).restore_from(snap.layout, snap.data)
    assert _equal(_flat(model2, opt2), expected)


def test_restores_into_a_survivor_and_a_newcomer_are_bit_identical_and_stay_on_the_gpu():
    from hpct_slurm.recovery.snapshot import SnapshotStore
    from hpct_slurm.recovery.state import TrainState

    model, opt = _model()
    _train(model, opt, 3)
    state = TrainState(model=model, optimizer=opt)
    snap = SnapshotStore(state, scopes=("shared",)).commit(3)
    expected = _flat(model, opt)
    _train(model, opt, 2)  # the survivor moved on: its restore must overwrite everything
    state.restore_from(snap.layout, snap.data)
    assert _equal(_flat(model, opt), expected)
    fresh, fresh_opt = _model(seed=7)  # a newcomer: no optimizer state yet
    TrainState(model=fresh, optimizer=fresh_opt).restore_from(snap.layout, snap.data)
    assert _equal(_flat(fresh, fresh_opt), expected)
    moments = [t for st in fresh_opt.state.values() for k, t in st.items() if k != "step"]
    assert moments and all(t.is_cuda for t in moments)
    # and training goes on identically from both
    _train(model, opt, 2)
    _train(fresh, fresh_opt, 2)
    assert _equal(_flat(model, opt), _flat(fresh, fresh_opt))


def test_a_ranks_own_time_on_the_gpu_leaves_out_its_waits():
    """Fail-slow (issue 47): on a GPU the own time per step is timed with CUDA events, the
    GPU's busy time up to the step's last wait and outside the waits, not the host's (which
    runs ahead of the GPU); what follows the last wait (rank 0's evaluation) is left out."""
    from hpct_slurm.recovery.own_time import DeviceOwnTime

    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    torch.cuda._sleep(10**7)
    b.record()
    torch.cuda.synchronize()
    cycles = int(10**7 * 20 / a.elapsed_time(b))  # ~20 ms of the GPU spinning
    m = DeviceOwnTime(window=5)
    m.step_ends(0, 0.0)
    for _ in range(6):
        torch.cuda._sleep(cycles)          # its own work
        m.wait_begins(0.0)
        torch.cuda._sleep(3 * cycles)      # "waiting" for a peer: three times as long
        m.wait_ends(0.0)
        torch.cuda._sleep(2 * cycles)      # work after its last collective: not its own
        m.step_ends(0, 0.0)
    torch.cuda.synchronize()
    m.step_ends(0, 0.0)                    # reads every step the GPU has finished
    own, n = m.figure
    assert n == 5
    assert 0.01 < own < 0.04, own          # ~20 ms: its own work only, not the 60 ms wait
                                           # nor the 40 ms after it
