"""Peer transfer, replica pushes, torn/corrupt copies and the disk fallback, over real loopback TCP."""
from __future__ import annotations

import io
import json
import socket
import time
from dataclasses import replace

import pytest
import torch

from hpct_slurm import protocol as P
from hpct_slurm.errors import HpctError
from hpct_slurm.events import EventLog
from hpct_slurm.recovery import persist
from hpct_slurm.recovery.persist import DiskPersister, list_steps, load_latest, rank_dir
from hpct_slurm.recovery.replicas import ReplicaStore
from hpct_slurm.recovery.snapshot import SnapshotStore
from hpct_slurm.recovery.encoding import Layout
from hpct_slurm.recovery.state import TrainState
from hpct_slurm.recovery.transfer import (EV_FALLBACK_DISK, EV_SOURCE_FAILED, LATEST, ReplicaPusher,
                                          TransferServer, fetch_state)

SECRET = b"s" * 32
JOB = "77"


class Events:
    def __init__(self) -> None:
        self.stream = io.StringIO()
        self.log = EventLog(stream=self.stream)

    def named(self, name: str) -> list[dict]:
        return [e for e in map(json.loads, self.stream.getvalue().splitlines()) if e["event"] == name]


def wait_for(events: Events, name: str, within_s: float = 10.0) -> list[dict]:
    """The records named `name` once there are any (a server's thread writes them)."""
    deadline = time.monotonic() + within_s
    while not events.named(name) and time.monotonic() < deadline:
        time.sleep(0.01)
    return events.named(name)


def trained_state(seed: int = 0, steps: int = 2):
    torch.manual_seed(seed)
    model = torch.nn.Linear(64, 64)
    opt = torch.optim.Adam(model.parameters())
    state = TrainState(model=model, optimizer=opt)

    def step() -> None:
        opt.zero_grad()
        model(torch.randn(4, 64)).sum().backward()
        opt.step()

    for _ in range(steps):
        step()
    return model, state, step


@pytest.fixture
def events() -> Events:
    return Events()


def test_replacement_restores_from_a_replica_bit_identically(events):
    model, state, step = trained_state()
    store = SnapshotStore(state)
    replicas = ReplicaStore()
    with TransferServer(SECRET, JOB, 1, replicas=replicas, events=events.log) as holder:
        pusher = ReplicaPusher(store, 0, holder.address, SECRET, JOB, events=events.log)
        for s in (3, 4):
            step()
            store.commit(s)
            pusher.after_commit(s)
        pusher.close()
        assert pusher.acked_step == 4 and replicas.latest(0).step == 4
        want = [p.detach().clone() for p in model.parameters()]

        into = torch.empty(store.latest().layout.nbytes, dtype=torch.uint8)
        got = fetch_state([holder.address], 0, SECRET, JOB, step=4, into=into, events=events.log)
    assert got.step == 4 and got.data is into
    model2, state2, _ = trained_state(seed=5, steps=1)
    state2.restore_from(got.layout, got.data)
    assert all(torch.equal(a, b) for a, b in zip(want, model2.parameters()))
    assert len(events.named("replica.stored")) == 2 and len(events.named("transfer.fetched")) == 1


@pytest.mark.parametrize("verify_on_serve", [True, False])
def test_corrupted_replica_is_detected_and_the_next_source_used(events, verify_on_serve):
    _, state, _ = trained_state()
    own = SnapshotStore(state)
    snap = own.commit(2)
    replicas = ReplicaStore()
    idx, buf = replicas.begin(0, snap.layout.nbytes)
    buf.numpy()[:snap.layout.nbytes] = memoryview(snap.data)
    replicas.finish(0, idx, buf, 2, snap.layout, snap.digest())
    replicas.latest(0).data[snap.layout.nbytes // 2] ^= 0x10  # a bit flips in the holder's memory

    with TransferServer(SECRET, JOB, 1, replicas=replicas, events=events.log,
                        verify_on_serve=verify_on_serve) as bad, \
            TransferServer(SECRET, JOB, 0, own=own, events=events.log) as good:
        got = fetch_state([bad.address, good.address], 0, SECRET, JOB, step=2, events=events.log)
    assert got.source == f"{good.address[0]}:{good.address[1]}"
    assert bytes(got.data.numpy()) == bytes(snap.data)
    failed = events.named(EV_SOURCE_FAILED)
    assert len(failed) == 1 and failed[0]["source"] == f"{bad.address[0]}:{bad.address[1]}"
    if verify_on_serve:
        # the bad server's connection thread closes the stream, then discards the copy, then
        # records it: the fetch from the good source may be done before that thread is
        assert wait_for(events, "transfer.serve_corrupt")[0]["rank"] == 0
        assert replicas.latest(0) is None  # the corrupt copy is never offered again
    else:
        assert "digest mismatch" in failed[0]["error"]


def test_no_source_left_falls_back_to_disk_and_says_so(tmp_path, events):
    model, state, step = trained_state()
    store = SnapshotStore(state)
    persister = DiskPersister(store, tmp_path, rank=0, every=2, events=events.log, key=SECRET)
    for s in range(1, 6):
        step()
        store.commit(s)
        persister.after_commit(s)
        persister.flush()
    persister.close()
    assert list_steps(tmp_path, 0) == [2, 4]  # every 2nd step, last 2 kept

    dead = socket.create_server(("127.0.0.1", 0))
    dead_addr = dead.getsockname()[:2]
    dead.close()  # nothing listens here any more
    with TransferServer(b"w" * 32, JOB, 9, replicas=ReplicaStore()) as wrong_secret:
        got = fetch_state([dead_addr, wrong_secret.address], 0, SECRET, JOB, step=5,
                          disk_dir=str(tmp_path), events=events.log, timeout=5)
    assert got.step == 4 and got.source == f"disk:{tmp_path}"
    assert len(events.named(EV_SOURCE_FAILED)) == 2
    (fb,) = events.named(EV_FALLBACK_DISK)
    assert fb["rank"] == 0 and fb["disk_step"] == 4 and fb["step"] == 5

    with pytest.raises(HpctError, match="no good copy of rank 0's state at step 5: tried 127.0.0.1"):
        fetch_state([dead_addr], 0, SECRET, JOB, step=5, timeout=5)


def test_disk_falls_back_to_the_previous_file_when_the_newest_is_corrupt(tmp_path, events):
    _, state, step = trained_state()
    store = SnapshotStore(state)
    persister = DiskPersister(store, tmp_path, rank=3, every=1, key=SECRET)
    for s in (1, 2):
        step()
        store.commit(s)
        persister.after_commit(s)
        persister.flush()
    persister.close()
    newest = rank_dir(tmp_path, 3) / "step2.bin"
    raw = bytearray(newest.read_bytes())
    raw[-10] ^= 0xFF
    newest.write_bytes(raw)
    step_, layout, data = load_latest(tmp_path, 3, events=events.log, key=SECRET)
    assert step_ == 1 and isinstance(layout, Layout) and len(data) == layout.nbytes
    assert events.named("persist.corrupt")[0]["step"] == 2
    (rank_dir(tmp_path, 3) / "step1.bin").write_bytes(b"\0\0")
    with pytest.raises(HpctError, match="no intact snapshot of rank 3"):
        load_latest(tmp_path, 3, key=SECRET)


def _push_raw(addr, msg: P.StateBlob, parts: list[bytes], digests: list[bytes],
              cut: int | None) -> P.Envelope | None:
    """Push a replica by hand; with `cut`, close after `cut` body bytes (a torn transfer)."""
    body = b"".join(parts)
    with socket.create_connection(addr, timeout=5) as sock:
        chan = P.client_hello(sock, SECRET, JOB, timeout=5)
        writer = chan.writer(sock, msg, [len(p) for p in parts], digests, timeout=5)
        if cut is not None:
            writer.write(body[:cut])
            return None
        writer.write(body)
        writer.finish()
        return chan.recv(sock, timeout=5)


def test_torn_or_bad_pushes_leave_the_previous_replica_intact(events):
    _, state, step = trained_state()
    store = SnapshotStore(state)
    good = store.commit(1)
    replicas = ReplicaStore()
    with TransferServer(SECRET, JOB, 1, replicas=replicas, events=events.log) as holder:
        pusher = ReplicaPusher(store, 0, holder.address, SECRET, JOB)
        pusher.after_commit(1)
        pusher.close()
        step()
        newer = store.commit(2)
        layout_json = newer.layout.to_json()
        parts = [layout_json, bytes(newer.data)]
        digests = [P.part_digest(layout_json), newer.digest()]
        blob = P.StateBlob(0, 2, newer.layout.nbytes, len(layout_json))
        size = len(layout_json) + newer.layout.nbytes

        _push_raw(holder.address, blob, parts, digests, cut=size // 2)  # sender dies mid-body

        def assert_kept() -> bool:
            kept = replicas.latest(0)
            return kept.step == 1 and kept.verify() and bytes(kept.data) == bytes(good.data)

        assert assert_kept()
        rotten = bytearray(parts[1])
        rotten[5] ^= 0x40  # the sender's memory changed after its digest was sealed
        refused = _push_raw(holder.address, blob, [layout_json, bytes(rotten)], digests, cut=None)
        assert isinstance(refused.msg, P.Ack) and not refused.msg.ok
        assert "kept the previous replica" in refused.msg.detail
        assert assert_kept()
        ok = _push_raw(holder.address, blob, parts, digests, cut=None)
    assert isinstance(ok.msg, P.Ack) and ok.msg.ok
    assert replicas.latest(0).step == 2
    assert len(events.named("replica.rejected")) >= 2


def test_fetch_of_a_missing_step_or_rank_names_what_the_server_has(events):
    _, state, _ = trained_state()
    store = SnapshotStore(state)
    store.commit(1)
    with TransferServer(SECRET, JOB, 0, own=store) as srv:
        with pytest.raises(HpctError, match="has no snapshot of rank 0 at step 9"):
            fetch_state([srv.address], 0, SECRET, JOB, step=9, events=events.log)
        with pytest.raises(HpctError, match="has no snapshot of rank 5"):
            fetch_state([srv.address], 5, SECRET, JOB, step=LATEST)
        assert fetch_state([srv.address], 0, SECRET, JOB).step == 1


def test_a_rank_serves_its_own_per_rank_state_only_when_asked_for_it(events):
    """A rank leaving in a planned move serves its per-rank state (slot "rank") to the rank
    taking its place; "own" and "any" still give the shared snapshot."""
    _, state, _ = trained_state()
    state.extras["position"] = [7, 8]
    shared, mine = SnapshotStore(state, scopes=("shared",)), SnapshotStore(state, scopes=("rank",))
    shared.commit(3)
    mine.commit(3)
    with TransferServer(SECRET, JOB, 2, own=shared, rank_own=mine) as srv:
        got = fetch_state([srv.address], 2, SECRET, JOB, step=3, slot="rank")
        assert got.layout == mine.latest().layout
        assert bytes(got.data[:got.layout.nbytes]) == bytes(mine.latest().data[:got.layout.nbytes])
        assert fetch_state([srv.address], 2, SECRET, JOB, step=3).layout == shared.latest().layout
        with pytest.raises(HpctError, match="has no snapshot of rank 1"):
            fetch_state([srv.address], 1, SECRET, JOB, step=3, slot="rank")
    with TransferServer(SECRET, JOB, 2, own=shared) as srv:  # no per-rank state: refused
        with pytest.raises(HpctError, match="has no snapshot of rank 2"):
            fetch_state([srv.address], 2, SECRET, JOB, step=3, slot="rank")


def _big_layout(nbytes: int) -> Layout:
    return Layout.from_json(json.dumps({"nbytes": nbytes, "tree": {}, "entries": [
        ["uint8", [nbytes], 0, nbytes, False]]}))


@pytest.mark.parametrize("nbytes", [3 * (1 << 20) + 100, (1 << 20) - 1, 8 << 20])
def test_a_large_snapshot_is_written_past_the_page_cache_and_reads_back_exactly(
        tmp_path, nbytes, monkeypatch):
    import fcntl
    import os

    from hpct_slurm.recovery import persist
    real, direct = fcntl.fcntl, []

    def watched(fd, cmd, arg=0):  # the real call, recorded
        out = real(fd, cmd, arg)
        if cmd == fcntl.F_SETFL and arg & os.O_DIRECT:
            direct.append(fd)
        return out

    monkeypatch.setattr(persist.fcntl, "fcntl", watched)
    data = memoryview(bytearray(torch.randint(0, 256, (nbytes,), dtype=torch.uint8).numpy()))
    path = persist.write_snapshot(tmp_path / "persist", 0, 5, _big_layout(nbytes), data,
                                  P.part_digest(data), key=b"k" * 32)
    step, layout, got, _ = persist.read_snapshot(path, 0, key=b"k" * 32)
    assert (step, layout.nbytes, bytes(got) == bytes(data)) == (5, nbytes, True)
    offset = path.stat().st_size - nbytes
    large = nbytes >= persist.DIRECT_MIN
    # large: O_DIRECT from a block boundary; small: through the cache, its header unpadded
    assert bool(direct) == large
    assert offset % persist.IO_BLOCK == 0 if large else offset < persist.IO_BLOCK


def test_a_save_hashes_and_writes_at_the_lowest_priority_from_its_own_aligned_copy(
        tmp_path, monkeypatch, events):
    """DiskPersister: the hash and the write on a thread of its own at nice 19 (the training
    thread's nice value untouched: Linux keeps one per thread), from the copy's page-aligned
    buffer with no bounce buffer; the snapshot sealed with the copy's digest, the file exact."""
    import os
    import threading

    from hpct_slurm.recovery import persist
    torch.manual_seed(0)
    model = torch.nn.Linear(512, 1024)  # 2 MB of weights: a file written past the page cache
    store = SnapshotStore(TrainState(model=model), ("shared",), rng=False)
    niceness: dict[str, int] = {}
    real_write, bounces = persist.write_snapshot, []

    def watched_write(*args, **kwargs):  # the real write, its thread's nice value recorded
        niceness[threading.current_thread().name] = os.getpriority(
            os.PRIO_PROCESS, threading.get_native_id())
        return real_write(*args, **kwargs)

    real_mmap = persist.mmap.mmap

    class WatchedMmap(real_mmap):  # every anonymous map made while writing: a bounce buffer
        def __new__(cls, *args, **kwargs):
            if threading.current_thread().name.startswith("hpct-persist-write"):
                bounces.append(args)
            return real_mmap.__new__(cls, *args, **kwargs)

    monkeypatch.setattr(persist, "write_snapshot", watched_write)
    monkeypatch.setattr(persist.mmap, "mmap", WatchedMmap)
    before = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
    persister = DiskPersister(store, tmp_path, rank=0, every=1, events=events.log, key=SECRET)
    snap = store.commit(1)
    assert not snap.sealed
    persister.after_commit(1)
    persister.flush()
    persister.close()
    assert niceness == {"hpct-persist-write-r0": min(19, before + persist.WRITE_NICE)}
    assert os.getpriority(os.PRIO_PROCESS, threading.get_native_id()) == before
    assert bounces == []
    assert snap.sealed and snap.verify()
    step, layout, data = load_latest(tmp_path, 0, key=SECRET)
    assert step == 1 and bytes(data) == bytes(snap.data)
    assert events.named("persist.saved")[0]["nbytes"] == layout.nbytes > persist.DIRECT_MIN


def test_a_file_system_refusing_o_direct_mocked_gets_a_buffered_write(tmp_path, monkeypatch):
    """(A mock: every file system here takes O_DIRECT.) The refusal costs nothing but the
    page cache: the same file, read back exactly."""
    import errno
    import fcntl
    import os

    from hpct_slurm.recovery import persist
    real = fcntl.fcntl
    refused = []

    def no_direct(fd, cmd, arg=0):
        if cmd == fcntl.F_SETFL and arg & os.O_DIRECT:
            refused.append(fd)
            raise OSError(errno.EINVAL, "Invalid argument")
        return real(fd, cmd, arg)

    monkeypatch.setattr(persist.fcntl, "fcntl", no_direct)
    nbytes = 2 * (1 << 20) + 7
    data = memoryview(bytearray(os.urandom(nbytes)))
    path = persist.write_snapshot(tmp_path / "persist", 0, 1, _big_layout(nbytes), data,
                                  P.part_digest(data), key=b"k" * 32)
    assert refused
    _, _, got, _ = persist.read_snapshot(path, 0, key=b"k" * 32)
    assert bytes(got) == bytes(data)


def test_disk_falls_back_when_the_newest_files_layout_is_malformed_under_a_valid_mac(
        tmp_path, events):
    """A file written with the job's secret whose layout holds JSON's Infinity (an offset) or
    a dtype that is no tensor dtype: refused as damaged (`persist.corrupt`, naming the field)
    and the older file loaded. Before, the Infinity's OverflowError came out of load_latest."""
    _, state, step = trained_state()
    store = SnapshotStore(state)
    good = store.commit(1)
    e = good.layout.entries[0]
    for name, bad in (("inf", replace(e, offset=float("inf"))), ("load", replace(e, dtype="load"))):
        root = tmp_path / name
        persist.write_snapshot(root, 3, 1, good.layout, good.data, good.digest(), key=SECRET)
        layout = replace(good.layout, entries=(bad, *good.layout.entries[1:]))
        persist.write_snapshot(root, 3, 2, layout, good.data, good.digest(), key=SECRET)
        step_, layout, data = load_latest(root, 3, events=events.log, key=SECRET)
        assert step_ == 1 and bytes(data) == bytes(good.data)
        corrupt = events.named("persist.corrupt")[-1]
        assert corrupt["step"] == 2 and "entries[0]." in corrupt["error"], corrupt
