"""A rank's own small state carried to its ring holder in the gradient all-reduce (carry.py):
the slot's encoding and its refusals, the holder's replica servable as a pushed one, the
step's-end check, and 4 real gloo ranks (2 nodes x 2) through average_gradients."""
from __future__ import annotations

import datetime
import hashlib
import io
import json

import pytest
import torch

from hpct_slurm.errors import HpctError
from hpct_slurm.events import EventLog
from hpct_slurm.recovery import carry as C
from hpct_slurm.recovery.replicas import ReplicaStore
from hpct_slurm.recovery.snapshot import SnapshotStore
from hpct_slurm.recovery.state import TrainState
from hpct_slurm.recovery.transfer import TransferServer, fetch_state

from _ranks import gloo_processes
from test_rank_snapshot_cost import Position

SECRET = b"s" * 32
KEY = C.slot_key(SECRET)
JOB = "carry"


def _events() -> tuple[EventLog, io.StringIO]:
    stream = io.StringIO()
    return EventLog(stream=stream), stream


def _named(stream: io.StringIO, name: str) -> list[dict]:
    return [e for e in map(json.loads, stream.getvalue().splitlines()) if e["event"] == name]


def test_a_slot_round_trips_and_bad_slots_are_refused_by_name():
    blob = C.encode(7, b'{"nbytes":3,"tree":{},"entries":[]}', b"abc", key=KEY, rank=0)
    assert blob is not None
    slot = blob + bytes(C.SLOT_BYTES - len(blob))
    step, layout, data = C.decode(slot, key=KEY, rank=0)
    assert (step, layout.nbytes, data) == (7, 3, b"abc")
    assert C.decode(bytes(C.SLOT_BYTES), key=KEY, rank=0) is None  # a rank that sent nothing
    # does not fit: pushed instead
    assert C.encode(1, b"{}", bytes(C.SLOT_BYTES), key=KEY, rank=0) is None
    torn = bytearray(slot)
    torn[20] ^= 1
    with pytest.raises(HpctError, match="fails its MAC"):
        C.decode(bytes(torn), key=KEY, rank=0)
    with pytest.raises(HpctError, match="magic"):
        C.decode(b"\x07" + slot[1:], key=KEY, rank=0)
    with pytest.raises(HpctError, match="not 512"):
        C.decode(slot[:-1], key=KEY, rank=0)
    lying = C.encode(7, b'{"nbytes":4,"tree":{},"entries":[]}', b"abc", key=KEY, rank=0)
    with pytest.raises(HpctError, match="says 4 bytes"):
        C.decode(lying + bytes(C.SLOT_BYTES - len(lying)), key=KEY, rank=0)


def _rank(rank: int, step: list[int], replicas: ReplicaStore, log: EventLog
          ) -> tuple[Position, C.Carry, SnapshotStore]:
    """Rank `rank` of a 2-rank group on 2 nodes: each holds the other's replica."""
    pos = Position()
    state = TrainState(sampler=pos)
    carry = C.Carry(state, rank, 2, C.Carry.held_by(rank, 2, 1), replicas, log,
                    lambda: step[0], C.CarryRecord(), secret=SECRET)
    return pos, carry, SnapshotStore(state, ("rank",), rng=False)


def _all_reduce(*regions: torch.Tensor) -> torch.Tensor:
    """What gloo's sum gives every rank (the collective itself: the gloo test below)."""
    total = torch.zeros_like(regions[0])
    for r in regions:
        total += r
    return total


def _two_ranks(steps: int, moved_at: int | None = None
               ) -> tuple[list[str], ReplicaStore, io.StringIO, SnapshotStore, EventLog]:
    """`steps` steps of ranks 0 and 1 (each the other's holder), the all-reduce summed by
    hand; rank 0 draws 10 samples a step, and at `moved_at` one more after the all-reduce.
    Rank 0's end-of-step outcomes, rank 1's replicas, the events, rank 0's own snapshots."""
    step = [0]
    log, stream = _events()
    held_by_1 = ReplicaStore()
    pos0, carry0, own0 = _rank(0, step, ReplicaStore(), log)
    _, carry1, _ = _rank(1, step, held_by_1, log)
    outcomes = []
    for s in range(steps):
        step[0] = s
        pos0.consumed = 10 * (s + 1)  # the step's batch drawn
        total = _all_reduce(carry0.region(), carry1.region())
        carry0.take(total)
        carry1.take(total)
        if s == moved_at:
            pos0.consumed += 1  # moved after the all-reduce: the carried copy is not step s
        outcomes.append(carry0.commit(s, own0)[1])
    return outcomes, held_by_1, stream, own0, log


def test_the_holder_keeps_the_carried_step_and_serves_it_as_a_pushed_one():
    outcomes, held_by_1, stream, _, log = _two_ranks(4)
    # probation: the first step only checks that the state stays put; then it is carried
    assert outcomes == ["push", "carried", "carried", "carried"]
    assert held_by_1.steps(0) == [2, 3]
    # rank 0's steps 1-3 are held (rank 1's end of step is never checked here: it carries
    # nothing), and recorded once, where the run of carried steps began: not a record a step
    assert [(e["rank"], e["step"], e["via"]) for e in _named(stream, "replica.stored")] == [
        (0, 1, "carry")]
    with TransferServer(SECRET, JOB, 1, replicas=held_by_1, events=log) as holder:
        got = fetch_state([holder.address], 0, SECRET, JOB, step=3)
    fresh = Position()
    TrainState(sampler=fresh).restore_from(got.layout, got.data, scopes=("rank",))
    assert fresh.consumed == 40


def test_a_holder_records_where_each_run_of_carried_steps_begins():
    """`replica.stored` once per run of consecutive carried steps of a held rank, not once a
    step (each record is a write to the holder's event log on a shared file system): steps 1
    and 2, then after a gap (the rank pushed meanwhile) steps 5 and 6, make two records; every
    step is held all the same."""
    log, stream = _events()
    held = ReplicaStore()
    carry = C.Carry(TrainState(sampler=Position()), 1, 2, [0], held, log, lambda: 0,
                    C.CarryRecord(), secret=SECRET)
    layout = TrainState(sampler=Position()).plan(("rank",), rng=False)[0].to_json()
    for s in (1, 2, 5, 6):
        carry.take(_carried_region(s, layout))
        assert held.latest(0).step == s
    assert [(e["rank"], e["step"]) for e in _named(stream, "replica.stored")] == [(0, 1), (0, 5)]


def _carried_region(step: int, layout: bytes, torn: bool = False) -> torch.Tensor:
    """The region of a 2-rank group where rank 0 carried `step` (`torn`: one byte of its
    body flipped on the way, its head intact)."""
    region = torch.zeros(2 * C.SLOT_BYTES, dtype=torch.uint8)
    blob = bytearray(C.encode(step, layout, b"", key=KEY, rank=0))
    if torn:
        blob[-C._CHECK - 2] ^= 1
    region[:len(blob)] = torch.frombuffer(blob, dtype=torch.uint8)
    return region


def test_a_carried_slot_is_checked_where_it_is_read_and_a_torn_one_leaves_what_was_held():
    """The holder stores each slot as it came and decodes it at the first read of that
    rank's replicas (ReplicaStore.defer: not on the training thread every step). Read then, a
    torn slot is refused by name and the step before it stays held; of a run of slots never
    read, the two newest wait (what the slots keep), and a step the holder pins is decoded
    at once and outlives them."""
    log, stream = _events()
    pinned = {4}
    held = ReplicaStore(pin=lambda s: s in pinned)
    carry = C.Carry(TrainState(sampler=Position()), 1, 2, [0], held, log, lambda: 0,
                    C.CarryRecord(), secret=SECRET)
    layout = TrainState(sampler=Position()).plan(("rank",), rng=False)[0].to_json()
    carry.take(_carried_region(1, layout))
    carry.take(_carried_region(2, layout, torn=True))
    assert not _named(stream, "replica.rejected")  # not read yet: nothing decoded
    assert held.steps(0) == [1]  # the read decodes both: step 2 refused, step 1 held
    [refused] = _named(stream, "replica.rejected")
    assert (refused["rank"], refused["step"], refused["via"]) == (0, 2, "carry")
    assert "fails its MAC" in refused["error"]
    for s in (4, 5, 6, 7):  # 4 is pinned: decoded as it comes; 5 is overtaken unread
        carry.take(_carried_region(s, layout))
    assert held.steps(0) == [4, 6, 7]
    with held.lease(0, 7) as snap:
        assert snap is not None and snap.sealed
    bad_head = _carried_region(8, layout)
    bad_head[0] = 0x07
    carry.take(bad_head)  # a head not of this version: refused as it comes
    assert _named(stream, "replica.rejected")[-1]["error"].startswith("carried slot has magic")
    assert held.steps(0) == [4, 6, 7]


def test_a_state_that_moves_after_the_all_reduce_is_replaced_and_then_pushed():
    outcomes, held_by_1, stream, own0, _ = _two_ranks(4, moved_at=2)
    assert outcomes == ["push", "carried", "replace", "push"]
    [moved] = _named(stream, "rank.state_moved_after_reduce")
    assert moved["step"] == 2 and moved["carried"] is True
    # from then on nothing is carried: the holder's newest is the (wrong) carried step 2,
    # which the policy's synchronous push replaces; the step before stays
    assert held_by_1.steps(0) == [1, 2]
    with own0.lease(2) as snap:
        idx, buf = held_by_1.begin(0, snap.layout.nbytes, 2)
        held_by_1.finish(0, idx, buf, 2, snap.layout, snap.digest())
    assert held_by_1.steps(0) == [1, 2]
    with held_by_1.lease(0, 2) as got:
        fresh = Position()
        TrainState(sampler=fresh).restore_from(got.layout, got.data, scopes=("rank",))
    assert fresh.consumed == 31


def test_the_steps_end_publishes_the_capture_itself_only_where_it_is_the_live_state():
    """Carry.commit: a capture without tensor bytes whose fresh plan reads the same becomes
    the rank's snapshot as it is (the same layout and bytes a commit makes); a state with
    tensor bytes (an extra tensor) is committed from the live state, and compared."""
    step = [0]
    log, _ = _events()
    pos, carry, own = _rank(0, step, ReplicaStore(), log)
    reference = SnapshotStore(carry.state, ("rank",), rng=False)
    calls = []
    real_commit = own.commit
    own.commit = lambda s: calls.append(s) or real_commit(s)  # type: ignore[method-assign]
    for s in range(3):
        step[0] = s
        pos.consumed = 5 * s
        carry.region()
        snap, held = carry.commit(s, own)
        assert held == ("push" if s == 0 else "carried")
        ref = reference.commit(s)
        assert (snap.step, snap.layout.to_json(), bytes(snap.data)) == (
            ref.step, ref.layout.to_json(), bytes(ref.data))
        assert own.latest() is snap
    assert calls == []  # no second capture
    carry.state.extras["counts"] = torch.arange(4)
    step[0] = 3
    carry.region()
    snap, held = carry.commit(3, own)
    # carried: only the tensor's 32 bytes are compared, not the padding after it (before,
    # whatever an uninitialised buffer held there made this "replace" and every later step a
    # push)
    assert calls == [3] and held == "carried" and snap.layout.entries[0].nbytes == 32
    step[0] = 4
    carry.region()
    carry.state.extras["counts"] += 1  # moved after the all-reduce: caught by the compare
    assert carry.commit(4, own)[1] == "replace"


def test_a_state_too_big_for_a_slot_is_pushed_and_said_once():
    step = [0]
    log, stream = _events()
    pos, carry, own = _rank(0, step, ReplicaStore(), log)
    pos.consumed = 0
    carry.record.verified = 1
    big = Position()
    big.state_dict = lambda: {"history": list(range(C.SLOT_BYTES))}  # type: ignore[method-assign]
    carry.state.register(scope="rank", big=big)
    for s in range(2):
        step[0] = s
        region = carry.region()
        assert not region.any()  # nothing carried
        assert carry.commit(s, own)[1] == "push"
    assert len(_named(stream, "rank.carry_too_big")) == 1


WORLD, NODES = 4, 2


def _worker(rank: int, port: int, q) -> None:
    import torch.distributed as dist

    from hpct_slurm.recovery.gradients import average_gradients, parameter_gradients

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=WORLD, timeout=datetime.timedelta(seconds=60))
    log, _ = _events()
    step = [0]
    pos = Position()
    replicas = ReplicaStore()
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))
    plain = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))
    plain.load_state_dict(model.state_dict())
    state = TrainState(model=model, sampler=pos)
    assert C.Carry.applies(rank, WORLD, NODES)
    carry = C.Carry(state, rank, WORLD, C.Carry.held_by(rank, NODES, WORLD // NODES),
                    replicas, log, lambda: step[0], C.CarryRecord(), secret=SECRET)
    own = SnapshotStore(state, ("rank",), rng=False)
    g = torch.Generator().manual_seed(rank)
    outcomes, same_grads = [], True
    for s in range(3):
        step[0] = s
        pos.consumed = 1000 * rank + s
        x = torch.randn(32, 8, generator=g)
        for m in (model, plain):
            m.zero_grad()
            m(x).pow(2).mean().backward()
        average_gradients(parameter_gradients(model), WORLD, carry)
        average_gradients(parameter_gradients(plain), WORLD)
        same_grads &= all(torch.equal(a.grad, b.grad) for a, b in
                          zip(model.parameters(), plain.parameters()))
        outcomes.append(carry.commit(s, own)[1])
    held = {}
    for r in carry.held:
        with replicas.lease(r) as snap:
            fresh = Position()
            TrainState(sampler=fresh).restore_from(snap.layout, snap.data, scopes=("rank",))
            held[r] = (snap.step, fresh.consumed)
    dist.destroy_process_group()
    q.put((rank, outcomes, same_grads, held))


def test_four_gloo_ranks_carry_their_positions_to_their_holders_and_the_gradients_stay():
    got = gloo_processes(WORLD, _worker)
    for rank, outcomes, same_grads, held in got:
        assert outcomes == ["push", "carried", "carried"], (rank, outcomes)
        # its own all-reduce: the gradients' sums are those of the step without it
        assert same_grads, f"rank {rank}: the carried region changed the gradients"
        # the same local rank on the node half the ring away: 0 <-> 2, 1 <-> 3
        peer = (rank + 2) % WORLD
        assert held == {peer: (2, 1000 * peer + 2)}, (rank, held)


def test_a_state_that_cannot_be_captured_still_takes_part_with_an_empty_slot():
    """The others are already in the all-reduce: the rank joins with nothing in its slot, and
    the error is the step's end's (its commit captures the same state)."""
    step = [3]
    log, _ = _events()
    pos, carry, _ = _rank(0, step, ReplicaStore(), log)
    carry.record.verified = 1

    def broken() -> dict:
        raise ValueError("the sampler's state is not readable")

    pos.state_dict = broken  # type: ignore[method-assign]
    region = carry.region()
    assert region.numel() == 2 * C.SLOT_BYTES and not region.any()
    assert carry.captured is None


def test_put_makes_given_bytes_the_current_snapshot_and_refuses_a_size_its_layout_denies():
    """SnapshotStore.put, with tensor bytes: what a commit of the same state would hold, made
    current as given; bytes of another size than the layout's are refused, naming both, and
    the store keeps what it had."""
    pos = Position()
    state = TrainState(sampler=pos)
    state.extras["counts"] = torch.arange(4)
    committed = SnapshotStore(state, ("rank",), rng=False).commit(0)
    layout, data = committed.layout, bytes(committed.data)
    store = SnapshotStore(state, ("rank",), rng=False)
    snap = store.put(3, layout, data)
    assert store.latest() is snap and snap.step == 3 and bytes(snap.data) == data
    fresh = Position()
    restored = TrainState(sampler=fresh)
    restored.restore_from(snap.layout, snap.data, scopes=("rank",))
    assert torch.equal(restored.extras["counts"], torch.arange(4))
    with pytest.raises(HpctError, match=f"says {layout.nbytes} bytes, 3 given"):
        store.put(4, layout, b"abc")
    assert store.latest() is snap


def _slot_region(step: int, layout: bytes) -> torch.Tensor:
    """The region of a 2-rank group where rank 0's slot holds `layout` (no tensor bytes) at
    `step`, however malformed the layout: its head and check are sound."""
    region = torch.zeros(2 * C.SLOT_BYTES, dtype=torch.uint8)
    blob = C.encode(step, layout, b"", key=KEY, rank=0)
    region[:len(blob)] = torch.frombuffer(bytearray(blob), dtype=torch.uint8)
    return region


def test_a_slot_with_a_malformed_layout_is_refused_and_loses_nothing_else():
    """A carried slot whose layout holds JSON's Infinity (its check sound): refused by name
    when read (`replica.rejected`), while the slot waiting beside it is stored and a fetch of
    a held step, whose read is the first (on the transfer server's connection thread), is
    served. Before, Layout.from_json's OverflowError came out of that read: the waiting slot
    was lost with it and the server's thread died, so the fetch of a valid step failed."""
    log, stream = _events()
    held = ReplicaStore()
    carry = C.Carry(TrainState(sampler=Position()), 1, 2, [0], held, log, lambda: 0,
                    C.CarryRecord(), secret=SECRET)
    pos = Position()
    state = TrainState(sampler=pos)
    pos.consumed = 10
    carry.take(_slot_region(1, state.plan(("rank",), rng=False)[0].to_json()))
    assert held.steps(0) == [1]
    carry.take(_slot_region(2, b'{"nbytes":Infinity,"tree":{},"entries":[]}'))
    pos.consumed = 30
    carry.take(_slot_region(3, state.plan(("rank",), rng=False)[0].to_json()))
    with TransferServer(SECRET, JOB, 1, replicas=held, events=log) as holder:
        got = fetch_state([holder.address], 0, SECRET, JOB, step=3)
        fresh = Position()
        TrainState(sampler=fresh).restore_from(got.layout, got.data, scopes=("rank",))
        assert fresh.consumed == 30
        [refused] = _named(stream, "replica.rejected")
        assert (refused["rank"], refused["step"], refused["via"]) == (0, 2, "carry")
        assert "nbytes" in refused["error"]
        carry.take(_slot_region(4, b'{"nbytes":0,"tree":{},"entries":[["load",[],0,0,false]]}'))
        assert held.steps(0) == [1, 3]  # refused too: a dtype that is no tensor dtype
        assert "dtype" in _named(stream, "replica.rejected")[-1]["error"]
        assert fetch_state([holder.address], 0, SECRET, JOB, step=1).step == 1


def _committed(step: int, consumed: int):
    """Rank 0's committed snapshot of `step` at sampler position `consumed`."""
    pos = Position()
    pos.consumed = consumed
    return SnapshotStore(TrainState(sampler=pos), ("rank",), rng=False).commit(step)


def _held_position(held: ReplicaStore, step: int) -> int:
    with held.lease(0, step) as snap:
        fresh = Position()
        TrainState(sampler=fresh).restore_from(snap.layout, snap.data, scopes=("rank",))
    return fresh.consumed


def test_a_carried_slot_never_replaces_the_committed_copy_of_its_step():
    """The owner's state moved after its all-reduce of step 5 (50 -> 51), so its step's end
    pushed the committed copy ("replace"). The holder took the push before it took its own
    all-reduce's slots: the carried copy of step 5 (50) comes second. It is dropped, said in
    `replica.rejected`, and step 5 stays the committed 51 (before, the carried copy replaced
    it, silently: a wrong rank state on restore). The other order keeps the push too (the
    push replaces the carried copy): the committed copy wins whichever comes first."""
    log, stream = _events()
    held = ReplicaStore()
    carry = C.Carry(TrainState(sampler=Position()), 1, 2, [0], held, log, lambda: 0,
                    C.CarryRecord(), secret=SECRET)

    def carried(step: int, consumed: int) -> torch.Tensor:
        pos = Position()
        pos.consumed = consumed
        return _slot_region(step, TrainState(sampler=pos).plan(("rank",), rng=False)[0].to_json())

    def push(snap) -> None:
        idx, buf = held.begin(0, snap.layout.nbytes, snap.step)
        held.finish(0, idx, buf, snap.step, snap.layout, snap.digest())

    carry.take(carried(4, 40))
    push(_committed(5, 51))
    carry.take(carried(5, 50))
    assert held.steps(0) == [4, 5]
    assert _held_position(held, 5) == 51
    [dropped] = _named(stream, "replica.rejected")
    assert (dropped["rank"], dropped["step"], dropped["via"]) == (0, 5, "carry")
    assert "committed" in dropped["error"]
    # the carried copy first (read before the push came), then the push: the push replaces it
    carry.take(carried(6, 60))
    assert held.steps(0) == [5, 6]
    push(_committed(6, 61))
    assert held.steps(0) == [5, 6] and _held_position(held, 6) == 61
    assert len(_named(stream, "replica.rejected")) == 1


def test_a_carried_slot_decoded_while_the_push_of_its_step_is_received_is_dropped_too():
    """The same rule where the two meet: a reader decodes the carried step 5 while the
    committed push of step 5 is being received (the push holds the slots' writer lock, so the
    carried copy waits for it and is published after it). Forced with events: the push is
    finished only once the reader waits for the writer lock."""
    import threading

    log, stream = _events()
    held = ReplicaStore()
    carry = C.Carry(TrainState(sampler=Position()), 1, 2, [0], held, log, lambda: 0,
                    C.CarryRecord(), secret=SECRET)
    pos = Position()
    pos.consumed = 40
    carry.take(_slot_region(4, TrainState(sampler=pos).plan(("rank",), rng=False)[0].to_json()))
    assert held.steps(0) == [4]
    snap = _committed(5, 51)
    idx, buf = held.begin(0, snap.layout.nbytes, 5)  # the push's receiving starts
    pos.consumed = 50
    carry.take(_slot_region(5, TrainState(sampler=pos).plan(("rank",), rng=False)[0].to_json()))
    slots = held._buffer(0)
    waiting = threading.Event()

    class Watched:
        def __init__(self, lock) -> None:
            self.lock = lock

        def acquire(self, *args):
            if threading.current_thread().name == "reader":
                waiting.set()
            return self.lock.acquire(*args)

        def release(self) -> None:
            self.lock.release()

    slots._writer = Watched(slots._writer)
    reader = threading.Thread(target=held.steps, args=(0,), name="reader")
    reader.start()
    assert waiting.wait(30)
    held.finish(0, idx, buf, 5, snap.layout, snap.digest())
    reader.join(30)
    assert held.steps(0) == [4, 5] and _held_position(held, 5) == 51
    [dropped] = _named(stream, "replica.rejected")
    assert dropped["step"] == 5 and "committed" in dropped["error"]


def test_a_forged_slot_is_refused_and_the_held_position_restored():
    """A slot's MAC is keyed with the job's secret and binds the sending rank. Each forgery
    of rank 0's step 7 at position 999,999 with a sound head is refused when read
    (`replica.rejected`) and step 6's position 60 stays what a replacement restores: one with
    the check recomputed as a plain blake2b (what the unkeyed check was: it was stored and
    served), one MACed with another job's secret, and rank 1's genuine slot put in rank 0's
    place."""
    log, stream = _events()
    held = ReplicaStore()
    carry = C.Carry(TrainState(sampler=Position()), 1, 2, [0], held, log, lambda: 0,
                    C.CarryRecord(), secret=SECRET)

    def layout(consumed: int) -> bytes:
        pos = Position()
        pos.consumed = consumed
        return TrainState(sampler=pos).plan(("rank",), rng=False)[0].to_json()

    def region(blob: bytes) -> torch.Tensor:
        out = torch.zeros(2 * C.SLOT_BYTES, dtype=torch.uint8)
        out[:len(blob)] = torch.frombuffer(bytearray(blob), dtype=torch.uint8)
        return out

    carry.take(_slot_region(6, layout(60)))
    body = C._HEAD.pack(C._MAGIC, 7, len(layout(999_999)), 0) + layout(999_999)
    forgeries = [
        body + hashlib.blake2b(body, digest_size=C._CHECK).digest(),
        C.encode(7, layout(999_999), b"", key=C.slot_key(b"another job's secret"), rank=0),
        C.encode(7, layout(999_999), b"", key=KEY, rank=1),
    ]
    for forged in forgeries:
        carry.take(region(forged))
        assert held.steps(0) == [6]
    with TransferServer(SECRET, JOB, 1, replicas=held, events=log) as holder:
        got = fetch_state([holder.address], 0, SECRET, JOB)
    fresh = Position()
    TrainState(sampler=fresh).restore_from(got.layout, got.data, scopes=("rank",))
    assert (got.step, fresh.consumed) == (6, 60)
    refused = _named(stream, "replica.rejected")
    assert [(e["rank"], e["step"], e["via"]) for e in refused] == [(0, 7, "carry")] * 3
    assert all("fails its MAC" in e["error"] for e in refused)
