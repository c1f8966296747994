"""Striped multi-source pulls (recovery/striped.py) over real loopback TCP: every source
serves a share, a source that serves a bad stripe or dies mid-transfer is dropped with an event
and its stripes come from the others, and serving costs no hashing once a snapshot is sealed."""
from __future__ import annotations

import io
import json
import socket

import pytest
import torch

from hpct_slurm import protocol as P
from hpct_slurm.errors import HpctError
from hpct_slurm.events import Ev, EventLog
from hpct_slurm.recovery import striped
from hpct_slurm.recovery.snapshot import SnapshotStore
from hpct_slurm.recovery.copies import as_flat_u8
from hpct_slurm.recovery.state import TrainState
from hpct_slurm.recovery.striped import Prefetch, fetch_striped
from hpct_slurm.recovery.transfer import TransferServer

SECRET = b"s" * 32
JOB = "77"
STEP = 5


class Events:
    def __init__(self) -> None:
        self.stream = io.StringIO()
        self.log = EventLog(stream=self.stream)

    def named(self, name: str) -> list[dict]:
        return [e for e in map(json.loads, self.stream.getvalue().splitlines())
                if e["event"] == name]


def _state(nbytes: int = 9 * P.CHUNK + 12345) -> TrainState:
    """`nbytes`-ish random state (not a whole number of leaves)."""
    state = TrainState()
    g = torch.Generator().manual_seed(0)
    state.extras["w"] = torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=g)
    return state


def _store(nbytes: int = 9 * P.CHUNK + 12345,
           state: TrainState | None = None) -> tuple[SnapshotStore, bytes]:
    """A snapshot of `state`, sealed as the background sealer does; its bytes."""
    store = SnapshotStore(state or _state(nbytes), scopes=("rank",))
    snap = store.commit(STEP)
    assert snap.seal_in_background()
    return store, bytes(snap.data)


def _sources(servers: list[TransferServer]) -> list[tuple[int, tuple[str, int]]]:
    return [(s.rank, s.address) for s in servers]


def _got(res, want: bytes) -> bytes:
    return bytes(as_flat_u8(res.data)[:len(want)].numpy())


def test_every_source_serves_a_share_and_the_bytes_are_exact():
    store, want = _store()
    ev = Events()
    servers = [TransferServer(SECRET, JOB, r, own=store) for r in range(3)]
    try:
        res = fetch_striped(_sources(servers), 3, SECRET, JOB, STEP, events=ev.log,
                            stripe=P.CHUNK)
    finally:
        for s in servers:
            s.close()
    assert _got(res, want) == want and res.step == STEP
    assert len(res.per_source) >= 2, res.per_source
    assert sum(res.per_source.values()) == len(want)
    (done,) = ev.named(Ev.TRANSFER_STRIPED)
    assert done["dropped"] == 0 and done["nbytes"] == len(want)


def test_a_source_serving_rotten_memory_is_dropped_and_its_stripes_come_from_the_others():
    state = _state()
    store, want = _store(state=state)
    rotten, same = _store(state=state)  # the same state in another process's memory
    assert same == want
    ev = Events()
    servers = [TransferServer(SECRET, JOB, r, own=store) for r in range(2)]
    with rotten.lease(STEP) as snap:  # sealed, then rotted in every leaf, as failing RAM
        for off in range(0, len(snap.data), P.CHUNK):
            snap.data[off + 3] ^= 0x40
    bad = TransferServer(SECRET, JOB, 2, own=rotten)
    try:
        # the rotten source first: it also serves the manifest, sealed before the rot
        res = fetch_striped([(2, bad.address)] + _sources(servers), 3, SECRET, JOB, STEP,
                            events=ev.log, stripe=P.CHUNK)
    finally:
        for s in [*servers, bad]:
            s.close()
    assert _got(res, want) == want
    dropped = ev.named(Ev.TRANSFER_SOURCE_DROPPED)
    assert [d["source"] for d in dropped] == [f"{bad.address[0]}:{bad.address[1]}"]
    assert "digest" in dropped[0]["error"]
    assert f"{bad.address[0]}:{bad.address[1]}" not in res.per_source or \
        res.per_source[f"{bad.address[0]}:{bad.address[1]}"] < len(want)


def test_a_source_that_dies_mid_transfer_is_dropped(monkeypatch):
    store, want = _store()
    ev = Events()
    servers = [TransferServer(SECRET, JOB, r, own=store) for r in range(2)]
    dying = servers[0]
    served = []
    real = striped.serve_part

    def serve_then_die(sock: socket.socket, chan, rank, snap, msg, timeout):
        if rank == dying.rank and msg.part == "range":
            served.append(msg.offset)
            if len(served) == 2:  # the process dies: the connection closes, stripe unsent
                sock.shutdown(socket.SHUT_RDWR)
                return
        real(sock, chan, rank, snap, msg, timeout)

    monkeypatch.setattr("hpct_slurm.recovery.transfer.serve_part", serve_then_die)
    try:
        res = fetch_striped(_sources(servers), 3, SECRET, JOB, STEP, events=ev.log,
                            stripe=P.CHUNK)
    finally:
        for s in servers:
            s.close()
    assert _got(res, want) == want
    assert len(served) == 2
    (d,) = ev.named(Ev.TRANSFER_SOURCE_DROPPED)
    assert d["source"] == f"{dying.address[0]}:{dying.address[1]}"


def test_no_source_left_is_an_error_naming_each():
    store, _ = _store(P.CHUNK * 2)
    dead = socket.create_server(("127.0.0.1", 0))
    addr = dead.getsockname()[:2]
    dead.close()
    with TransferServer(SECRET, JOB, 0) as empty:  # holds nothing
        with pytest.raises(HpctError) as err:
            fetch_striped([(0, addr), (0, empty.address)], 1, SECRET, JOB, STEP, timeout=5)
    assert f"{addr[0]}:{addr[1]}" in err.value.message
    assert "no snapshot" in err.value.message
    # a Prefetch reports the same as None (the caller then falls back) and an event
    ev = Events()
    assert Prefetch([(0, addr)], 1, SECRET, JOB, STEP, events=ev.log, timeout=5).result() is None
    assert ev.named(Ev.TRANSFER_SOURCE_FAILED)


def test_serving_a_sealed_snapshot_hashes_nothing(monkeypatch):
    store, want = _store()
    with TransferServer(SECRET, JOB, 0, own=store) as a, \
            TransferServer(SECRET, JOB, 1, own=store) as b:
        def no_hashing(*_a, **_k):
            raise AssertionError("the source hashed its snapshot again")
        # the receiver hashes each stripe on arrival (PartHasher); the sources must not
        monkeypatch.setattr(P, "leaf_digests", no_hashing)
        res = fetch_striped(_sources([a, b]), 3, SECRET, JOB, STEP)
    assert _got(res, want) == want


def test_a_source_not_sealed_serves_ranges_under_the_manifests_digest(monkeypatch):
    state = _state()
    sealed, want = _store(state=state)
    unsealed = SnapshotStore(state, scopes=("rank",))
    snap = unsealed.commit(STEP)  # captured at the fault, not hashed yet
    rotten = SnapshotStore(state, scopes=("rank",))
    bad = rotten.commit(STEP)  # not hashed either, and its memory rotted in every leaf
    for off in range(0, len(bad.data), P.CHUNK):
        bad.data[off + 7] ^= 0x01
    ev = Events()
    with TransferServer(SECRET, JOB, 0, own=sealed) as a, \
            TransferServer(SECRET, JOB, 1, own=unsealed) as b, \
            TransferServer(SECRET, JOB, 2, own=rotten) as c:
        def no_hashing(*_a, **_k):
            raise AssertionError("a source hashed its snapshot")
        monkeypatch.setattr(P, "leaf_digests", no_hashing)
        res = fetch_striped(_sources([a, b, c]), 3, SECRET, JOB, STEP, events=ev.log,
                            stripe=P.CHUNK)
    assert _got(res, want) == want
    assert not snap.has_leaves
    assert f"{b.address[0]}:{b.address[1]}" in res.per_source
    # the rotten copy is caught by the receiver's hashing at its first stripe
    (d,) = ev.named(Ev.TRANSFER_SOURCE_DROPPED)
    assert d["source"] == f"{c.address[0]}:{c.address[1]}" and "digest" in d["error"]


def test_range_digests_are_exact_and_ranges_must_be_leaf_aligned():
    data = bytes(range(256)) * (3 * P.CHUNK // 256) + b"tail"
    leaves = P.leaf_digests(data)
    assert P.range_digest(leaves, len(data), 0, len(data)) == P.part_digest(data)
    assert P.range_digest(leaves, len(data), P.CHUNK, len(data) - P.CHUNK) == \
        P.part_digest(data[P.CHUNK:])
    with pytest.raises(ValueError, match="leaf-aligned"):
        P.range_digest(leaves, len(data), 100, P.CHUNK)
    with pytest.raises(HpctError, match="multiple"):
        striped.Manifest(0, None, len(data), leaves, "x").stripes(P.CHUNK + 1)  # type: ignore[arg-type]


def test_a_pulled_buffer_adopted_as_a_snapshot_is_sealed_exactly_and_serves_unhashed(
        monkeypatch):
    """The newcomer keeps what it pulled as its own snapshot (SnapshotStore.adopt): no copy, and
    the digest it seals from the manifest's leaves is the one hashing the bytes gives."""
    store, want = _store()
    with TransferServer(SECRET, JOB, 0, own=store) as a:
        res = fetch_striped(_sources([a]), 3, SECRET, JOB, STEP)
    mine = SnapshotStore(_state(), scopes=("rank",))
    snap = mine.adopt(STEP, res.layout, res.data, res.leaves)
    assert mine.slots.steps() == [STEP] and bytes(snap.data) == want
    assert snap.sealed and snap.digest() == P.part_digest(want) and snap.verify()
    with TransferServer(SECRET, JOB, 3, own=mine) as served:
        monkeypatch.setattr(P, "leaf_digests", lambda *_a, **_k: pytest.fail("hashed again"))
        again = fetch_striped(_sources([served]), 4, SECRET, JOB, STEP)
    assert _got(again, want) == want
