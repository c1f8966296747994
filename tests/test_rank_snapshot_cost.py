"""The per-step cost of a rank's own snapshot (issue 26): no RNG states where `Job` reseeds
them, the ring push's acknowledgement collected at the next push, nothing walked that a
tensor-less snapshot does not copy; and every restore still bit-identical."""
from __future__ import annotations

import random
import socket
import threading

import numpy as np
import torch

from hpct_slurm.recovery.seeds import seed_everything, step_seed
from hpct_slurm.recovery.replicas import ReplicaStore
from hpct_slurm.recovery.snapshot import SnapshotStore
from hpct_slurm.recovery.snapshot_policy import RESEEDED
from hpct_slurm.recovery.encoding import RNG_KEY
from hpct_slurm.recovery.state import TrainState
from hpct_slurm.recovery.transfer import ReplicaPusher, TransferServer, fetch_state

from test_hostile_network import Events
from test_job_rooms import _policy, _state

SECRET = b"s" * 32
JOB = "26003"


class Position:
    def __init__(self) -> None:
        self.consumed = 0

    def state_dict(self) -> dict:
        return {"consumed": self.consumed}

    def load_state_dict(self, sd: dict) -> None:
        self.consumed = int(sd["consumed"])


def _tree_keys(store: SnapshotStore) -> set[str]:
    return {k for k, _ in store.latest().layout.tree["d"]}


def test_a_capture_leaves_the_rng_states_out_only_when_asked():
    position = Position()
    state = TrainState(sampler=position)
    with_rng = SnapshotStore(state, ("rank",))
    without = SnapshotStore(state, ("rank",), rng=False)
    with_rng.commit(1)
    without.commit(1)
    assert RNG_KEY in _tree_keys(with_rng) and with_rng.latest().layout.nbytes > 5000
    assert _tree_keys(without) == {"sampler", "extras"}
    assert without.latest().layout.nbytes == 0  # a position: nothing but the JSON tree


def test_the_policy_leaves_the_reseeded_rng_states_out_of_both_stores(tmp_path):
    assert RESEEDED
    policy, _ = _policy(tmp_path, state=_state(rank_state=True), mode="replicated")
    policy.rank_snaps.commit(3)
    policy.snapshots.commit(3)  # replicated: the shared and the rank scope
    assert RNG_KEY not in _tree_keys(policy.rank_snaps)
    assert RNG_KEY not in _tree_keys(policy.snapshots)
    assert "extras" in _tree_keys(policy.snapshots)
    policy.close()


def _train(seed: int, rank: int, steps: range, model, opt, position, reseed: bool = True):
    """Job's loop in small: reseed from (seed, rank, step), then a step with randomness from
    all three generators (dropout, data, python's and numpy's draws)."""
    losses = []
    for step in steps:
        if reseed:
            seed_everything(step_seed(seed, rank, step))
        x = torch.randn(8, 16) * (1 + random.random()) + float(np.random.rand())
        opt.zero_grad()
        loss = model(x).pow(2).mean()
        loss.backward()
        opt.step()
        position.consumed += 8
        losses.append(loss.item())
    return losses


def _setup():
    torch.manual_seed(7)
    model = torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.Dropout(0.3),
                                torch.nn.Linear(16, 1))
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    position = Position()
    return model, opt, position, TrainState(model=model, optimizer=opt, sampler=position)


def _restore_and_continue(reseed: bool) -> tuple[list[float], list[float], bool]:
    """Train 12 steps; snapshot at step 5 without RNG states; train on to 11. Scramble every
    generator (a newcomer's, or a survivor's mid-step), restore step 5, train 6..11 again."""
    model, opt, position, state = _setup()
    shared = SnapshotStore(state, ("shared",))
    mine = SnapshotStore(state, ("rank",), rng=False)
    _train(0, 3, range(0, 6), model, opt, position, reseed)
    shared.commit(5)
    mine.commit(5)
    first = _train(0, 3, range(6, 12), model, opt, position, reseed)
    end = [p.detach().clone() for p in model.parameters()]
    random.seed(99)
    np.random.seed(99)
    torch.manual_seed(99)
    for store in (shared, mine):
        snap = store.latest()
        state.restore_from(snap.layout, snap.data, scopes=store.scopes)
    assert position.consumed == 6 * 8
    again = _train(0, 3, range(6, 12), model, opt, position, reseed)
    same = all(torch.equal(a, b) for a, b in zip(end, model.parameters()))
    return first, again, same


def test_a_restore_without_the_rng_states_is_bit_identical_when_every_step_is_reseeded():
    first, again, same = _restore_and_continue(reseed=True)
    assert again == first and same


def test_without_the_reseed_the_missing_rng_states_would_show():
    # the control: the test above can fail; the reseed is what makes leaving them out exact
    first, again, same = _restore_and_continue(reseed=False)
    assert again != first and not same


def test_push_next_leaves_the_ack_to_the_next_push_and_the_copy_restores(tmp_path):
    events = Events()
    position = Position()
    state = TrainState(sampler=position)
    mine = SnapshotStore(state, ("rank",), rng=False)
    replicas = ReplicaStore()
    with TransferServer(SECRET, JOB, 1, replicas=replicas, events=events.log) as holder:
        pusher = ReplicaPusher(mine, 0, holder.address, SECRET, JOB, events=events.log)
        for step in (1, 2, 3):
            position.consumed = step * 10
            mine.commit(step)
            pusher.push_next(step)
            # the previous step is at the holder when push_next returns
            assert step == 1 or step - 1 in replicas.steps(0)
        pusher.flush()
        assert replicas.steps(0) == [2, 3] and pusher.acked_step == 3
        got = fetch_state([holder.address], 0, SECRET, JOB, step=3)
        pusher.close()
    fresh = Position()
    TrainState(sampler=fresh).restore_from(got.layout, got.data, scopes=("rank",))
    assert fresh.consumed == 30 and got.layout.nbytes == 0
    assert not events.named("replica.push_failed")


def test_abort_cuts_off_a_push_whose_ack_never_comes():
    # a holder that takes the frame and never answers (its node died after the send)
    listener = socket.create_server(("127.0.0.1", 0))
    taken: list[socket.socket] = []

    def accept() -> None:
        conn, _ = listener.accept()
        taken.append(conn)
        conn.recv(65536)  # the hello; nothing is ever sent back

    threading.Thread(target=accept, daemon=True).start()
    events = Events()
    position = Position()
    mine = SnapshotStore(TrainState(sampler=position), ("rank",), rng=False)
    mine.commit(1)
    pusher = ReplicaPusher(mine, 0, listener.getsockname()[:2], SECRET, JOB, events=events.log,
                           timeout=600)
    pusher.push_next(1)  # returns at once: nothing was pushed before
    done = threading.Event()
    threading.Thread(target=lambda: (pusher.abort(), done.set()), daemon=True).start()
    # far below the push's 600 s timeout: abort did not wait for the ack
    assert done.wait(120)
    assert pusher.acked_step is None
    assert not events.named("replica.push_failed")  # an abort is not a failed push
    listener.close()
    for conn in taken:
        conn.close()


def test_a_snapshot_without_tensors_does_not_walk_the_parameters(monkeypatch):
    model, opt, position, state = _setup()
    walks: list[int] = []
    real = state.stable_ptrs
    monkeypatch.setattr(state, "stable_ptrs", lambda: walks.append(1) or real())
    SnapshotStore(state, ("rank",), rng=False).commit(1)
    assert walks == []
    SnapshotStore(state, ("rank",)).commit(1)  # with the RNG states: tensors to copy
    SnapshotStore(state, ("shared",)).commit(1)
    assert walks == [1, 1]
