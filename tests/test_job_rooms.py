"""The rooms of `Job`, each built alone from small real objects and in-process fakes: the
snapshot policy (snapshot_policy.py), the generation's group (generation.py), the restore path
(restore.py) and the controller-loss requeue (controller_loss.py). Seconds, no cluster; the
only process group is a real 1-rank gloo group over the rootless store on loopback."""
from __future__ import annotations

import ast
import socket
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist

import hpct_slurm
from hpct_slurm import protocol as P
from hpct_slurm.config import JobSettings
from hpct_slurm.errors import HpctError
from hpct_slurm.rendezvous import pg
from hpct_slurm.slurm.client import REQUEUE_BEGIN_S
from hpct_slurm.recovery import generation as G
from hpct_slurm.recovery.controller_loss import ControllerLoss
from hpct_slurm.recovery.generation import Generation, _Stopped, sharded_spec
from hpct_slurm.recovery.layout_rules import MeshSpec, first_mode
from hpct_slurm.recovery.restore import Restorer
from hpct_slurm.recovery.snapshot import SnapshotStore
from hpct_slurm.recovery.snapshot_policy import LAZY_FULL_EVERY, SnapshotPolicy
from hpct_slurm.recovery.state import TrainState
from hpct_slurm.recovery.transfer import FetchResult
from hpct_slurm.slurm.env import SlurmEnv

from test_hostile_network import Events  # an EventLog into memory, read back by name
from test_transfer import wait_for

SECRET = b"k" * 32
TASK = {"SLURM_JOB_ID": "28017", "SLURM_JOB_NODELIST": "localhost",
        "SLURMD_NODENAME": "localhost", "SLURM_STEP_NODELIST": "localhost",
        "SLURM_PROCID": "0", "SLURM_LOCALID": "0", "SLURM_NODEID": "0",
        "SLURM_NTASKS": "1", "SLURM_TASKS_PER_NODE": "1"}


class FakePersister:
    made: list["FakePersister"]

    def __init__(self, store, where, rank, every, events, key):
        self.store, self.where, self.rank, self.every = store, where, rank, every
        self.saved: list[int] = []
        self.closed = False
        FakePersister.made.append(self)

    def after_commit(self, step: int) -> None:
        self.saved.append(step)

    def close(self) -> None:
        self.closed = True


def _standing(**kw) -> SimpleNamespace:
    return SimpleNamespace(**{"client": None, "rank": 0, "world_size": 1, "generation": 0,
                              "data_ranks": [0], "data_world": 1, **kw})


def _state(rank_state: bool = False, weight: float | None = None) -> TrainState:
    model = torch.nn.Linear(2, 2)
    if weight is not None:
        with torch.no_grad():
            model.weight.fill_(weight)
    state = TrainState(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1))
    if rank_state:
        state.extras["position"] = 0  # a rank's own small state: `rank_snaps` exist
    return state


def _policy(tmp_path, state: TrainState | None = None, mode: str | None = None,
            standing: SimpleNamespace | None = None, on_gpu: bool = False,
            persist_every: int = 0, **settings) -> tuple[SnapshotPolicy, Events]:
    state = state or _state()
    events = Events()
    s = JobSettings(controller="127.0.0.1:9", secret_file="unused", run_dir=tmp_path,
                    **settings)
    FakePersister.made = []
    policy = SnapshotPolicy(state, s, mode or first_mode(state, None, None), None,
                            persist_every=persist_every, events=events.log, secret=SECRET,
                            job_id="28017", run_dir=tmp_path, standing=standing or _standing(),
                            on_gpu=lambda: on_gpu, persister=FakePersister)
    if state.get("optimizer") is not None:
        policy.watch_optimizer(state.get("optimizer"))
    return policy, events


def _spy(monkeypatch, store, calls: list) -> None:
    for name in ("commit", "commit_async", "prepare_lazy"):
        real = getattr(store, name)

        def spy(step, *a, _real=real, _name=name, **k):
            calls.append((_name, step))
            return _real(step, *a, **k)
        monkeypatch.setattr(store, name, spy)


# ---- the snapshot policy ------------------------------------------------------------------

def test_the_mode_follows_the_state_and_the_mesh():
    state = _state()
    assert first_mode(state, None, None) == "jit"  # plain data parallelism
    assert first_mode(state, "replicated", None) == "replicated"
    hsdp = MeshSpec((2, 2), ("replicate", "shard"), ("replicate",))
    assert first_mode(state, None, hsdp) == "jit"  # every shard key on two ranks
    assert first_mode(state, None, MeshSpec((4,), ("shard",))) == "replicated"  # 1-D FSDP


def test_steps_between_full_commits_are_held_lazily_only_where_live_state_restores(tmp_path):
    policy, _ = _policy(tmp_path)
    assert policy.mode == "jit" and policy.snapshots.every == LAZY_FULL_EVERY
    for blocked in (dict(mode="replicated"), dict(snapshot_lazy=False)):
        policy, _ = _policy(tmp_path, **blocked)
        assert policy.snapshots.every == 1, blocked  # every step a full commit
    policy, _ = _policy(tmp_path, snapshot_every=4)
    assert policy.snapshots.every == 4  # given: kept, lazily held between
    # per-rank state (a sampler), with or without disk persistence: lazily held too (issue
    # 26.3); a fault in a step's update rolls back to the last full commit, every position
    # at it pinned in memory
    for persist_every in (0, 10):
        policy, _ = _policy(tmp_path, state=_state(rank_state=True), persist_every=persist_every)
        assert policy.snapshots.every == LAZY_FULL_EVERY, persist_every


def test_with_per_rank_state_a_lazy_step_still_commits_and_pushes_the_ranks_own(tmp_path,
                                                                               monkeypatch):
    calls: list = []
    policy, _ = _policy(tmp_path, state=_state(rank_state=True))
    _spy(monkeypatch, policy.snapshots, calls)
    rank_calls: list = []
    _spy(monkeypatch, policy.rank_snaps, rank_calls)
    for step in (0, 1, 2):
        policy.end_step(step)
    assert calls == [("commit", 0), ("prepare_lazy", 1), ("prepare_lazy", 2)]
    assert rank_calls == [("commit", 0), ("commit", 1), ("commit", 2)]
    # the position at the last full commit (step 0) is pinned beside the two newest
    assert policy.rank_snaps.slots.steps() == [0, 1, 2]


def test_the_position_at_the_last_full_commit_stays_in_memory_here_and_at_the_holder(
        tmp_path):
    """A fault inside a step's update rolls the group back to the last full commit: every
    rank's own state at that step must still be held, by the rank and by its ring holder,
    however many lazy steps came since (before: only the two newest were, and such a fault
    needed disk persistence or escalated)."""
    policy, _ = _policy(tmp_path, state=_state(rank_state=True), persist_every=10)
    k = LAZY_FULL_EVERY
    for step in range(0, k + 4):
        policy.end_step(step)
    # full commits at 0, every 10th (persisted) and k: the last one pinned
    assert policy.rank_snaps.slots.steps() == [k, k + 2, k + 3]
    with policy.rank_snaps.lease(k) as snap:
        assert snap is not None and snap.step == k
    # the holder keeps the same steps of the ranks it holds (the same rule on every rank)
    pins = [s for s in range(0, 2 * k + 10) if policy._pins(s)]
    assert pins == sorted({*range(0, 2 * k + 10, 10), k, 2 * k})
    holder = policy.replicas
    with policy.rank_snaps.lease(k + 3) as snap:
        layout, data = snap.layout, bytes(snap.data)
    for step in range(k - 2, k + 4):  # rank 3's copies arriving, step by step
        idx, slot = holder.begin(3, len(data), step)
        slot[:len(data)] = torch.tensor(list(data), dtype=torch.uint8)
        holder.finish(3, idx, slot, step, layout, P.part_digest(data))
    assert holder.steps(3) == [k, k + 2, k + 3]
    # a restore (here at step k + 2) stands the group at a step as a full commit does
    policy.hold_restored(k + 2)
    assert policy.rank_snaps.slots.steps() == [k + 2] and holder.steps(3) == [k + 2, k + 3]
    # without lazy holds nothing is pinned: every step is a full commit anyway
    policy, _ = _policy(tmp_path, state=_state(rank_state=True), snapshot_lazy=False)
    for step in range(0, 4):
        policy.end_step(step)
    assert policy.rank_snaps.slots.steps() == [2, 3] and not policy._pins(0)


def test_end_step_commits_fully_lazily_or_in_the_background(tmp_path, monkeypatch):
    calls: list = []
    policy, _ = _policy(tmp_path)  # CPU, overlap "auto": the copy is made in the step
    _spy(monkeypatch, policy.snapshots, calls)
    policy.end_step(0)
    policy.end_step(1)
    assert calls == [("commit", 0), ("prepare_lazy", 1)]
    calls.clear()
    policy, _ = _policy(tmp_path, on_gpu=True)  # on a GPU: overlapped with the next step
    _spy(monkeypatch, policy.snapshots, calls)
    policy.end_step(0)
    policy.settle(follow_ups=True)
    assert calls == [("commit_async", 0)] and policy.snapshots.slots.steps() == [0]
    calls.clear()
    policy, _ = _policy(tmp_path, on_gpu=True, snapshot_overlap="0")  # forced off
    _spy(monkeypatch, policy.snapshots, calls)
    policy.end_step(0)
    assert calls == [("commit", 0)]


def test_a_lazily_held_step_is_captured_at_a_fault_unless_its_update_began(tmp_path):
    policy, events = _policy(tmp_path)
    policy.end_step(3)  # not a commit step: held where it lies
    assert policy.snapshots.slots.steps() == []
    policy.capture_pending()
    assert policy.snapshots.slots.steps() == [3]
    assert [e["step"] for e in events.named("snapshot.captured_at_fault")] == [3]
    policy.end_step(5)
    policy.state.get("optimizer").step()  # the update began: the live state is no step's
    assert policy.updating
    policy.capture_pending()
    assert policy.snapshots.slots.steps() == [3]  # nothing captured for step 5


def test_a_persist_step_is_a_full_commit_saved_by_the_lowest_rank_of_its_key(tmp_path):
    standing = _standing(rank=1, world_size=4)
    policy, _ = _policy(tmp_path, persist_every=3, standing=standing)
    policy.open_persisters(lambda r: r % 2)  # rank 1 is the lowest of key 1
    [persister] = FakePersister.made
    assert (persister.store, persister.rank, persister.where) == (
        policy.snapshots, 1, tmp_path / "persist")
    policy.end_step(3)
    policy.end_step(4)
    assert persister.saved == [3] and policy.snapshots.slots.steps() == [3]
    standing.rank = 3  # not the lowest of its key: writes nothing
    policy, _ = _policy(tmp_path, persist_every=3, standing=standing)
    policy.open_persisters(lambda r: r % 2)
    assert FakePersister.made == []


def test_a_rank_persister_follows_the_rank_this_process_holds(tmp_path):
    standing = _standing(rank=0, world_size=2)
    policy, _ = _policy(tmp_path, state=_state(rank_state=True), persist_every=2,
                        standing=standing)
    policy.open_persisters(lambda r: 0)
    shared, own = FakePersister.made
    assert own.store is policy.rank_snaps and own.rank == 0
    standing.rank = 1
    policy.open_persisters(lambda r: 0)
    assert own.closed and FakePersister.made[-1].rank == 1 and not shared.closed
    policy.close()
    assert shared.closed and FakePersister.made[-1].closed


def test_the_restored_step_is_held_and_newer_histories_dropped(tmp_path):
    policy, _ = _policy(tmp_path, state=_state(rank_state=True))
    for step in (5, 6):
        policy.snapshots.commit(step)
        policy.rank_snaps.commit(step)
    policy.hold_restored(4)  # a rollback to disk: 5 and 6 never happened
    assert policy.snapshots.slots.steps() == [4] and policy.rank_snaps.slots.steps() == [4]
    policy.hold_restored(4)
    assert policy.snapshots.slots.steps() == [4]  # held already: no second copy


def test_the_ring_pushes_to_the_neighbour_on_the_other_node_only(tmp_path):
    policy, _ = _policy(tmp_path, state=_state(rank_state=True))
    one_node = P.Assign(0, 0, 1, ["n0"], 1, -1, peers={0: ("h0", 1)})
    policy.ring(one_node)
    assert policy.pusher is None
    two = P.Assign(0, 0, 2, ["n0", "n1"], 1, -1, peers={0: ("h0", 1), 1: ("h1", 2)})
    policy.ring(two)
    assert policy.pusher is not None and policy.pusher.peer == ("h1", 2)
    assert policy.pusher.store is policy.rank_snaps  # jit: only the rank's own state goes
    with pytest.raises(HpctError, match="no transfer address for rank 1"):
        policy.ring(P.Assign(0, 0, 2, ["n0", "n1"], 1, -1, peers={0: ("h0", 1)}))
    policy.close()


# ---- the generation -----------------------------------------------------------------------

class FakeClient:
    def __init__(self) -> None:
        self.stop_event, self.on_stop = threading.Event(), None
        self.stop_doomed, self.stop_generation, self.stop_reason = False, 0, ""
        self.state = "running"


def _group(tmp_path, model: torch.nn.Module | None = None, build=None, mesh=None,
           shutdown=None, **settings) -> tuple[Generation, SnapshotPolicy, Events]:
    state = TrainState() if build is not None else _state()
    if model is not None:
        state.unregister("model")
        state.register(model=model)
    standing = _standing(client=FakeClient())
    policy, events = _policy(tmp_path, state=state, standing=standing, mode="jit")
    s = JobSettings(controller="127.0.0.1:9", secret_file="unused", run_dir=tmp_path,
                    init_timeout_s=5.0, **settings)
    spec = sharded_spec(None, None, None, build, mesh, ("dp",), None) if build else None
    group = Generation(s, SlurmEnv.from_environ(TASK), SECRET, events.log, state, policy,
                       standing, model=state.get("model"), optimizer=state.get("optimizer"),
                       lr_scheduler=None, build=build, mesh_spec=spec, replicate=None,
                       device_type="cpu", seed=0, shutdown=shutdown or (lambda reason: None))
    return group, policy, events


@pytest.fixture
def nothing_formed_after():
    yield
    if dist.is_initialized():  # a failed test must not leave a group for the next one
        pg.teardown()


def test_a_job_takes_build_or_model_and_optimizer():
    model = torch.nn.Linear(2, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    assert sharded_spec(model, opt, None, None, None, None, None) is None
    with pytest.raises(HpctError, match="not both"):
        sharded_spec(model, opt, None, lambda mesh: None, (1,), ("dp",), None)
    with pytest.raises(HpctError, match="needs mesh_shape and mesh_dim_names"):
        sharded_spec(None, None, None, lambda mesh: None, (1,), None, None)
    with pytest.raises(HpctError, match="needs model and optimizer"):
        sharded_spec(model, None, None, None, None, None, None)
    assert sharded_spec(None, None, None, lambda mesh: None, (2, 2), ("r", "s"), ("r",)
                        ) == MeshSpec((2, 2), ("r", "s"), ("r",))


def test_a_cpu_group_is_gloo_and_every_rank_shares_one_key(tmp_path):
    group, _, _ = _group(tmp_path)
    assert not group.on_gpu() and group.backend() == ("gloo", None)
    assert group.key(0) == group.key(5) == 0 and group.shard_keys() == []
    sharded, _, _ = _group(tmp_path, build=lambda mesh: None, mesh=(1,))
    sharded.device_type = "cuda"
    assert sharded.on_gpu()  # a sharded job built on "cuda" trains on the GPU


def test_a_formed_group_is_torn_down_to_nothing_and_forms_again(tmp_path,
                                                                nothing_formed_after):
    group, _, _ = _group(tmp_path)
    group.form(P.Assign(0, 0, 1, ["localhost"], 1, -1))
    assert dist.is_initialized() and pg.current().generation == 0
    assert isinstance(group.ddp(), torch.nn.parallel.DistributedDataParallel)
    group.teardown()
    assert not dist.is_initialized() and pg.current() is None
    with pytest.raises(HpctError, match="only available inside job.run"):
        group.ddp()  # the DDP module went with the group
    group.form(P.Assign(1, 0, 1, ["localhost"], 1, -1))
    assert pg.current().generation == 1
    group.renew_ddp()  # the script used job.ddp: a new module bound to the new group
    assert isinstance(group.ddp(), torch.nn.parallel.DistributedDataParallel)
    group.teardown()
    assert not dist.is_initialized()


def test_the_first_step_after_a_formation_may_wait_as_long_as_the_controller_lets_it(
        tmp_path, nothing_formed_after):
    """A first step does more on some ranks (a compile on a cold cache, a spare's first
    forward): its collectives wait as long as the controller lets a rank run without a step,
    not the collective timeout, which would read the compile as a fault; from the first
    step's end on, the collective timeout again, in every generation."""
    def timeout() -> float:
        backend = dist.group.WORLD._get_backend(torch.device("cpu"))
        return backend.options._timeout.total_seconds()

    group, _, _ = _group(tmp_path, collective_timeout_s=10.0, progress_timeout_s=300.0)
    for generation in (0, 1):
        group.form(P.Assign(generation, 0, 1, ["localhost"], 1, -1))
        assert timeout() == 300.0
        group.first_step_done()
        assert timeout() == 10.0
        group.first_step_done()  # the later steps leave it as it is
        assert timeout() == 10.0
        group.teardown()
    short, _, _ = _group(tmp_path, collective_timeout_s=10.0, progress_timeout_s=5.0)
    short.form(P.Assign(0, 0, 1, ["localhost"], 1, -1))
    assert timeout() == 10.0  # never shorter than the collective timeout
    short.teardown()


def test_a_stop_that_came_before_the_formation_interrupts_it(tmp_path, nothing_formed_after):
    group, _, _ = _group(tmp_path)
    client = group.standing.client
    client.stop_event.set()
    with pytest.raises(dist.DistStoreError, match="aborted"):
        group.form(P.Assign(0, 0, 1, ["localhost"], 1, -1))
    assert not dist.is_initialized() and client.on_stop is None


def test_a_sharded_generation_is_built_on_its_mesh_and_released(tmp_path,
                                                                 nothing_formed_after):
    def build(mesh):
        model = torch.nn.Linear(2, 2)
        return model, torch.optim.SGD(model.parameters(), lr=0.1)

    group, policy, events = _group(tmp_path, build=build, mesh=(1,))
    group.form(P.Assign(0, 0, 1, ["localhost"], 1, -1))
    assert group.state.get("model") is group.model and group.mesh is not None
    assert group.mesh_spec.replicate == ("dp",)  # plain parameters: replicated everywhere
    assert [e["replicate"] for e in events.named("rank.mesh_inferred")] == [["dp"]]
    group.optimizer.step()
    assert policy.updating  # the policy watches the optimizer built for this generation
    group.release()
    assert group.model is group.mesh is None and group.state.get("model") is None
    group.teardown()


def test_a_step_the_stop_dooms_is_left_in_its_forward_but_not_after_its_update(tmp_path):
    group, policy, _ = _group(tmp_path)
    group.hook_model()
    client = group.standing.client
    client.stop_event.set()
    group.model(torch.ones(1, 2))  # a STOP that loses nobody: the step goes on
    client.stop_doomed, client.stop_reason = True, "n1: connection lost"
    with pytest.raises(_Stopped, match="n1: connection lost"):
        group.model(torch.ones(1, 2))
    policy.updating = True
    group.model(torch.ones(1, 2))  # the update began: the step completes
    policy.updating, group.standing.generation = False, 1
    group.model(torch.ones(1, 2))  # an older generation's STOP


def test_a_teardown_that_fails_in_the_background_ends_the_process(tmp_path, monkeypatch):
    reasons: list[str] = []
    group, _, events = _group(tmp_path, shutdown=reasons.append)
    torn = threading.Event()
    monkeypatch.setattr(group, "teardown", torn.set)
    group.teardown_in_background()
    group.await_teardown()
    assert torn.is_set() and group.teardown_bg is None and reasons == []

    def hung() -> None:
        raise G._TeardownHung("process group teardown did not finish within 20 s")

    exits: list[int] = []
    monkeypatch.setattr(group, "teardown", hung)
    monkeypatch.setattr(G.os, "_exit", exits.append)
    group.teardown_in_background()
    group.await_teardown()
    assert exits == [3] and reasons == ["process group teardown failed: process group "
                                        "teardown did not finish within 20 s"]
    assert [e["error"] for e in events.named("rank.teardown_hung")] == [
        "process group teardown did not finish within 20 s"]


# ---- the restore path ---------------------------------------------------------------------

class Fetcher:
    """fetch_state over a table: "host:port" or "disk" -> what it serves; records each ask."""

    def __init__(self, serves: dict[str, FetchResult]):
        self.serves, self.asked = serves, []

    def __call__(self, sources, rank, secret, job_id, step=-1, disk_dir=None, events=None,
                 slot="any"):
        self.asked.append((rank, [f"{h}:{p}" for h, p in sources], disk_dir, slot))
        for h, p in sources:
            if f"{h}:{p}" in self.serves:
                return self.serves[f"{h}:{p}"]
        if disk_dir is not None and "disk" in self.serves:
            return self.serves["disk"]
        raise HpctError("no source serves it")


def _served(step: int, weight: float, source: str, scopes=("shared",),
            rank_state: bool = False) -> FetchResult:
    """A state at `step` whose weights are all `weight`, as a peer or disk serves it."""
    snap = SnapshotStore(_state(rank_state, weight), scopes=scopes).commit(step)
    return FetchResult(step, snap.layout, snap.data, source)


def _restorer(tmp_path, fetch: Fetcher, mode: str = "jit", rank_state: bool = False,
              keys=lambda r: r % 2, prefetch=None) -> tuple[Restorer, SnapshotPolicy, Events]:
    state = _state(rank_state=rank_state, weight=0.0)
    policy, events = _policy(tmp_path, state=state, mode=mode)
    group = SimpleNamespace(key=keys, shard_keys=lambda: [keys(r) for r in range(4)])
    kw = {} if prefetch is None else {"prefetch": prefetch}
    restorer = Restorer(state, policy, group, _standing(rank=2, generation=3), secret=SECRET,
                        job_id="28017", events=events.log, run_dir=tmp_path, timeout=5.0,
                        fetch=fetch, **kw)
    return restorer, policy, events


def _weight(restorer: Restorer) -> float:
    return restorer.state.get("model").weight.flatten()[0].item()


def _assign(step: int = 7, sources=None, rank: int = 2, **kw) -> P.Assign:
    return P.Assign(3, rank, 4, ["n0", "n1"], 2, step, sources or {}, **kw)


def test_a_survivor_restores_from_its_own_snapshot_first(tmp_path):
    fetch = Fetcher({})
    restorer, policy, _ = _restorer(tmp_path, fetch)
    policy.snapshots.commit(7)
    assert restorer.restore(_assign(sources={0: [("h0", 1)]}), survivor=True) == "own"
    assert fetch.asked == []


def test_a_newcomer_tries_the_survivors_of_its_key_in_order_then_disk(tmp_path):
    sources = {1: [("h1", 1)], 0: [("h0", 1)], 4: [("h4", 1)]}  # rank 1: the other key
    fetch = Fetcher({"h4:1": _served(7, 4.0, "h4:1"), "h1:1": _served(7, 1.0, "h1:1")})
    restorer, _, _ = _restorer(tmp_path, fetch)
    assert restorer.restore(_assign(sources=sources), survivor=False) == "h4:1"
    assert [asked[1] for asked in fetch.asked] == [["h0:1"], ["h4:1"]]
    assert _weight(restorer) == 4.0
    fetch = Fetcher({"disk": _served(7, 9.0, "disk:persist")})
    restorer, _, _ = _restorer(tmp_path, fetch)
    assert restorer.restore(_assign(sources=sources), survivor=False) == "disk:persist"
    assert fetch.asked[-1] == (0, [], str(tmp_path / "persist"), "any")  # by its key
    assert _weight(restorer) == 9.0
    fetch = Fetcher({"disk": _served(5, 9.0, "disk:persist")})
    restorer, _, _ = _restorer(tmp_path, fetch)
    with pytest.raises(HpctError, match="disk holds step 5, the group restores step 7"):
        restorer.restore(_assign(sources=sources), survivor=False)


def test_a_newcomer_that_never_trained_stands_at_creation(tmp_path):
    fetch = Fetcher({})
    restorer, _, _ = _restorer(tmp_path, fetch)
    assert restorer.restore(_assign(step=-1, sources={0: [("h0", 1)]}),
                            survivor=False) == "creation"
    assert fetch.asked == []


def test_replicated_mode_asks_the_leaving_process_and_the_ring_holder_before_peers(tmp_path):
    # rank 2's ring holder is rank 0 (the same local rank on the other node)
    a = _assign(sources={2: [("old", 9)], 0: [("h0", 1)]},
                peers={0: ("ring", 3), 1: ("h1", 1), 3: ("h3", 1)})
    fetch = Fetcher({"ring:3": _served(7, 3.0, "ring:3", scopes=("shared", "rank"))})
    restorer, _, _ = _restorer(tmp_path, fetch, mode="replicated")
    assert restorer.restore(a, survivor=False) == "ring:3"
    assert fetch.asked == [(2, ["old:9", "ring:3"], None, "any")]
    fetch = Fetcher({"h0:1": _served(7, 5.0, "h0:1")})
    restorer, _, events = _restorer(tmp_path, fetch, mode="replicated")
    assert restorer.restore(a, survivor=False) == "h0:1"  # no replica: a peer of its key
    assert [e["step"] for e in events.named("restore.replica_missing")] == [7]


def test_a_striped_pull_started_while_forming_wins_and_becomes_the_held_step(tmp_path):
    served = _served(7, 6.0, "striped")
    fetch = Fetcher({})
    restorer, policy, _ = _restorer(tmp_path, fetch)
    pulled = SimpleNamespace(layout=served.layout, source="striped(2 sources)",
                             data=torch.frombuffer(bytearray(served.data), dtype=torch.uint8),
                             leaves=[])
    prefetch = SimpleNamespace(result=lambda: pulled)
    assert restorer.restore(_assign(), survivor=False, prefetch=prefetch) == "striped(2 sources)"
    assert _weight(restorer) == 6.0 and policy.snapshots.slots.steps() == [7]
    assert fetch.asked == []


def test_the_striped_pull_asks_every_other_source_of_the_key(tmp_path):
    started: list = []

    def prefetch(sources, rank, secret, job_id, step, events=None, timeout=60.0):
        started.append((sources, rank, step))
        return "pulling"

    restorer, policy, _ = _restorer(tmp_path, Fetcher({}), prefetch=prefetch)
    sources = {4: [("h4", 1), ("h4b", 1)], 1: [("h1", 1)], 0: [("h0", 1)], 2: [("me", 1)]}
    assert restorer.prefetch(_assign(sources=sources), survivor=False) == "pulling"
    assert started == [([(0, ("h0", 1)), (4, ("h4", 1))], 2, 7)]
    assert restorer.prefetch(_assign(step=-1, sources=sources), survivor=False) is None
    policy.snapshots.commit(7)
    assert restorer.prefetch(_assign(sources=sources), survivor=True) is None  # held
    assert restorer.prefetch(_assign(sources={1: [("h1", 1)]}), survivor=False) is None
    replicated, _, _ = _restorer(tmp_path, Fetcher({}), mode="replicated", prefetch=prefetch)
    assert replicated.prefetch(_assign(sources=sources), survivor=False) is None
    assert len(started) == 1


def test_a_ranks_own_state_comes_from_the_leaving_process_then_the_ring_then_disk(tmp_path):
    own = _served(7, 0.0, "old:9", scopes=("rank",), rank_state=True)
    a = _assign(sources={2: [("old", 9)]}, peers={0: ("ring", 3)})
    fetch = Fetcher({"old:9": own})
    restorer, _, _ = _restorer(tmp_path, fetch, rank_state=True)
    restorer.restore_rank_state(a, own=False)
    assert fetch.asked == [(2, ["old:9"], None, "rank")]
    fetch = Fetcher({"ring:3": own})
    restorer, _, _ = _restorer(tmp_path, fetch, rank_state=True)
    restorer.restore_rank_state(a, own=False)
    assert [asked[1] for asked in fetch.asked] == [["old:9"], ["ring:3"]]
    fetch = Fetcher({"disk": _served(6, 0.0, "disk", scopes=("rank",), rank_state=True)})
    restorer, _, _ = _restorer(tmp_path, fetch, rank_state=True)
    with pytest.raises(HpctError, match="exists at step 6 at best"):
        restorer.restore_rank_state(a, own=False, disk=True)
    assert fetch.asked == [(2, [], str(tmp_path / "persist-rank"), "any")]


def test_holdings_list_what_this_process_can_serve(tmp_path):
    restorer, policy, _ = _restorer(tmp_path, Fetcher({}), rank_state=True)
    policy.snapshots.commit(4)
    policy.rank_snaps.commit(4)
    policy.rank_snaps.commit(5)
    h = restorer.holdings("RuntimeError: peer gone")
    assert (h.rank, h.generation, h.mode, h.rank_state) == (2, 3, "jit", True)
    assert (h.own, h.rank_own, h.replicas) == ([4], [4, 5], {})
    assert h.error == "RuntimeError: peer gone" and h.shard_keys == [0, 1, 0, 1]


# ---- the controller's loss ----------------------------------------------------------------

class FakeSlurm:
    def __init__(self, state: str = "RUNNING", restart_count: int = 0, fail: bool = False,
                 host_lost_after: int = 0):
        self.job = SimpleNamespace(state=state, restart_count=restart_count, batch_host="n1")
        self.fail, self.requeued = fail, []
        self.host_asked, self.host_lost_after = 0, host_lost_after  # -1: never lost

    def show_job(self, job_id):
        if self.fail:
            raise HpctError("slurmctld not responding")
        return self.job

    def show_node(self, name):
        assert name == "n1"
        self.host_asked += 1
        return SimpleNamespace(lost=0 <= self.host_lost_after < self.host_asked)

    def requeue(self, job_id, on_requeued=None) -> None:
        self.requeued.append(job_id)
        if on_requeued is not None:
            on_requeued()


def test_a_listening_controller_is_not_gone(tmp_path):
    events = Events()
    with socket.create_server(("127.0.0.1", 0)) as server:
        host, port = server.getsockname()[:2]
        loss = ControllerLoss(f"{host}:{port}", SlurmEnv.from_environ(TASK), events.log,
                              _standing(rank=1))
        assert not loss.gone(probe_s=2.0)
    assert [e["rank"] for e in events.named("rank.controller_alive")] == [1]
    assert loss.gone(probe_s=0.3)  # nothing listens there any more


@pytest.mark.parametrize("hang_up", ["probe", "plain close"])
def test_the_probe_of_a_live_controller_hangs_up_without_a_reset(hang_up):
    """The controller sends its hello as it accepts. Closing a socket with that hello unread
    makes the kernel reset the connection (the control case shows it), which the controller
    logs as a stranger's traffic; the probe's hang-up reads it and ends cleanly."""
    from hpct_slurm.recovery.controller_loss import _hang_up

    with socket.create_server(("127.0.0.1", 0)) as server:
        client = socket.create_connection(server.getsockname()[:2])
        conn, _ = server.accept()
        with conn:
            conn.sendall(b"hello: a nonce")
            client.recv(1, socket.MSG_PEEK)  # the hello is in the probe's buffer, unread
            threading.Timer(0.1, lambda: (_hang_up(client) if hang_up == "probe" else None,
                                          client.close())).start()
            try:
                seen: object = conn.recv(64)
            except OSError as exc:
                seen = type(exc)
    if hang_up == "probe":
        assert seen == b""  # a clean end of stream
    else:
        assert seen is ConnectionResetError


def test_the_ranks_requeue_a_job_whose_controller_died_once(tmp_path):
    events = Events()
    slurm = FakeSlurm()
    env = SlurmEnv.from_environ(TASK)
    ControllerLoss("127.0.0.1:9", env, events.log, _standing(), lambda: slurm).requeue()
    assert slurm.requeued == [env.job_id]
    assert [e["job_id"] for e in events.named("rank.requeued_job")] == ["28017"]
    assert [e["begin_in_s"] for e in events.named("rank.requeue_begin")] == [REQUEUE_BEGIN_S]
    already = FakeSlurm(restart_count=1)  # another rank requeued it: left alone, and said
    ControllerLoss("127.0.0.1:9", env, events.log, _standing(), lambda: already).requeue()
    assert already.requeued == []
    [left] = events.named("rank.requeue_skipped")
    assert (left["state"], left["restart_count"]) == ("RUNNING", 1) and "another" in left["why"]
    failing = FakeSlurm(fail=True)
    ControllerLoss("127.0.0.1:9", env, events.log, _standing(), lambda: failing).requeue()
    assert [e["error"] for e in events.named("rank.requeue_failed")] == [
        "slurmctld not responding"]


class RacedSlurm(FakeSlurm):
    """Another rank's requeue lands between this rank's look and its own requeue."""

    def requeue(self, job_id, on_requeued=None) -> None:
        self.job = SimpleNamespace(state="PENDING", restart_count=1)
        raise HpctError("scontrol requeue 28017 failed (exit 1): Job is pending execution")


def test_a_requeue_refused_after_another_ranks_is_not_a_failure():
    events = Events()
    ControllerLoss("127.0.0.1:9", SlurmEnv.from_environ(TASK), events.log, _standing(),
                   lambda: RacedSlurm()).requeue()
    assert events.named("rank.requeue_failed") == [] == events.named("rank.requeued_job")
    [left] = events.named("rank.requeue_skipped")
    assert "requeued meanwhile" in left["why"] and "pending execution" in left["error"]


def _closed_port() -> int:
    with socket.create_server(("127.0.0.1", 0)) as s:
        return s.getsockname()[1]


def _loss(events, slurm, peers, controller: str | None = None, **standing) -> ControllerLoss:
    loss = ControllerLoss(controller or f"127.0.0.1:{_closed_port()}",
                          SlurmEnv.from_environ(TASK), events.log, _standing(**standing),
                          lambda: slurm, grace_s=0.3)
    loss.probe_s, loss.peers = 0.2, peers
    loss.verdict_s, loss.verdict_every_s = 0.5, 0.05
    return loss


def test_a_lost_controller_is_settled_once_by_requeue_only_where_another_node_answers():
    """The controller gone and a peer answering: the batch host died, the job is requeued
    (once, however many threads ask). No peer answering: this node is the one cut off, and
    it leaves the job alone. No peer to ask (two nodes): the controller's probe decides."""
    with socket.create_server(("127.0.0.1", 0)) as peer:
        events, slurm = Events(), FakeSlurm()
        loss = _loss(events, slurm, [peer.getsockname()[:2]])
        loss.settle()
        loss.settle()
        assert slurm.requeued == [28017]
        assert [e["by"] for e in events.named("rank.requeued_job")] == ["rank"]
        # the controller alive: nothing, whatever the peers
        events, alive = Events(), FakeSlurm()
        _loss(events, alive, [], controller="%s:%d" % peer.getsockname()[:2]).settle()
        assert alive.requeued == [] and len(events.named("rank.controller_alive")) == 1
    events, cut_off = Events(), FakeSlurm()
    _loss(events, cut_off, [("127.0.0.1", _closed_port())] * 2, rank=2).settle()
    assert cut_off.requeued == []
    assert [(e["rank"], e["peers"]) for e in events.named("rank.isolated")] == [(2, 2)]
    events, pair = Events(), FakeSlurm()
    _loss(events, pair, []).settle()
    assert pair.requeued == [28017]


def test_a_lost_controller_requeues_only_once_slurm_has_marked_the_batch_host_lost():
    """Slurm is the arbiter: the batch host lost after a few looks, the job is requeued, the
    wait on the record; Slurm still hearing from it (only the way from this node to it is
    cut), the rank leaves the job alone."""
    events, slow = Events(), FakeSlurm(host_lost_after=3)
    _loss(events, slow, []).settle()
    assert slow.requeued == [28017] and slow.host_asked == 4
    [ev] = events.named("rank.requeued_job")
    assert ev["batch_host"] == "n1" and ev["verdict_s"] >= 0.1
    events, alive = Events(), FakeSlurm(host_lost_after=-1)
    _loss(events, alive, []).settle()
    assert alive.requeued == [] and alive.host_asked >= 5
    assert [e["rank"] for e in events.named("rank.batch_host_alive")] == [0]


def test_a_ranks_witnesses_are_other_hosts_nearest_round_the_ring():
    from hpct_slurm.recovery.controller_loss import witnesses

    # 12 ranks, 3 a node: ranks 0-2 on the batch host h0, this rank (4) on h1
    peers = {r: (f"h{r // 3}", 7000 + r) for r in range(12)}
    a = P.Assign(generation=0, rank=4, world_size=12, members=[], tasks_per_node=3,
                 restore_step=-1, peers=peers)
    assert witnesses(a, {"h1", "h0"}) == [("h2", 7006), ("h3", 7009)]
    assert witnesses(a, {"h9"})[:2] == [("h1", 7004), ("h2", 7006)]


def test_the_watchdog_settles_for_a_training_thread_stuck_in_its_step_only():
    events, slurm = Events(), FakeSlurm()
    stuck = _loss(events, slurm, [], step=25)
    stuck.watch()
    # the watchdog's thread requeues, then records it: wait for the record, written last
    wait_for(events, "rank.requeued_job", 5)
    assert slurm.requeued == [28017]
    assert [e["by"] for e in events.named("rank.requeued_job")] == ["watchdog"]
    [stuck] = events.named("rank.stuck")
    assert stuck["step"] == 25 and stuck["where"]  # this test's own frame, the main thread's
    assert any("test_the_watchdog_settles" in f for f in stuck["where"])
    # a thread that keeps stepping (the controller's process died, the host lives and so
    # do the collectives) may still finish the job: the watchdog leaves it alone
    events, busy = Events(), FakeSlurm()
    training = _loss(events, busy, [], step=25)
    training.watch()
    for step in range(26, 36):
        training.standing.step = step
        time.sleep(0.05)
    time.sleep(0.3)
    assert busy.requeued == []


def test_the_client_reports_a_controller_gone_without_a_goodbye_and_fails_a_silent_one():
    """`on_lost` fires when the connection ends without the controller's Goodbye, not after
    one, nor after this rank's own close; the connection fails on its own when the
    controller's host stops acknowledging (TCP_USER_TIMEOUT), as a dead host sends no FIN."""
    from hpct_slurm.recovery.client import (CONTROLLER_SILENCE_S, ControllerAddress,
                                            CoordinationClient)

    with socket.create_server(("127.0.0.1", 0)) as server:
        for ending in ("vanish", "goodbye", "own close"):
            def serve() -> None:
                conn, _ = server.accept()
                with conn:
                    chan = P.server_hello(conn, SECRET, "28017", 5)
                    chan.recv(conn)  # the Register
                    if ending == "goodbye":
                        chan.send(conn, P.Goodbye("done"))
                    if ending == "own close":
                        conn.recv(1 << 16)  # until the rank hangs up
            t = threading.Thread(target=serve)
            t.start()
            client = CoordinationClient(ControllerAddress(*server.getsockname()[:2]), SECRET,
                                        "28017")
            assert client._sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_USER_TIMEOUT) == \
                int(CONTROLLER_SILENCE_S * 1000)
            assert client._sock.getsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE) == 1
            lost = threading.Event()
            client.on_lost = lost.set
            client.register("n1", 0, "active", "127.0.0.1", 1)
            if ending == "own close":
                client.close()
            assert client.closed.wait(5)
            client._reader.join(5)
            t.join(5)
            assert lost.is_set() == (ending == "vanish"), ending
            client.close()


def test_a_faults_stop_cuts_the_whole_group_and_a_planned_one_only_where_it_must(monkeypatch):
    """A fault's STOP (a crash, an in-place fault, a hang): the step in progress completes
    nowhere, so the rank cuts its connections to every host of its group, not only the lost
    ones (a peer that left the all-reduce on its own error keeps its sockets until its
    teardown, and a rank reading from it would wait out the collective timeout), and leaves a
    doomed step at once, lost node or not. A planned STOP (a move: nobody lost) cuts nothing,
    but where the job says a rank leaving at its boundary can strand a peer mid-step."""
    import hpct_slurm.recovery.client as C

    cuts: list[tuple[set, set]] = []
    monkeypatch.setattr(C, "sever", lambda addrs, keep=(), keep_fds=(), outbound=():
                        cuts.append((set(addrs), set(outbound))) or 0)
    stops = [P.Stop(0, "n2: step failed", [], fault=True),
             P.Stop(0, "n3: connection lost", ["10.0.0.3"], fault=True),
             P.Stop(0, "move n4", []), P.Stop(0, "move n4", [])]
    with socket.create_server(("127.0.0.1", 0)) as server:
        def serve() -> None:
            conn, _ = server.accept()
            with conn:
                chan = P.server_hello(conn, SECRET, "28017", 5)
                chan.recv(conn)  # the Register
                for stop in stops:
                    chan.send(conn, stop)
                conn.recv(1 << 16)  # until the rank hangs up
        t = threading.Thread(target=serve)
        t.start()
        client = C.CoordinationClient(C.ControllerAddress(*server.getsockname()[:2]), SECRET,
                                      "28017")
        client.host_addr, client.sever_own_node = "10.0.0.1", True
        client.group_addrs = {"10.0.0.2", "10.0.0.3", "10.0.0.4"}
        doomed = []
        client.on_stop = lambda: (doomed.append(client.stop_doomed),
                                  len(doomed) == 3 and setattr(client, "cut_group_on_any_stop",
                                                               True))
        client.register("n1", 0, "active", "10.0.0.1", 1)
        deadline = time.monotonic() + 10
        while len(doomed) < 4 and time.monotonic() < deadline:
            time.sleep(0.01)
        client.close()
        t.join(5)
    group = {"10.0.0.2", "10.0.0.3", "10.0.0.4"}
    assert doomed == [True, True, False, False]
    assert cuts == [(group, {"10.0.0.1"}), (group, {"10.0.0.1"}), (set(), set()),
                    (group, {"10.0.0.1"})]


# ---- the rooms themselves: their size and their imports -----------------------------------

PACKAGE = Path(hpct_slurm.__file__).parent
ROOMED = ("recovery", "controller", "rendezvous")  # no file over MAX_LINES in these
MAX_LINES = 600


def test_no_file_of_the_recovery_controller_or_rendezvous_package_is_over_600_lines():
    """Each file one concern a newcomer can read at once (issue 46): a file that grows past
    this is split by concern, not grown."""
    over = {str(p.relative_to(PACKAGE)): n for room in ROOMED
            for p in sorted((PACKAGE / room).glob("*.py"))
            if (n := len(p.read_text(encoding="utf-8").splitlines())) > MAX_LINES}
    assert over == {}


def module_imports() -> dict[str, set[str]]:
    """Every module of hpct_slurm -> the modules of hpct_slurm it imports, read from the source.
    Every import counts, wherever it stands: at the top, inside a function (deferred to call
    time: a circle is still a circle to the reader) and under TYPE_CHECKING (each module must be
    readable without the other). `from pkg import name` is an import of pkg.name where that is
    a module, else of pkg (its __init__); a package's __init__ that Python runs on the way to a
    submodule is not counted (every module would otherwise import its package's)."""
    modules = {}
    for p in PACKAGE.rglob("*.py"):
        parts = ("hpct_slurm", *p.relative_to(PACKAGE).with_suffix("").parts)
        modules[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = p

    def resolve(name: str) -> str | None:
        while name and name not in modules:
            name = name.rpartition(".")[0]
        return name or None

    graph: dict[str, set[str]] = {}
    for mod, p in modules.items():
        package = mod if p.name == "__init__.py" else mod.rpartition(".")[0]
        found: set[str | None] = set()
        for node in ast.walk(ast.parse(p.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Import):
                found |= {resolve(a.name) for a in node.names}
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    up = package.split(".")[:len(package.split(".")) - (node.level - 1)]
                    base = ".".join([*up, *([node.module] if node.module else [])])
                if base == "hpct_slurm" or base.startswith("hpct_slurm."):
                    found |= {resolve(f"{base}.{a.name}") for a in node.names}
        graph[mod] = {m for m in found if m is not None and m != mod}
    return graph


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """One circle through each module that lies on one, as the path that closes it."""
    found: list[list[str]] = []
    done: set[str] = set()

    def walk(path: list[str]) -> None:
        for nxt in sorted(graph[path[-1]]):
            if nxt in path:
                found.append(path[path.index(nxt):] + [nxt])
            elif nxt not in done:
                walk(path + [nxt])
        done.add(path[-1])

    for mod in sorted(graph):
        if mod not in done:
            walk([mod])
    return found


def test_the_import_graph_is_read_from_the_source():
    graph = module_imports()
    assert "hpct_slurm.recovery.layout_rules" in graph["hpct_slurm.recovery.generation"]
    # a function-level import counts (ddp.py reaches the Job only when a forward runs)
    assert "hpct_slurm.recovery.job" in graph["hpct_slurm.recovery.ddp"]
    # and one under TYPE_CHECKING (restore.py names the Generation in annotations only)
    assert "hpct_slurm.recovery.generation" in graph["hpct_slurm.recovery.restore"]
    assert circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c", "a"]]
    assert circles({"a": {"b"}, "b": set()}) == []


def test_no_module_of_hpct_slurm_imports_another_in_a_circle():
    """Each module readable, testable and changeable without the ones that import it
    (issue 46: generation.py and snapshot_policy.py imported each other)."""
    assert circles(module_imports()) == []
