"""gloo's address exchange gathered into one multi_get: the pure plan, and FormationStore over
real shard servers with threads playing the ranks the way gloo calls the store."""
from __future__ import annotations

import datetime
import threading
import time

import pytest
import torch.distributed as dist

from hpct_slurm.rendezvous.gather import (FormationStore, GatherPlan, SplitViewError,
                                          split_rank_key, wraps)
from hpct_slurm.rendezvous.grid import Grid
from hpct_slurm.rendezvous.store import RootlessStore, shard_of

from _ranks import run_ranks, shard_servers

SECRET = b"0123456789abcdef0123456789abcdef"
HEAD = "hpct/gen3/0//cpu//0/"


class Fetches:
    def __init__(self, values: dict[str, bytes]):
        self.values = values
        self.calls: list[tuple[tuple[str, bytes] | None, list[str]]] = []

    def __call__(self, held: tuple[str, bytes] | None, keys: list[str]) -> list[bytes]:
        self.calls.append((held, list(keys)))
        return [self.values[k] for k in keys]


def test_split_rank_key():
    assert split_rank_key(HEAD + "12") == (HEAD, 12)
    assert split_rank_key("x/y") is None
    assert split_rank_key("7") is None  # no head: not a per-rank key
    assert split_rank_key("a/" + "1" * 10) is None  # too long to be a rank


def test_plan_fetches_every_rank_key_once_after_its_own_set():
    values = {f"{HEAD}{i}": bytes([i]) for i in range(4)}
    fetch = Fetches(values)
    plan = GatherPlan(rank=2, world_size=4)
    assert plan.take(HEAD + "0", fetch) is None  # nothing set by this rank yet: not gathered
    assert plan.hold(HEAD + "2", b"mine")  # held back, to go out with the multi_get
    assert not plan.hold(HEAD + "2", b"again")  # a second set of it goes out at once
    for i in range(4):
        assert plan.holds(f"{HEAD}{i}", fetch)
        assert plan.take(f"{HEAD}{i}", fetch) == bytes([i])
    assert fetch.calls == [((HEAD + "2", b"mine"), [f"{HEAD}{i}" for i in range(4)])]
    assert plan.release() is None  # sent with the fetch
    assert plan.take(HEAD + "1", fetch) is None  # handed out once: a second get asks the store
    assert plan.take(HEAD + "4", fetch) is None  # beyond the world: not ours to answer


def test_plan_ignores_a_key_set_by_one_rank_for_another():
    """NCCL's unique id: rank 0 sets <head>/0 and the others read it. Rank 1 must not wait for
    <head>/1 .. <head>/N-1, which nobody sets."""
    fetch = Fetches({})
    plan = GatherPlan(rank=1, world_size=4)
    assert not plan.hold(HEAD + "0", b"id")  # sent at once
    assert not plan.holds(HEAD + "0", fetch)
    assert plan.take(HEAD + "0", fetch) is None
    assert fetch.calls == []


def test_only_gloos_own_key_is_held_back():
    """Another own-rank key (e.g. a fan-out copy `<key>/fan/<rank>`) goes out at once: this
    rank may next block on something that needs it. Its head is still gathered."""
    fetch = Fetches({f"id/fan/{i}": b"c" for i in range(2)})
    plan = GatherPlan(rank=1, world_size=2)
    assert not plan.hold("id/fan/1", b"c")
    assert plan.take("id/fan/0", fetch) == b"c"
    assert fetch.calls == [(None, ["id/fan/0", "id/fan/1"])]


def test_plan_passes_everything_through_once_finished():
    fetch = Fetches({f"{HEAD}{i}": b"v" for i in range(2)})
    plan = GatherPlan(rank=0, world_size=2)
    plan.finish()
    assert not plan.hold(HEAD + "0", b"v")
    assert plan.take(HEAD + "1", fetch) is None and fetch.calls == []


def test_after_the_formation_only_peer_keys_of_its_heads_are_late_reads():
    """Lazy gloo reads a peer's key when it first uses the pair, after init: those reads (and
    only those) are answered in one round trip."""
    plan = GatherPlan(rank=1, world_size=4)
    assert plan.hold(HEAD + "1", b"mine")
    assert not plan.late_read(HEAD + "2")  # still forming: the gather answers it
    plan.release()
    plan.finish()
    assert plan.late_read(HEAD + "2") and plan.late_read(HEAD + "0")
    assert not plan.late_read(HEAD + "1")  # its own key
    assert not plan.late_read(HEAD + "4")  # beyond the world
    assert not plan.late_read("hpct/gen3/1//cpu//0/2")  # a group made after init
    assert not plan.late_read("plain")


def test_plan_rejects_a_rank_outside_the_world():
    with pytest.raises(ValueError, match="rank 4 is not in 0..3"):
        GatherPlan(rank=4, world_size=4)


@pytest.fixture
def servers():
    with shard_servers(4, SECRET) as servers:
        yield servers


def test_formation_store_answers_gloos_calls_with_one_request_per_shard(servers):
    """N ranks each: set own key, then wait + get every rank's key (gloo's connectFullMesh).
    Every value arrives right, and each rank sends its set to its grid row, one request per
    row (grid.py) and the check of its row's copies against their owners' (one multi_get to
    the other shard of its row) instead of 2N+1 requests, over 3 of the 4 shards'
    connections."""
    n = 8
    endpoints = [s.address for s in servers]
    def rank(r: int) -> list[bytes]:
        inner = RootlessStore(endpoints, SECRET, datetime.timedelta(seconds=10))
        store = FormationStore(inner, r, n)
        try:
            store.set(f"{HEAD}{r}", f"addr-{r}".encode())
            out = []
            for i in range(n):
                store.wait([f"{HEAD}{i}"])
                out.append(store.get(f"{HEAD}{i}"))
            assert store.plan.fetches == 1
            return out
        finally:
            inner.close()

    got = run_ranks(n, rank)
    assert all(got[r] == [f"addr-{i}".encode() for i in range(n)] for r in range(n))
    stats = [s.stats() for s in servers]
    # 4 shards: 2 rows of 2. A set to each shard of the row, a multi_get to one shard a row,
    # and one to the other shard of its row (the owners' copies it checks).
    assert sum(s.requests for s in stats) == n * (2 + 2 + 1)  # not n * (2n + 1) = 136
    # Its row and its column: 3 shards of 4 (every shard: 4 rank-to-shard connections).
    assert sum(s.connections for s in stats) == n * 3
    assert sorted(s.connections for s in stats) == [6, 6, 6, 6]


def test_a_key_overwritten_on_one_shard_of_its_row_fails_the_formation(servers):
    """Issue 30: a member (trusted, holding the secret) overwrites another rank's gathered key
    on one shard of that key's row. The readers of that shard would connect to another address
    than everyone else; the ranks whose home that shard is hold the copy against its owner's,
    and the formation fails with a named error instead of forming on a split view."""
    n = len(servers)
    endpoints = [s.address for s in servers]
    keys = [f"{HEAD}{r}" for r in range(n)]
    homes = [shard_of(k, n) for k in keys]
    grid = Grid(n)
    victim = 0
    [tampered] = [s for s in grid.write_shards(homes[victim]) if s != homes[victim]]
    [resident] = [r for r in range(n) if homes[r] == tampered]  # one rank key per shard
    for r in range(n):  # every rank's key written over the grid, as gloo's init does
        writer = RootlessStore(endpoints, SECRET, datetime.timedelta(seconds=5))
        writer.gather(keys[r], f"addr-{r}".encode(), [])
        writer.close()
    member = RootlessStore([servers[tampered].address], SECRET)  # that one shard only
    member.set(keys[victim], b"elsewhere")
    member.close()

    def form(r: int) -> list[bytes]:
        inner = RootlessStore(endpoints, SECRET, datetime.timedelta(seconds=5))
        store = FormationStore(inner, r, n)
        try:
            store.set(keys[r], f"addr-{r}".encode())
            store.wait(keys)
            return [store.get(k) for k in keys]
        finally:
            inner.close()

    with pytest.raises(SplitViewError, match=(
            f"split view of gathered key '{keys[victim]}' \\(its copy on shard {tampered}, "
            f"which this rank read, differs from its owner's copy on its home shard "
            f"{homes[victim]}\\)")):
        form(resident)
    assert form(victim)[victim] == b"addr-0"  # its own row's copies, on its home, are intact


def test_a_rank_whose_own_key_holds_another_value_fails_the_formation():
    """Two processes claiming one rank: what this rank reads back of its own key is not
    what it wrote."""
    class Other:
        timeout = datetime.timedelta(seconds=1)

        def gather(self, own, value, keys):
            return [b"theirs" for _ in keys]

    store = FormationStore(Other(), 0, 1)
    store.set(HEAD + "0", b"mine")
    with pytest.raises(SplitViewError, match="this rank's own: its home shard holds another "
                                             "value than this rank wrote"):
        store.get(HEAD + "0")


def test_a_held_set_goes_out_before_any_other_request(servers):
    """Lazy gloo sets its key and reads none in init; another call, or the end of the
    formation, must send the held key, or the peers would wait for it forever."""
    endpoints = [s.address for s in servers]
    inner = RootlessStore(endpoints, SECRET, datetime.timedelta(seconds=5))
    peer = RootlessStore(endpoints, SECRET, datetime.timedelta(milliseconds=50))
    store = FormationStore(inner, 1, 2)
    store.set(HEAD + "1", b"mine")
    assert not peer.check([HEAD + "1"])  # held
    assert store.add("counter", 1) == 1
    assert peer.get(HEAD + "1") == b"mine"
    store2 = FormationStore(inner, 1, 2)
    store2.set(HEAD + "x/1", b"later")
    store2.finish()
    assert peer.get(HEAD + "x/1") == b"later"
    inner.close()
    peer.close()


def test_lazy_gloos_first_use_of_a_pair_is_one_request(servers):
    """Lazy gloo: init sets this rank's key only; each pair's first use then waits for the
    peer's key and gets it. The wait fetches it (one request, which itself waits for the key
    to appear), the get is answered from that; a key that never appears times out within
    the wait's own timeout."""
    endpoints = [s.address for s in servers]
    inner = RootlessStore(endpoints, SECRET, datetime.timedelta(seconds=30))
    peer = RootlessStore(endpoints, SECRET, datetime.timedelta(seconds=30))
    store = FormationStore(inner, 0, 3)
    store.set(HEAD + "0", b"addr-0")
    store.finish()  # init is over: the held key goes out
    assert peer.get(HEAD + "0") == b"addr-0"
    before = sum(s.stats().requests for s in servers)  # before the peer can set
    threading.Timer(0.2, peer.set, (HEAD + "1", b"addr-1")).start()  # a late peer
    store.wait([HEAD + "1"])
    assert store.get(HEAD + "1") == b"addr-1"
    # The peer's set and one get (a wait and a get would make 3).
    assert sum(s.stats().requests for s in servers) - before == 2
    t0 = time.monotonic()
    with pytest.raises(dist.DistStoreError, match="timed out after 0.2 s"):
        store.wait([HEAD + "2"], datetime.timedelta(milliseconds=200))
    assert time.monotonic() - t0 < 5  # its own timeout, not the store's 30 s
    inner.close()
    peer.close()


def test_lazy_formation_barrier_waits_for_every_rank_and_answers_first_reads(servers):
    """pg.init's lazy formation: finish(barrier=True) sends the held key with the multi_get
    of its head, which waits for a late rank, and keeps the peers' values: each pair's first
    wait-then-get is answered without a request."""
    n = 3
    endpoints = [s.address for s in servers]
    inners = [RootlessStore(endpoints, SECRET, datetime.timedelta(seconds=30)) for _ in range(n)]
    stores = [FormationStore(inners[r], r, n) for r in range(n)]
    for r in range(n):
        stores[r].set(f"{HEAD}{r}", f"addr-{r}".encode())  # lazy gloo's whole init
    done: list[float] = []
    t0 = time.monotonic()

    def finish(r: int) -> None:
        stores[r].finish(barrier=True)
        done.append(time.monotonic() - t0)

    threads = [threading.Thread(target=finish, args=(r,)) for r in range(n - 1)]
    for t in threads:
        t.start()
    time.sleep(0.5)  # the last rank arrives late
    assert not done
    finish(n - 1)
    for t in threads:
        t.join(10)
    assert len(done) == n and min(done) >= 0.5
    before = sum(s.stats().requests for s in servers)
    for r in range(n):
        for i in range(n):
            if i != r:
                stores[r].wait([f"{HEAD}{i}"])
                assert stores[r].get(f"{HEAD}{i}") == f"addr-{i}".encode()
    assert sum(s.stats().requests for s in servers) == before
    # a value is handed out once: a second read goes to the store
    assert stores[0].get(f"{HEAD}1") == b"addr-1"
    assert sum(s.stats().requests for s in servers) == before + 1
    for inner in inners:
        inner.close()


def test_formation_store_passes_other_keys_through(servers):
    inner = RootlessStore([s.address for s in servers], SECRET, datetime.timedelta(seconds=5))
    store = FormationStore(inner, 0, 2)
    store.set("plain", b"1")
    assert store.get("plain") == b"1"
    assert store.add("counter", 3) == 3
    store.wait(["plain"], datetime.timedelta(seconds=1))
    store.set_timeout(datetime.timedelta(milliseconds=5))
    with pytest.raises(dist.DistStoreError, match="'missing'"):
        store.get("missing")
    clone = store.clone()
    assert clone.plan is store.plan and clone.get("plain") == b"1"
    clone.inner.close()
    inner.close()


def test_only_the_rootless_store_is_gathered(servers):
    inner = RootlessStore([s.address for s in servers], SECRET)
    assert wraps(inner)
    assert not wraps(dist.HashStore())
    inner.close()


_AFTER_INIT = r'''
import datetime, gc, os, sys
import torch, torch.distributed as dist
from hpct_slurm.rendezvous import pg
from hpct_slurm.rendezvous.derive import derive
from hpct_slurm.rendezvous.store import make_store, serve_shard
from hpct_slurm.slurm.env import SlurmEnv

env = SlurmEnv.from_environ({
    "SLURM_JOB_ID": "77", "SLURM_JOB_NODELIST": "h1", "SLURMD_NODENAME": "h1",
    "SLURM_STEP_NODELIST": "h1", "SLURM_PROCID": "0", "SLURM_LOCALID": "0",
    "SLURM_NODEID": "0", "SLURM_NTASKS": "1", "SLURM_TASKS_PER_NODE": "1"})
secret = b"0123456789abcdef0123456789abcdef"
info = derive(env, 0, ["h1"], tasks_per_node=1, resolve=lambda name: "127.0.0.1")
shard = serve_shard(info, secret)
store = make_store("rootless", info, secret)
pg.init(info, store, "gloo", shard=shard)
gc.collect()  # what a training step does sooner or later
sub = dist.new_group([0])  # a DeviceMesh's sub-group: the store is called again after init
t = torch.ones(2)
dist.all_reduce(t, group=sub)
print("SUBGROUP", t.tolist(), flush=True)
pg.teardown()
'''


def test_a_group_made_after_init_still_reaches_the_store(tmp_path):
    """A DeviceMesh's sub-groups are made after init, through the store the world group
    holds. That store is Python-defined (FormationStore): were its Python object collected
    once init returned, torch would fail every later call with 'Not implemented' (seen: HSDP
    jobs faulting at their first mesh). One real gloo process, in its own interpreter."""
    import os
    import subprocess
    import sys

    script = tmp_path / "after_init.py"
    script.write_text(_AFTER_INIT)
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                         timeout=120, env={**os.environ, "GLOO_SOCKET_IFNAME": "lo"})
    assert out.returncode == 0, out.stderr[-2000:]
    assert "SUBGROUP [1.0, 1.0]" in out.stdout
