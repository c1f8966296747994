"""The shard grid of an all-gather (grid.py) and RootlessStore.gather on real shard servers."""
from __future__ import annotations

import datetime
import math
import threading
from collections import Counter

import pytest
import torch.distributed as dist
from hypothesis import given, settings
from hypothesis import strategies as st

from hpct_slurm.rendezvous.grid import Grid
from hpct_slurm.rendezvous.store import RootlessStore, shard_of

from _ranks import run_ranks, shard_servers

SECRET = b"k" * 32
HEAD = "hpct/gen0/0//cpu//0/"


@settings(max_examples=200, deadline=None)
@given(st.integers(1, 400), st.data())
def test_every_reader_finds_every_key_where_it_was_written(n, data):
    grid = Grid(n)
    reader = data.draw(st.integers(0, n - 1))
    key_home = data.draw(st.integers(0, n - 1))
    shard = grid.read_shard(reader, key_home)
    assert shard in grid.write_shards(key_home)  # the copy the reader asks for exists
    assert key_home in grid.write_shards(key_home)  # and so does the home copy
    assert grid.read_shard(reader, reader) == reader


@pytest.mark.parametrize("n", [1, 2, 3, 4, 5, 16, 17, 32, 63, 64, 288, 2304])
def test_a_rank_talks_to_about_two_root_n_shards_and_the_load_is_even(n):
    grid = Grid(n)
    rows = {frozenset(r) for r in grid.rows}
    assert sorted(s for r in rows for s in r) == list(range(n))  # rows partition the shards
    assert max(map(len, rows)) - min(map(len, rows)) <= 1
    load: Counter = Counter({s: 0 for s in range(n)})
    touched = []
    for home in range(n):
        reads = grid.reads(home, range(n))
        assert len(reads) == len(grid.rows)  # one request per row
        writes = set(grid.write_shards(home))
        load.update(writes)
        load.update(reads.keys())
        touched.append(len(writes | set(reads)))
    assert max(touched) <= 2 * math.ceil(math.sqrt(n))
    assert max(load.values()) <= 1.25 * (sum(load.values()) / n)


@settings(max_examples=200, deadline=None)
@given(st.integers(1, 300), st.integers(0, 3), st.data())
def test_every_row_copy_anyone_reads_is_checked_by_the_ranks_of_its_shard(n, extra, data):
    """Issue 30: the split-view check (gather.FormationStore) holds the copies of a reader's
    own row that it reads on its home shard against their owners'. Any copy a reader reads
    that is not its owner's lies on a shard of the key's row, and the ranks whose home that
    shard is check it: with rank keys on consecutive shards (shard_of) and at least one rank
    per shard, every shard has such ranks."""
    grid = Grid(n)
    world = n + extra * data.draw(st.integers(0, n))
    homes = [shard_of(f"{HEAD}{r}", n) for r in range(world)]
    assert set(homes) == set(range(n))  # every shard is some rank's home
    reader = data.draw(st.integers(0, world - 1))
    for k, home in enumerate(homes):
        shard = grid.read_shard(homes[reader], home)
        if shard != home:
            assert k in grid.own_row(shard, homes)
    row = grid.write_shards(homes[reader])
    assert all(homes[k] in row for k in grid.own_row(homes[reader], homes))


def test_grid_rejects_a_shard_outside_it():
    with pytest.raises(ValueError, match="outside 0..3"):
        Grid(4).write_shards(4)
    with pytest.raises(ValueError, match="at least one shard"):
        Grid(0)


@pytest.fixture
def servers():
    with shard_servers(9, SECRET) as servers:
        yield servers


def test_gather_on_real_shards_every_rank_reads_every_key(servers):
    """9 ranks over 9 shards (3 rows of 3): each writes its row and reads one shard a row, in
    one round trip; everyone gets everything, each rank's connections are 5 of 9, and a plain
    get still finds a key at its home shard."""
    n = len(servers)
    endpoints = [s.address for s in servers]
    keys = [f"{HEAD}{r}" for r in range(n)]
    def rank(r: int) -> list[bytes]:
        store = RootlessStore(endpoints, SECRET, datetime.timedelta(seconds=10))
        try:
            return store.gather(keys[r], f"addr-{r}".encode(), keys)
        finally:
            store.close()

    got = run_ranks(n, rank)
    assert all(got[r] == [f"addr-{i}".encode() for i in range(n)] for r in range(n))
    stats = [s.stats() for s in servers]
    assert sum(s.connections for s in stats) == n * (3 + 3 - 1)
    assert sum(s.requests for s in stats) == n * (3 + 3)
    assert all(s.keys == 3 for s in stats)  # its row's 3 keys on every shard
    reader = RootlessStore(endpoints, SECRET, datetime.timedelta(seconds=5))
    try:
        for i, k in enumerate(keys):
            assert servers[shard_of(k, n)].stats().keys == 3
            assert reader.get(k) == f"addr-{i}".encode()
    finally:
        reader.close()


def test_gather_waits_for_a_late_writer_and_times_out_naming_a_missing_key(servers):
    endpoints = [s.address for s in servers[:4]]
    keys = [f"{HEAD}{r}" for r in range(2)]
    early = RootlessStore(endpoints, SECRET, datetime.timedelta(milliseconds=300))
    try:
        with pytest.raises(dist.DistStoreError, match=f"key '{HEAD}1' did not appear"):
            early.gather(keys[0], b"a", keys)
        late = RootlessStore(endpoints, SECRET, datetime.timedelta(seconds=5))
        try:
            out: list[list[bytes]] = []
            t = threading.Thread(target=lambda: out.append(early.gather(keys[0], None, keys)))
            early.set_timeout(datetime.timedelta(seconds=5))
            t.start()
            assert late.gather(keys[1], b"b", keys) == [b"a", b"b"]
            t.join(10)
            assert out == [[b"a", b"b"]]
        finally:
            late.close()
    finally:
        early.close()


def test_gather_refuses_a_fanned_out_key(servers):
    store = RootlessStore([s.address for s in servers[:2]], SECRET,
                          datetime.timedelta(seconds=1))
    store.fan_out("id/", [0, 1])
    with pytest.raises(dist.DistStoreError, match="declared fanned out"):
        store.gather("id/0", b"x", ["id/0"])
    store.close()
