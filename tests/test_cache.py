"""The shared-memory data cache: one copy per node however many ranks, exact resume after a
rank restarts, budget and name checks, and the sampler's sharding properties."""
from __future__ import annotations

import json
import multiprocessing as mp
import os
import signal
import subprocess
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hpct_slurm.cache import CachedDataset, PrefetchLoader, ResumableSampler, SharedCache
from hpct_slurm.errors import HpctError

RANKS = 4
ROWS, COLS = 1 << 15, 256  # 32 MiB of float32


def _build(marker_dir: Path):
    def build():
        # O_EXCL: a second build on this node would fail here, loudly.
        os.close(os.open(marker_dir / "built", os.O_CREAT | os.O_EXCL | os.O_WRONLY))
        x = np.arange(ROWS * COLS, dtype=np.float32).reshape(ROWS, COLS)
        return {"x": x, "ids": np.arange(ROWS, dtype=np.int64)}
    return build


def _mem_kb(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise AssertionError(field)


def _rank(cache_dir: str, marker_dir: str, barrier, results) -> None:
    anon_before = _mem_kb("RssAnon")
    entry = SharedCache(cache_dir).get("train", _build(Path(marker_dir)))
    total = float(entry.arrays["x"].sum(dtype=np.float64))  # touch every page
    results.put({"built": entry.built, "sum": total, "shmem_kb": _mem_kb("RssShmem"),
                 "anon_kb": _mem_kb("RssAnon") - anon_before})
    barrier.wait(60)  # all ranks hold their mapping while the parent measures
    barrier.wait(60)


@pytest.fixture
def private_tmpfs(tmp_path: Path):
    """A tmpfs of our own, so shm usage is measured without other users of /dev/shm."""
    mnt = tmp_path / "shm"
    mnt.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=256m", "tmpfs", str(mnt)], check=True)
    try:
        yield mnt
    finally:
        subprocess.run(["umount", "-l", str(mnt)], check=True)


def _used_bytes(path: Path) -> int:
    st = os.statvfs(path)
    return (st.f_blocks - st.f_bfree) * st.f_frsize


def test_four_local_ranks_share_one_copy(private_tmpfs, tmp_path):
    ctx = mp.get_context("fork")
    barrier, results = ctx.Barrier(RANKS + 1), ctx.Queue()
    before = _used_bytes(private_tmpfs)
    procs = [ctx.Process(target=_rank, args=(str(private_tmpfs), str(tmp_path), barrier,
                                             results)) for _ in range(RANKS)]
    for p in procs:
        p.start()
    try:
        barrier.wait(120)
        used = _used_bytes(private_tmpfs) - before
        reports = [results.get(timeout=10) for _ in range(RANKS)]
        barrier.wait(60)
    finally:
        for p in procs:
            p.join(30)
    assert [p.exitcode for p in procs] == [0] * RANKS
    nbytes = ROWS * COLS * 4 + ROWS * 8
    assert sum(r["built"] for r in reports) == 1
    assert len({r["sum"] for r in reports}) == 1
    # one copy on the node: 4 ranks, 1x the data in shm (plus index/lock file pages)
    assert nbytes <= used < nbytes * 1.05, (used, nbytes)
    for r in reports:
        assert r["shmem_kb"] * 1024 >= ROWS * COLS * 4  # every rank maps all of it...
        if not r["built"]:
            assert r["anon_kb"] * 1024 < nbytes / 2     # ...without a private copy


def _train(cache_dir: str, state_path: str, seen_path: str, stop_after: int | None) -> None:
    """A rank's data loop: record each sample id it trains on, persist the loader state after
    every step, and (first life) die by SIGKILL with the prefetch thread still reading ahead."""
    entry = SharedCache(cache_dir).get("train", lambda: (_ for _ in ()).throw(
        AssertionError("a restarted rank must attach, not rebuild")) if stop_after is None
        else {"ids": np.arange(500, dtype=np.int64), "y": np.arange(500) % 7})
    ds = CachedDataset(entry, fields=["ids"])
    loader = PrefetchLoader(ds, ResumableSampler(len(ds), rank=1, world_size=3, seed=11),
                            batch_size=7, prefetch=4)
    if os.path.exists(state_path):
        loader.load_state_dict(json.loads(Path(state_path).read_text()))
    with open(seen_path, "a") as seen:
        for step, (ids,) in enumerate(loader):
            seen.write(" ".join(map(str, ids.tolist())) + "\n")
            seen.flush()
            Path(state_path).write_text(json.dumps(loader.state_dict()))
            if stop_after is not None and step + 1 == stop_after:
                os.kill(os.getpid(), signal.SIGKILL)


def test_restarted_rank_reattaches_and_resumes_at_the_exact_sample(tmp_path):
    cache_dir = tmp_path / "job"
    cache_dir.mkdir()
    ctx = mp.get_context("fork")
    args = (str(cache_dir), str(tmp_path / "state"), str(tmp_path / "seen"))
    first = ctx.Process(target=_train, args=(*args, 5))
    first.start()
    first.join(60)
    assert first.exitcode == -signal.SIGKILL
    second = ctx.Process(target=_train, args=(*args, None))
    second.start()
    second.join(60)
    assert second.exitcode == 0
    seen = [int(i) for line in (tmp_path / "seen").read_text().split("\n") for i in line.split()]
    reference = ResumableSampler(500, rank=1, world_size=3, seed=11).epoch_indices(0).tolist()
    assert len(seen) == len(reference) and seen == reference  # nothing skipped or repeated


def test_budget_is_enforced_and_names_checked(tmp_path):
    cache = SharedCache(tmp_path, budget_mb=1)
    with pytest.raises(HpctError, match="needs 2.0 MB but this job's shm budget"):
        cache.get("big", lambda: {"a": np.zeros(2 << 20, np.uint8)})
    assert not any(tmp_path.glob("big*"))
    for bad in ("../escape", ".hidden", "a/b"):
        with pytest.raises(HpctError, match="is not a plain name"):
            cache.get(bad, lambda: {"a": np.zeros(1)})
    with pytest.raises(HpctError, match="array name"):
        cache.get("ok", lambda: {"../x": np.zeros(1)})


def test_budget_counts_every_cache_of_the_job(tmp_path):
    cache = SharedCache(tmp_path, budget_mb=3)
    cache.get("a", lambda: {"x": np.zeros(1 << 20, np.uint8)})            # 1 MB
    cache.get("b", lambda: {"x": np.zeros(1 << 20, np.uint8)})            # 2 MB in all
    assert cache.existing_bytes() == {"a": 1 << 20, "b": 1 << 20}
    with pytest.raises(HpctError, match=r"needs 1\.5 MB on top of this job's other caches "
                                        r"\(a 1\.0 MB, b 1\.0 MB\) but this job's shm budget"):
        cache.get("c", lambda: {"x": np.zeros(3 << 19, np.uint8)})
    assert not any(tmp_path.glob("c*")) and not any(tmp_path.glob(".c.building-*"))
    # another rank (another SharedCache) sees the same caches; what fits still builds
    assert SharedCache(tmp_path, budget_mb=3).get(
        "c", lambda: {"x": np.zeros(1 << 20, np.uint8)}).built
    # an attach costs nothing, and a removed cache frees its share
    assert not cache.get("a", lambda: {}).built
    assert cache.remove("b")
    assert cache.get("d", lambda: {"x": np.zeros(1 << 20, np.uint8)}).built


def test_budget_counts_a_cache_with_a_broken_index_by_its_files(tmp_path):
    SharedCache(tmp_path).get("a", lambda: {"x": np.zeros(2 << 20, np.uint8)})
    (tmp_path / "a" / "index.json").write_text("{not json")
    (tmp_path / "notes").mkdir()        # not a cache: no index
    (tmp_path / ".e.building-1").mkdir()  # half built: not counted (and swept when e builds)
    (tmp_path / ".e.building-1" / "x.npy").write_bytes(bytes(4 << 20))
    cache = SharedCache(tmp_path, budget_mb=3)
    assert 2 << 20 <= cache.existing_bytes()["a"] < (2 << 20) + 4096
    assert set(cache.existing_bytes()) == {"a"}
    with pytest.raises(HpctError, match="on top of this job's other caches"):
        cache.get("e", lambda: {"x": np.zeros(2 << 20, np.uint8)})
    assert cache.get("e", lambda: {"x": np.zeros(1 << 19, np.uint8)}).built


def test_a_crashed_builder_leaves_nothing_that_counts(tmp_path):
    cache = SharedCache(tmp_path)

    def crash():
        raise RuntimeError("preprocessing died")
    with pytest.raises(RuntimeError):
        cache.get("ds", crash)
    (tmp_path / ".ds.building-99999").mkdir()  # what a SIGKILLed builder leaves
    entry = cache.get("ds", lambda: {"a": np.arange(10)})
    assert entry.built and entry.arrays["a"].tolist() == list(range(10))
    assert sorted(p.name for p in tmp_path.iterdir()) == [".ds.lock", "ds"]
    assert not entry.arrays["a"].flags.writeable


def test_from_env_uses_the_task_env(tmp_path):
    cache = SharedCache.from_env({"HPCT_SHM_DIR": str(tmp_path), "HPCT_CACHE_MB": "5"})
    assert (cache.directory, cache.budget_mb) == (tmp_path, 5)
    with pytest.raises(HpctError, match="SLURM_JOB_ID is not set"):
        SharedCache.from_env({})
    with pytest.raises(HpctError, match="HPCT_CACHE_MB"):
        SharedCache.from_env({"HPCT_SHM_DIR": str(tmp_path), "HPCT_CACHE_MB": "-1"})


@settings(max_examples=60, deadline=None)
@given(n=st.integers(1, 300), world=st.integers(1, 8), seed=st.integers(0, 2**31),
       epoch=st.integers(0, 5), shuffle=st.booleans())
def test_shards_are_disjoint_equal_and_cover_the_epoch(n, world, seed, epoch, shuffle):
    if n < world:
        with pytest.raises(HpctError):
            ResumableSampler(n, world_size=world)
        return
    shards = [ResumableSampler(n, rank=r, world_size=world, seed=seed, shuffle=shuffle)
              .epoch_indices(epoch) for r in range(world)]
    flat = np.concatenate(shards)
    assert {len(s) for s in shards} == {n // world}
    assert len(set(flat.tolist())) == len(flat) == (n // world) * world
    assert flat.min() >= 0 and flat.max() < n


@settings(max_examples=40, deadline=None)
@given(n=st.integers(2, 200), cut=st.integers(0, 200), batch=st.integers(1, 9),
       prefetch=st.integers(1, 4))
def test_resume_from_any_point_continues_the_same_sequence(tmp_path_factory, n, cut, batch,
                                                           prefetch):
    d = tmp_path_factory.mktemp("c")
    ds = CachedDataset(SharedCache(d).get("d", lambda: {"ids": np.arange(n)}))
    full = [i for (b,) in PrefetchLoader(ds, ResumableSampler(n, world_size=2, seed=3), batch,
                                         prefetch) for i in b.tolist()]
    loader = PrefetchLoader(ds, ResumableSampler(n, world_size=2, seed=3), batch, prefetch)
    cut = min(cut, len(full))  # stop inside the epoch (at its very end at the latest)
    head = []
    if cut:
        for (b,) in loader:
            head += b.tolist()
            if len(head) >= cut:
                break
    state = loader.state_dict()
    resumed = PrefetchLoader(ds, ResumableSampler(n, world_size=2, seed=3), batch, prefetch)
    resumed.load_state_dict(state)
    tail = [i for (b,) in resumed for i in b.tolist()]
    assert head + tail == full
    assert resumed.state_dict()["epoch"] == 1 and resumed.state_dict()["offset"] == 0


def test_sampler_state_must_match_the_shard():
    s = ResumableSampler(100, rank=0, world_size=2, seed=1)
    with pytest.raises(HpctError, match="does not match"):
        s.load_state_dict(ResumableSampler(100, rank=1, world_size=2, seed=1).state_dict())
    with pytest.raises(HpctError, match="outside"):
        s.load_state_dict({**s.state_dict(), "offset": 51})


def test_a_spare_sampler_without_a_rank_takes_over_a_shard_from_its_position():
    from hpct_slurm.cache import ResumableSampler

    original = ResumableSampler(103, rank=2, world_size=4, seed=5)
    it = iter(original)
    taken = [next(it) for _ in range(7)]
    spare = ResumableSampler(103, rank=None, world_size=1, seed=5)  # built before its rank
    with pytest.raises(HpctError, match="no rank yet"):
        list(spare)
    spare.load_state_dict(original.state_dict())
    assert (spare.rank, spare.world_size) == (2, 4)
    rest = list(spare)
    assert taken + rest == list(ResumableSampler(103, rank=2, world_size=4, seed=5))
