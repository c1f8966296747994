"""TrainState capture/restore, double-buffered snapshot slots, replica placement, mode choice."""
from __future__ import annotations

import random
import re
import time
from datetime import timedelta

import numpy as np
import pytest
import torch
import torch.distributed as dist
from hypothesis import given
from hypothesis import strategies as st

from hpct_slurm import protocol as P
from hpct_slurm.errors import HpctError
from hpct_slurm.recovery.layout_rules import choose_mode
from hpct_slurm.recovery.replicas import ReplicaStore
from hpct_slurm.recovery.ring import (ranks_held_by, replica_peer, replica_peer_rank,
                                      replica_source_node)
from hpct_slurm.recovery.slots import Snapshot
from hpct_slurm.recovery.snapshot import SnapshotStore
from hpct_slurm.recovery.encoding import Layout
from hpct_slurm.recovery.state import TrainState


class Sampler:
    """A data position with state_dict/load_state_dict, like a resumable sampler."""

    def __init__(self) -> None:
        self.pos = 0

    def state_dict(self) -> dict:
        return {"pos": self.pos}

    def load_state_dict(self, sd: dict) -> None:
        self.pos = sd["pos"]


def make_training(seed: int = 0):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Dropout(0.3), torch.nn.ReLU(),
                                torch.nn.Linear(32, 4))
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=3, gamma=0.5)
    sampler = Sampler()
    state = TrainState(model=model, optimizer=opt, lr_scheduler=sched, sampler=sampler)

    def step() -> float:
        # Every RNG the state promises to restore feeds the step.
        x = torch.randn(8, 16) * float(np.random.rand() + random.random())
        x = x + sampler.pos
        sampler.pos += 1
        opt.zero_grad()
        loss = model(x).pow(2).mean()
        loss.backward()
        opt.step()
        sched.step()
        return loss.item()

    return model, opt, state, step


def params(model: torch.nn.Module) -> list[torch.Tensor]:
    return [p.detach().clone() for p in model.parameters()]


def test_restore_is_bit_identical_including_adam_and_rng():
    model, opt, state, step = make_training()
    for _ in range(5):
        step()
    store = SnapshotStore(state)
    store.commit(5)
    first = [step() for _ in range(4)]
    first_params = params(model)
    first_adam = [opt.state[p]["exp_avg_sq"].clone() for p in model.parameters()]
    first_step_count = [opt.state[p]["step"].clone() for p in model.parameters()]

    snap = store.latest()
    assert snap is not None and snap.step == 5 and snap.verify()
    state.restore_from(snap.layout, snap.data)
    second = [step() for _ in range(4)]
    assert first == second
    for a, b in zip(first_params, params(model)):
        assert torch.equal(a, b)
    for p, a, c in zip(model.parameters(), first_adam, first_step_count):
        assert torch.equal(opt.state[p]["exp_avg_sq"], a)
        assert torch.equal(opt.state[p]["step"], c) and c.item() == 9


def test_restore_into_a_fresh_process_state_from_bytes():
    """A replacement builds its own objects, gets only bytes + layout JSON, and continues."""
    model, _, state, step = make_training(seed=1)
    for _ in range(3):
        step()
    snap = SnapshotStore(state).commit(3)
    wire_layout, wire_data = snap.layout.to_json(), bytearray(snap.data)
    expected = [step() for _ in range(3)]

    model2, _, state2, step2 = make_training(seed=99)
    state2.restore_from(Layout.from_json(wire_layout), wire_data)
    wire_data[:] = b"\0" * len(wire_data)  # restored tensors must not alias the buffer
    assert [step2() for _ in range(3)] == expected
    for a, b in zip(params(model), params(model2)):
        assert torch.equal(a, b)


def test_steady_state_reuses_the_two_slot_buffers():
    _, _, state, step = make_training()
    store = SnapshotStore(state)
    store.commit(0)  # before the first step: no optimizer state yet
    small = store.latest().layout.nbytes
    ptrs = set()
    for s in range(1, 9):
        step()
        store.commit(s)
        ptrs.add(store.slots._bufs[store.slots._current].data_ptr())
    assert store.latest().layout.nbytes > small  # Adam's moments appeared and were captured
    # Slot 0 held the pre-step snapshot and grew once; after that, two buffers alternate.
    assert len(ptrs) <= 3
    later = set()
    for s in range(9, 15):
        step()
        store.commit(s)
        later.add(store.slots._bufs[store.slots._current].data_ptr())
    assert len(later) == 2 and later <= ptrs


def test_failed_capture_keeps_the_last_good_snapshot():
    class Flaky(Sampler):
        fail = False

        def state_dict(self) -> dict:
            if self.fail:
                raise RuntimeError("device lost mid-capture")
            return super().state_dict()

    model, _, state, step = make_training()
    flaky = Flaky()
    state.unregister("sampler")
    state.register(sampler=flaky)
    store = SnapshotStore(state)
    step()
    store.commit(1)
    step()
    store.commit(2)
    flaky.fail = True
    with pytest.raises(RuntimeError):
        store.commit(3)
    snap = store.latest()
    assert snap.step == 2 and snap.verify()
    assert store.slots.steps() == [2]  # the slot being written was invalidated, not published
    flaky.fail = False
    store.commit(3)  # the writer lock was released
    assert store.slots.steps() == [2, 3]


def test_scopes_split_shared_and_rank_state():
    _, _, state, step = make_training()
    step()
    rank_layout, _ = state.capture_into(None, ("rank",))
    shared_layout, _ = state.capture_into(None, ("shared",))
    rank_keys = {kv[0] for kv in rank_layout.tree["d"]}
    assert {"sampler", "rng", "extras"} <= rank_keys and "model" not in rank_keys
    shared_keys = {kv[0] for kv in shared_layout.tree["d"]}
    assert shared_keys == {"model", "optimizer", "lr_scheduler"}
    assert (32, 16) in {e.shape for e in shared_layout.entries}
    assert (32, 16) not in {e.shape for e in rank_layout.entries}


def test_extras_round_trip_with_tensors_tuples_and_int_keys():
    _, _, state, _ = make_training()
    extras = {"epoch": 3, "best": float("inf"), "pair": (1, "a"), "by_id": {7: [1.5, None]},
              "ema": torch.arange(6, dtype=torch.bfloat16).reshape(2, 3), "empty": torch.zeros(0)}
    state.extras = dict(extras)
    layout, buf = state.capture_into(None)
    state.extras = {}
    state.restore_from(Layout.from_json(layout.to_json()), buf)
    got = state.extras
    assert got["pair"] == (1, "a") and got["by_id"] == {7: [1.5, None]} and got["best"] == float("inf")
    assert torch.equal(got["ema"], extras["ema"]) and got["ema"].dtype == torch.bfloat16
    assert got["empty"].shape == (0,)


def test_unsupported_values_and_registrations_are_clear_errors():
    state = TrainState()
    state.extras = {"fn": print}
    with pytest.raises(HpctError, match="extras.fn: values of type builtin_function_or_method"):
        state.capture_into(None)
    with pytest.raises(HpctError, match="no state_dict/load_state_dict"):
        state.register(model=object())
    with pytest.raises(HpctError, match="reserved"):
        state.register(rng=Sampler())
    model, _, full, _ = make_training()
    layout, buf = full.capture_into(None)
    partial = TrainState(model=model)
    partial.restore_from(layout, buf)  # what nobody registered waits for a register() ...
    problems = partial.prove()         # ... and the proof names whatever never came
    assert any(p.startswith("optimizer: restored, but no object") for p in problems), problems


def test_an_unsupported_value_deep_in_a_state_dict_is_named_by_its_path():
    state = TrainState()
    state.extras = {"runs": [{"ok": 1}, {7: (2, {"cb": print})}]}
    with pytest.raises(HpctError, match=r"state\.extras\.runs\[1\]\.7\[1\]\.cb: values of "
                                        r"type builtin_function_or_method"):
        state.capture_into(None)
    state.extras = {object(): 1}  # a key is named as one
    with pytest.raises(HpctError, match=r"state\.extras key: values of type object"):
        state.capture_into(None)


def test_a_plan_reused_from_the_last_step_follows_a_change_of_shape():
    """A plan reuses its entries while the tensors keep their kinds and shapes; a tensor
    replaced by one of another shape (or dtype) gets a layout of its own, and the snapshot
    restores it."""
    model, _, state, step = make_training()
    step()
    first, _ = state.plan()
    again, _ = state.plan()
    assert again.entries is first.entries  # reused, not rebuilt
    state.extras = {"ema": torch.arange(6.0)}
    grown, _ = state.plan()
    assert len(grown.entries) == len(first.entries) + 1
    state.extras = {"ema": torch.arange(10.0).reshape(2, 5).to(torch.float64)}
    layout, buf = state.capture_into(None)
    assert layout.entries is not grown.entries
    assert (layout.entries[-1].shape, layout.entries[-1].dtype) == ((2, 5), "float64")
    state.extras = {}
    state.restore_from(Layout.from_json(layout.to_json()), buf)
    assert torch.equal(state.extras["ema"], torch.arange(10.0).reshape(2, 5).to(torch.float64))
    assert layout.nbytes == Layout.from_json(layout.to_json()).nbytes


def test_replica_store_keeps_previous_on_checksum_mismatch():
    _, _, state, step = make_training()
    step()
    snap = SnapshotStore(state).commit(1)
    replicas = ReplicaStore()
    idx, buf = replicas.begin(3, snap.layout.nbytes)
    buf.numpy()[:snap.layout.nbytes] = np.frombuffer(snap.data, dtype=np.uint8)
    replicas.finish(3, idx, buf, 1, snap.layout, snap.digest())
    idx, buf = replicas.begin(3, snap.layout.nbytes)
    buf.numpy()[:snap.layout.nbytes] = 7  # garbage "received"
    with pytest.raises(HpctError, match="kept the previous replica"):
        replicas.finish(3, idx, buf, 2, snap.layout, snap.digest())
    kept = replicas.latest(3)
    assert kept.step == 1 and kept.verify() and bytes(kept.data) == bytes(snap.data)


def test_commit_is_only_a_copy_and_the_digest_is_sealed_once_on_demand():
    _, _, state, step = make_training()
    step()
    store = SnapshotStore(state)
    snap = store.commit(1)
    assert not snap.sealed  # nothing hashed in steady state
    d = snap.digest()
    assert snap.sealed and d == P.part_digest(bytes(snap.data)) and snap.digest() is d
    assert snap.verify()
    snap.data[3] ^= 0x01  # memory rots after sealing
    assert not snap.verify()


def test_background_sealer_seals_the_newest_commit():
    _, _, state, step = make_training()
    step()
    snap = SnapshotStore(state, background_seal=True).commit(1)
    deadline = time.monotonic() + 30
    while not snap.sealed:
        assert time.monotonic() < deadline, "the sealer never sealed the commit"
        time.sleep(0.01)
    assert snap.digest() == P.part_digest(bytes(snap.data))


def test_a_superseded_snapshot_is_never_sealed_with_other_bytes():
    data = bytearray(b"x" * (3 * P.CHUNK))
    layout = Layout((), {}, len(data))
    snap = Snapshot(1, layout, memoryview(data))
    snap.superseded.set()  # what a writer does before it overwrites the slot
    assert not snap.seal_in_background() and not snap.sealed
    # ...and the writer's acquire marks the snapshot in the slot it is about to overwrite
    _, _, state, step = make_training()
    store = SnapshotStore(state, background_seal=False)
    old = store.commit(1)
    store.commit(2)
    assert not old.superseded.is_set()
    store.commit(3)
    assert old.superseded.is_set()


def test_every_k_steps_commits_on_the_same_steps_on_every_rank():
    _, _, state, step = make_training()
    store = SnapshotStore(state, every=4, background_seal=False)
    committed = []
    for s in range(11):
        step()
        if store.after_step(s) is not None:
            committed.append(s)
    assert committed == [0, 4, 8] and store.slots.steps() == [4, 8]
    with pytest.raises(HpctError, match="every=0 must be >= 1"):
        SnapshotStore(state, every=0)


@given(st.integers(min_value=2, max_value=64), st.integers(min_value=1, max_value=8))
def test_ring_placement_puts_every_replica_on_another_node(num_nodes, tpn):
    held: list[int] = []
    for node in range(num_nodes):
        peer = replica_peer(node, num_nodes)
        assert peer != node and replica_source_node(peer, num_nodes) == node
        held += ranks_held_by(node, num_nodes, tpn)
        for r in ranks_held_by(node, num_nodes, tpn):
            assert r // tpn != node and replica_peer_rank(r, num_nodes, tpn) // tpn == node
    assert sorted(held) == list(range(num_nodes * tpn))  # each rank replicated exactly once


@given(st.integers(min_value=4, max_value=64))
def test_two_adjacent_nodes_never_hold_each_others_only_copy(num_nodes):
    # issue 19: two neighbouring nodes lost together took a state and its replica with them
    for node in range(num_nodes):
        nxt = (node + 1) % num_nodes
        assert replica_peer(node, num_nodes) not in (node, nxt)
        assert replica_peer(nxt, num_nodes) != node


def test_ring_placement_rejects_bad_input():
    with pytest.raises(HpctError, match="at least 2 nodes"):
        replica_peer(0, 1)
    with pytest.raises(HpctError, match="outside 0..3"):
        replica_peer(4, 4)


def test_choose_mode(tmp_path):
    model, opt, state, _ = make_training()
    assert choose_mode(state) == "replicated"  # not DDP: no peer is known to hold the state
    assert choose_mode(state, force="jit") == "jit"
    with pytest.raises(HpctError, match="not 'jit' or 'replicated'"):
        choose_mode(state, force="fast")  # type: ignore[arg-type]
    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/store", rank=0, world_size=1,
                            timeout=timedelta(seconds=30))
    try:
        ddp = torch.nn.parallel.DistributedDataParallel(model)
        assert choose_mode(TrainState(model=ddp, optimizer=opt)) == "jit"
    finally:
        dist.destroy_process_group()


class _Position:
    def __init__(self, n: int = 0) -> None:
        self.n = n

    def state_dict(self) -> dict:
        return {"n": self.n}

    def load_state_dict(self, sd: dict) -> None:
        self.n = sd["n"]


def test_job_picks_jit_for_data_parallel_and_honours_a_forced_mode():
    model = torch.nn.Linear(2, 2)
    state = TrainState(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1))
    assert choose_mode(state, data_parallel=True) == "jit"
    assert choose_mode(state, force="replicated", data_parallel=True) == "replicated"


def test_rank_state_is_known_and_restored_only_for_its_scope():
    model = torch.nn.Linear(2, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    assert not TrainState(model=model, optimizer=opt).has_rank_state()
    pos = _Position(5)
    state = TrainState(model=model, optimizer=opt, sampler=pos)
    assert state.has_rank_state()
    layout, buf = state.capture_into(None)
    before = [p.detach().clone() for p in model.parameters()]
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)
    pos.n = 99
    # another rank's snapshot: only the shared scope (the model) comes back
    state.restore_from(layout, buf, scopes=("shared",))
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
    assert pos.n == 99
    state.restore_from(layout, buf, scopes=("rank",))
    assert pos.n == 5


def test_a_survivors_restore_fills_its_own_optimizer_tensors_and_keeps_nothing_of_the_buffer():
    """Restoring over live state allocates no new optimizer state (fresh memory is what made
    restores slow): the same tensors hold the snapshot's values afterwards, bit for bit, and
    nothing refers into the snapshot buffer."""
    model, opt, state, step = make_training()
    for _ in range(3):
        step()
    snap = SnapshotStore(state).commit(3)
    buf = bytearray(snap.data)
    expected = [step() for _ in range(3)]
    before = {id(t) for s in opt.state.values() for t in s.values()}
    state.restore_from(snap.layout, buf)
    assert {id(t) for s in opt.state.values() for t in s.values()} == before
    buf[:] = b"\0" * len(buf)  # restored state must not alias the buffer
    assert [step() for _ in range(3)] == expected


def _empty_replica(_payload: bytes) -> tuple[Layout, bytes, bytes]:
    """A deferred replica's decoder for a state without tensor bytes."""
    return Layout((), {}, 0), b"", P.part_digest(b"")


def test_a_reader_waits_for_a_deferred_replica_another_thread_is_decoding():
    """ReplicaStore._settle: thread A takes rank 0's deferred step 2 and decodes it (slowed:
    it waits for the test). Thread B, reading meanwhile, finds nothing deferred any more; it
    must wait for A's decode, not answer the step before (it answered [1] while A held step
    2). The interleaving is forced with events, never timed: A decodes only once B has either
    answered or gone to wait for A's settling."""
    import threading

    held = ReplicaStore()
    held.defer(0, 1, b"", _empty_replica, lambda s, why: None)
    assert held.steps(0) == [1]
    decoding, b_moved = threading.Event(), threading.Event()

    class Watched:
        """The store's settling lock, telling when thread B comes to wait on it."""

        def __init__(self, lock) -> None:
            self.lock = lock

        def __enter__(self):
            if threading.current_thread().name == "B":
                b_moved.set()
            return self.lock.__enter__()

        def __exit__(self, *exc):
            return self.lock.__exit__(*exc)

    held._settling = Watched(held._settling)

    def slowed(payload: bytes) -> tuple[Layout, bytes, bytes]:
        decoding.set()
        assert b_moved.wait(30), "thread B neither answered nor waited"
        return _empty_replica(payload)

    held.defer(0, 2, b"", slowed, lambda s, why: None)
    answers: dict[str, list[int]] = {}

    def read(name: str) -> None:
        answers[name] = held.steps(0)
        b_moved.set()  # (B answered without waiting: let A finish)

    a = threading.Thread(target=read, args=("A",), name="A")
    a.start()
    assert decoding.wait(30)
    b = threading.Thread(target=read, args=("B",), name="B")
    b.start()
    a.join(30)
    b.join(30)
    assert answers == {"A": [1, 2], "B": [1, 2]}


def _layout_json(nbytes="128", entry='["float32",[2,3],64,24,false]', tree="{}") -> str:
    return f'{{"nbytes":{nbytes},"tree":{tree},"entries":[{entry}]}}'


@pytest.mark.parametrize("raw, field", [
    (_layout_json(nbytes="Infinity"), "nbytes"),          # was OverflowError
    (_layout_json(nbytes="NaN"), "nbytes"),
    (_layout_json(nbytes="128.0"), "nbytes"),
    (_layout_json(nbytes="-1"), "nbytes"),
    (_layout_json(nbytes="true"), "nbytes"),
    (_layout_json(nbytes='"128"'), "nbytes"),
    (_layout_json(nbytes=str(1 << 63)), "nbytes"),
    (_layout_json(entry='["float32",[2,3],Infinity,24,false]'), "entries[0].offset"),
    (_layout_json(entry='["float32",[2,3],64,1e400,false]'), "entries[0].nbytes"),
    (_layout_json(entry='["float32",[2,Infinity],64,24,false]'), "entries[0].shape[1]"),
    (_layout_json(entry='["load",[1],64,1,false]'), "entries[0].dtype"),  # was accepted
    (_layout_json(entry='["qint8",[1],64,1,false]'), "entries[0].dtype"),
    (_layout_json(entry='["float32",[2,3],64,24,1]'), "entries[0].numpy"),
    (_layout_json(entry='["bfloat16",[2,3],64,12,true]'), "entries[0] is a numpy array"),
    (_layout_json(entry='["float32",[2,3],64,25,false]'), "entries[0].nbytes is 25"),
    (_layout_json(entry='["float32",[2,3],66,24,false]'), "entries[0].offset 66"),
    (_layout_json(entry='["float32",[2,3],112,24,false]'), "entries[0].offset 112"),
    (_layout_json(entry='["float32",[2,3],64,24]'), "entries[0] is"),
    (_layout_json(tree="[]"), "tree"),
    ('{"nbytes":128,"tree":{},"entries":{}}', "entries"),
    ("[]", "not an object"),
    ("{not json", "not JSON"),
    (b"\xff", "not JSON"),
])
def test_a_layout_is_checked_field_by_field_and_a_bad_one_named(raw, field):
    """Layout.from_json on what a peer or a file could hold: anything but a sound layout
    raises HpctError naming the field (the callers' "this copy is bad"), never an
    OverflowError, and no dtype is taken that a restore cannot view as (torch.load)."""
    with pytest.raises(HpctError, match=re.escape(field)):
        Layout.from_json(raw)


def test_every_layout_a_capture_makes_reads_back_the_same():
    """The checks take what TrainState writes: a model, Adam, a scheduler, a sampler, the RNG
    states (numpy's uint32 array among them), bf16, bool and empty tensors."""
    _, _, state, step = make_training()
    step()
    state.extras["odd"] = {"bf16": torch.ones(3, dtype=torch.bfloat16),
                           "mask": torch.tensor([True, False]), "none": torch.empty(0, 5)}
    layout, buf = state.capture_into(None)
    assert any(e.numpy for e in layout.entries)
    assert Layout.from_json(layout.to_json()) == layout
    state.restore_from(Layout.from_json(layout.to_json()), buf)
