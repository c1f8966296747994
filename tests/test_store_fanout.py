"""Issue 16, the store at scale: where a declared many-reader key's copies go (fanout.py), the
store applying it on real shard servers (RootlessStore.fan_out), pg.init declaring NCCL's
world id, and bench store_scale's traffic counted by the servers against the placement."""
from __future__ import annotations

import datetime
import os
import threading
import time

import pytest
import torch.distributed as dist
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, rule

from hpct_slurm.bench import store_scale
from hpct_slurm.errors import HpctError
from hpct_slurm.events import EventLog
from hpct_slurm.rendezvous import gather
from hpct_slurm.rendezvous.fanout import FanoutTable, copy_key, reader_shards
from hpct_slurm.rendezvous.pg import generation_prefix, nccl_id_prefix
from hpct_slurm.rendezvous.store import RootlessStore, ShardServer, shard_of

SECRET = b"0123456789abcdef0123456789abcdef"
PREFIX = "hpct/gen0/7//cuda//"
KEY = PREFIX + "0"


# ---- fanout.py: pure placement ------------------------------------------------------------
@settings(max_examples=200, deadline=None)
@given(n=st.integers(1, 4096), data=st.data(),
       key=st.text("abc/:0123456789", min_size=1, max_size=20))
def test_a_copy_lands_on_the_shard_it_names(n, data, key):
    shard = data.draw(st.integers(0, n - 1))
    assert shard_of(copy_key(key, shard, n), n) == shard


@settings(max_examples=200, deadline=None)
@given(n=st.integers(1, 300), data=st.data(), counter=st.integers(0, 10**6))
def test_every_reader_reads_a_copy_the_writer_wrote(n, data, counter):
    hosts = data.draw(st.lists(st.integers(0, n - 1), min_size=1, max_size=40))
    table = FanoutTable(n)
    table.declare(PREFIX, hosts)
    key = f"{PREFIX}{counter}"
    written = table.write_keys(key)
    assert written[0] == key  # the home key too
    # one copy per distinct reader host, each on that host's shard
    assert sorted(shard_of(k, n) for k in written[1:]) == sorted(set(hosts))
    for h in range(n):
        read = table.read_key(key, h)
        if h in hosts:
            assert read in written and read != key and shard_of(read, n) == h
        else:
            assert read == key  # a reader off the declared hosts reads the home key
    assert table.read_key(key, None) == key


def test_only_counter_keys_under_a_declared_prefix_fan_out():
    table = FanoutTable(8)
    table.declare(PREFIX, [1, 2])
    assert table.readers(PREFIX + "3") == (1, 2)
    for key in (PREFIX + "0:1",  # NCCL's point-to-point key: one reader
                PREFIX[:-1] + "0", "hpct/gen0/8//cuda//0", PREFIX + "x/0", PREFIX):
        assert table.readers(key) is None
        assert table.write_keys(key) == [key] and table.read_key(key, 1) == key


def test_declarations_must_agree():
    table = FanoutTable(8)
    table.declare(PREFIX, [2, 1, 2])
    table.declare(PREFIX, [1, 2])  # the same reader shards: fine
    with pytest.raises(ValueError, match="already declared"):
        table.declare(PREFIX, [1, 3])
    with pytest.raises(ValueError, match="end in '/'"):
        table.declare("hpct/gen0/7//cuda", [1])
    with pytest.raises(ValueError, match="outside"):
        reader_shards([0, 8], 8)
    with pytest.raises(ValueError, match="at least one"):
        reader_shards([], 8)


# ---- the store on real shard servers --------------------------------------------------------
@pytest.fixture
def four():
    servers = [ShardServer("127.0.0.1", 0, SECRET, events=EventLog()) for _ in range(4)]
    stores: list[RootlessStore] = []

    def store(local: int | None, declare: bool = True) -> RootlessStore:
        s = RootlessStore([sv.address for sv in servers], SECRET,
                          datetime.timedelta(seconds=5), local_shard=local)
        if declare:
            s.fan_out(PREFIX, [1, 2, 3])
        stores.append(s)
        return s

    yield servers, store
    for s in stores:
        s.close()
    for sv in servers:
        sv.stop()


def _requests(servers) -> list[int]:
    return [sv.stats().requests for sv in servers]


def test_writer_sets_every_copy_and_readers_read_their_own_shard(four):
    servers, store = four
    writer, plain = store(0), store(None, declare=False)
    readers = {h: store(h) for h in range(4)}
    got = {}
    # Readers that come first wait for their own copy (a get parks on the shard).
    parked = servers[2].stats().requests
    early = threading.Thread(target=lambda: got.update(early=readers[2].get(KEY)))
    early.start()
    deadline = time.monotonic() + 10  # its get has reached its shard (counted) before the set
    while servers[2].stats().requests == parked and time.monotonic() < deadline:
        time.sleep(0.01)
    time.sleep(0.1)
    assert early.is_alive()
    before = _requests(servers)
    writer.set(KEY, b"id")
    early.join(5)
    assert got["early"] == b"id"
    # One set per copy plus the home key's, no more.
    sets = [a - b for a, b in zip(_requests(servers), before)]
    assert sum(sets) == 4 and all(sets[h] >= 1 for h in (1, 2, 3))
    assert all(plain.get(copy_key(KEY, h, 4)) == b"id" for h in (1, 2, 3))
    assert plain.get(KEY) == b"id"
    for h in (1, 3, 0):
        before = _requests(servers)
        assert readers[h].get(KEY) == b"id"
        after = _requests(servers)
        # a declared reader host asks its own shard; host 0 (not a reader) the home shard
        asked = h if h else shard_of(KEY, 4)
        assert [a - b for a, b in zip(after, before)] == [int(i == asked) for i in range(4)]


def test_wait_check_multi_get_and_delete_see_the_copies(four):
    servers, store = four
    writer, reader, plain = store(0), store(3), store(None, declare=False)
    other = "hpct/gen0/7//cpu//0/1"
    writer.set(other, b"o")
    assert not reader.check([KEY])
    with pytest.raises(dist.DistStoreError, match="timed out"):
        reader.wait([KEY], datetime.timedelta(milliseconds=50))
    writer.set(KEY, b"id")
    reader.wait([KEY, other])
    assert reader.check([KEY, other])
    assert reader.multi_get([other, KEY, KEY]) == [b"o", b"id", b"id"]
    assert reader.set_then_multi_get(PREFIX + "1", b"next", [KEY, PREFIX + "1"]) == [
        b"id", b"next"]
    assert plain.get(copy_key(PREFIX + "1", 2, 4)) == b"next"  # that set fanned out too
    assert writer.delete_key(KEY)
    assert not plain.check([KEY] + [copy_key(KEY, h, 4) for h in (1, 2, 3)])
    assert not writer.delete_key(KEY)


def test_a_declared_key_is_write_once(four):
    _, store = four
    s = store(1)
    for call in (lambda: s.add(KEY, 1), lambda: s.compare_set(KEY, b"", b"x")):
        with pytest.raises(dist.DistStoreError, match="write-once"):
            call()
    assert s.add(PREFIX + "0:1", 2) == 2  # a point-to-point key is not declared


def test_clones_share_declarations_local_shard_and_abort(four):
    servers, store = four
    parent = RootlessStore([sv.address for sv in servers], SECRET,
                           datetime.timedelta(seconds=30), local_shard=1)
    clone = parent.clone()
    parent.fan_out(PREFIX, [1, 2, 3])  # after cloning: the clone sees it
    store(0).set(KEY, b"id")
    before = _requests(servers)
    assert clone.get(KEY) == b"id"
    assert shard_of(KEY, 4) != 1  # so the clone's read is its local shard's, not home's
    assert [a - b for a, b in zip(_requests(servers), before)] == [0, 1, 0, 0]
    # A reader blocked on its local copy is ended by an abort (a STOP during formation).
    errors = []

    def blocked():
        try:
            clone.get(PREFIX + "5")
        except dist.DistStoreError as exc:
            errors.append(exc)

    t = threading.Thread(target=blocked)
    t.start()
    time.sleep(0.2)
    parent.abort()
    t.join(5)
    assert not t.is_alive() and errors and "aborted" in str(errors[0])
    parent.close()
    clone.close()


def test_a_bad_local_shard_or_declaration_is_refused(four):
    servers, store = four
    with pytest.raises(HpctError, match="local shard 4"):
        RootlessStore([sv.address for sv in servers], SECRET, local_shard=4)
    s = store(1)
    with pytest.raises(HpctError, match="already declared"):
        s.fan_out(PREFIX, [1])


def test_the_formation_store_passes_a_fanned_key_through(four):
    """NCCL's world id during init_process_group goes through gather.FormationStore."""
    servers, store = four
    writer = gather.FormationStore(store(1), rank=0, world_size=16)
    reader = gather.FormationStore(store(3), rank=9, world_size=16)
    writer.set(KEY, b"id")
    before = _requests(servers)
    assert reader.get(KEY) == b"id"
    assert [a - b for a, b in zip(_requests(servers), before)] == [0, 0, 0, 1]


SHORT = datetime.timedelta(milliseconds=5)
FAN_KEYS = st.sampled_from([PREFIX + "0", PREFIX + "1", PREFIX + "0:1", "hpct/gen0/7//cpu//0/2",
                            "other"])
VALUES = st.binary(min_size=1, max_size=8)
READER = st.integers(0, 3)  # a reader on shard 0, 1 (not a declared host), 2, or with none


class FannedStoreVsHashStore(RuleBasedStateMachine):
    """With a declared prefix, whatever a writer sets, overwrites or deletes, each reader (on
    a declared host, off them, or with no local shard) reads what HashStore holds."""

    def __init__(self) -> None:
        super().__init__()
        self.servers = [ShardServer("127.0.0.1", 0, SECRET, events=EventLog()) for _ in range(3)]
        self.writer, *self.readers = (self._store(local) for local in (None, 0, 1, 2, None))
        self.oracle = dist.HashStore()

    def _store(self, local: int | None) -> RootlessStore:
        store = RootlessStore([s.address for s in self.servers], SECRET,
                              datetime.timedelta(seconds=5), local_shard=local)
        store.fan_out(PREFIX, [0, 2])
        return store

    def teardown(self) -> None:
        for store in (self.writer, *self.readers):
            store.close()
        for s in self.servers:
            s.stop()

    def present(self, key: str) -> bool:
        return self.oracle.check([key])

    @rule(key=FAN_KEYS, value=VALUES)
    def set(self, key: str, value: bytes) -> None:
        self.writer.set(key, value)
        self.oracle.set(key, value)

    @rule(key=FAN_KEYS)
    def delete_key(self, key: str) -> None:
        assert self.writer.delete_key(key) == self.oracle.delete_key(key)

    @rule(key=FAN_KEYS, reader=READER)
    def get(self, key: str, reader: int) -> None:
        store = self.readers[reader]
        if self.present(key):
            assert store.get(key) == self.oracle.get(key)
        else:
            with pytest.raises(dist.DistStoreError, match="timed out"):
                store.get_within(key, SHORT)

    @rule(keys=st.lists(FAN_KEYS, max_size=4), reader=READER)
    def check_and_multi_get(self, keys: list[str], reader: int) -> None:
        store = self.readers[reader]
        assert store.check(keys) == self.oracle.check(keys)
        if all(self.present(k) for k in keys):
            assert store.multi_get(keys) == self.oracle.multi_get(keys)
            store.wait(keys, SHORT)

    @rule(key=FAN_KEYS, value=VALUES, keys=st.lists(FAN_KEYS, max_size=3), reader=READER)
    def set_then_multi_get(self, key: str, value: bytes, keys: list[str], reader: int) -> None:
        self.oracle.set(key, value)
        if all(self.present(k) for k in keys):
            got = self.readers[reader].set_then_multi_get(key, value, keys)
            assert got == self.oracle.multi_get(keys)
        else:
            self.readers[reader].set(key, value)


FannedStoreVsHashStore.TestCase.settings = settings(
    max_examples=40, stateful_step_count=25, deadline=None,
    suppress_health_check=[HealthCheck.too_slow])
TestFannedStoreVsHashStore = FannedStoreVsHashStore.TestCase


# ---- pg: torch's key for the world communicator's id ----------------------------------------
def test_nccl_id_prefix_is_where_torch_puts_the_world_id():
    """The chain of PrefixStores torch 2.13 builds for the default group's NCCL backend:
    pg.init's, `_new_process_group_helper`'s f"{group_name}/" and f"{device}/"; then
    ProcessGroupNCCL sets its communicator counter."""
    inner = dist.HashStore()
    chain = dist.PrefixStore("cuda/", dist.PrefixStore("0/", dist.PrefixStore(
        generation_prefix(3), inner)))
    chain.set("0", b"id")
    assert inner.check([nccl_id_prefix(3) + "0"])
    assert nccl_id_prefix(3, "12") == "hpct/gen3/12//cuda//"


def test_pg_init_declares_the_world_id_for_nccl(monkeypatch):
    from hpct_slurm.rendezvous import pg
    from hpct_slurm.rendezvous.derive import derive
    from hpct_slurm.slurm.env import SlurmEnv

    env = SlurmEnv.from_environ({
        "SLURM_JOB_ID": "5", "SLURM_JOB_NODELIST": "n0,n1,n2", "SLURMD_NODENAME": "n1",
        "SLURM_STEP_NODELIST": "n1", "SLURM_PROCID": "0", "SLURM_LOCALID": "0",
        "SLURM_NODEID": "0", "SLURM_NTASKS": "1", "SLURM_TASKS_PER_NODE": "1"})
    info = derive(env, 2, ["n0", "n1", "n2"], resolve=lambda _: "127.0.0.1",
                  ifname="lo")
    seen = {}

    def fake_init(backend, store, **_):  # torch's own, without a GPU
        seen["backend"] = backend
        raise RuntimeError("no NCCL here")

    monkeypatch.setattr(dist, "init_process_group", fake_init)
    monkeypatch.setattr(os, "environ", dict(os.environ))  # pg.init exports backend settings
    for backend, declared in (("gloo", False), ("nccl", True)):
        store = RootlessStore(info.store_endpoints, SECRET, local_shard=info.node_rank)
        with pytest.raises(RuntimeError, match="no NCCL"):
            pg.init(info, store, backend)
        assert seen["backend"] == backend
        key = nccl_id_prefix(2) + "0"
        if declared:
            with pytest.raises(dist.DistStoreError, match="write-once"):
                store.add(key, 1)  # declared: refused before any connection
        else:
            assert store._fanout.readers(key) is None


# ---- bench store_scale -----------------------------------------------------------------------
@pytest.mark.parametrize("pattern,layout", store_scale.RUNS)
def test_the_servers_count_what_the_placement_says(pattern, layout):
    counts, _ = store_scale.measure(pattern, 12, layout, gloo_readers=5)
    assert counts == store_scale.expected(pattern, 12, layout, gloo_readers=5)
    assert len(counts) == 12 and sum(counts.values()) > 0


def test_fanout_removes_the_nccl_hot_spot_at_2048_hosts():
    plain = store_scale.summary(store_scale.expected("nccl", 2048, "plain"))
    fanned = store_scale.summary(store_scale.expected("nccl", 2048, "fanout"))
    assert plain["busiest_over_average"] > 100  # the world id's shard serves every rank
    assert fanned["busiest_over_average"] <= 2.0
    # The writer's copies cost requests, but fewer than the hot spot saved from one shard.
    assert fanned["requests"] < 2 * plain["requests"]
    # Node-local groups left at home: even, but less so (fanout.py's reason to fan them out).
    spanning = store_scale.summary(store_scale.expected("nccl", 2048, "fanout_spanning"))
    assert fanned["busiest_over_average"] < spanning["busiest_over_average"] <= 2.0
    with pytest.raises(ValueError, match="unknown layout"):
        list(store_scale.declarations("nccl", 4, "fanout-everything"))


def test_too_few_descriptors_for_the_servers_is_said_before_any_starts(monkeypatch):
    monkeypatch.setattr(store_scale, "raise_fd_limit", lambda: 1024)
    with pytest.raises(HpctError, match="2048 shard servers and 2 clients need ~16640"):
        store_scale.measure("nccl", 2048, "plain")
