"""RootlessStore against torch's own stores: HashStore as the oracle, TCPStore for a few cases."""
from __future__ import annotations

import datetime
import hashlib
import hmac
import os
import re
import socket
import struct
import threading

import pytest
import torch.distributed as dist
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from hpct_slurm.errors import HpctError
from hpct_slurm.events import EventLog, read_events
from hpct_slurm.rendezvous.store import (EVENT_AUTH_REJECTED, RootlessStore, ShardServer,
                                         load_secret, shard_of, write_secret)

SECRET = b"0123456789abcdef0123456789abcdef"
SHORT = datetime.timedelta(milliseconds=5)


def _servers(n: int, events: EventLog | None = None) -> list[ShardServer]:
    return [ShardServer("127.0.0.1", 0, SECRET, events=events or EventLog()) for _ in range(n)]


@pytest.fixture
def shards():
    servers = _servers(3)
    store = RootlessStore([s.address for s in servers], SECRET, datetime.timedelta(seconds=5))
    yield servers, store
    store.close()
    for s in servers:
        s.stop()


KEYS = st.sampled_from(["a", "b", "c", "gen0/x", "gen1/x", "0//cpu//0/0", "ü-key", ""])
INT_VALUE = re.compile(rb"-?[0-9]{1,9}")
VALUES = st.one_of(
    st.binary(max_size=24),
    st.integers(-10**6, 10**6).map(lambda i: str(i).encode()),
    st.text("xyz", max_size=5).map(str.encode),
)


class StoreVsHashStore(RuleBasedStateMachine):
    """Every operation gloo/NCCL init uses, on 3 shards, must match HashStore exactly."""

    def __init__(self) -> None:
        super().__init__()
        self.servers = _servers(3)
        self.store = RootlessStore([s.address for s in self.servers], SECRET,
                                   datetime.timedelta(seconds=5))
        self.oracle = dist.HashStore()

    def teardown(self) -> None:
        self.store.close()
        for s in self.servers:
            s.stop()

    def present(self, key: str) -> bool:
        return self.oracle.check([key])

    @rule(key=KEYS, value=VALUES)
    def set(self, key: str, value: bytes) -> None:
        self.store.set(key, value)
        self.oracle.set(key, value)

    @rule(key=KEYS)
    def get(self, key: str) -> None:
        if self.present(key):
            assert self.store.get(key) == self.oracle.get(key)
        else:
            self.store.set_timeout(SHORT)
            self.oracle.set_timeout(SHORT)
            with pytest.raises(dist.DistStoreError, match=re.escape(f"'{key}'")):
                self.store.get(key)
            with pytest.raises(dist.DistStoreError):
                self.oracle.get(key)
            self.store.set_timeout(datetime.timedelta(seconds=5))

    @rule(key=KEYS, delta=st.integers(-1000, 1000))
    def add(self, key: str, delta: int) -> None:
        current = self.oracle.get(key) if self.present(key) else None
        if current is None or INT_VALUE.fullmatch(current):
            assert self.store.add(key, delta) == self.oracle.add(key, delta)
        elif re.fullmatch(rb"[a-z]+", current):
            with pytest.raises(ValueError):
                self.store.add(key, delta)
            with pytest.raises(ValueError):
                self.oracle.add(key, delta)
        # Other bytes: HashStore's stoll takes a numeric prefix ("12ab" -> 12), we refuse;
        # gloo/NCCL never add to such keys, so neither answer is pinned here.

    @rule(key=KEYS, expected=st.one_of(st.just(b""), VALUES), desired=VALUES,
          use_current=st.booleans())
    def compare_set(self, key: str, expected: bytes, desired: bytes, use_current: bool) -> None:
        if use_current and self.present(key):
            expected = self.oracle.get(key)
        assert (self.store.compare_set(key, expected, desired)
                == self.oracle.compare_set(key, expected, desired))

    @rule(keys=st.lists(KEYS, max_size=4))
    def check(self, keys: list[str]) -> None:
        assert self.store.check(keys) == self.oracle.check(keys)

    @rule(keys=st.lists(KEYS, max_size=5))
    def multi_get(self, keys: list[str]) -> None:
        # Keys on several shards, one request to each at once: same values in the same order.
        if all(self.present(k) for k in keys):
            assert self.store.multi_get(keys) == self.oracle.multi_get(keys)
        else:
            missing = "|".join(re.escape(f"'{k}'") for k in keys if not self.present(k))
            self.store.set_timeout(SHORT)
            with pytest.raises(dist.DistStoreError, match=f"key ({missing}) did not appear"):
                self.store.multi_get(keys)
            self.store.set_timeout(datetime.timedelta(seconds=5))

    @precondition(lambda self: self.oracle.num_keys() > 0)
    @rule(key=KEYS)
    def wait_present(self, key: str) -> None:
        if self.present(key):
            self.store.wait([key], SHORT)

    @rule(key=KEYS)
    def delete_key(self, key: str) -> None:
        assert self.store.delete_key(key) == self.oracle.delete_key(key)

    @invariant()
    def same_num_keys(self) -> None:
        assert self.store.num_keys() == self.oracle.num_keys()


StoreVsHashStore.TestCase.settings = settings(
    max_examples=60, stateful_step_count=30, deadline=None,
    suppress_health_check=[HealthCheck.too_slow])
TestStoreVsHashStore = StoreVsHashStore.TestCase


def test_keys_spread_over_all_shards(shards):
    servers, store = shards
    for i in range(300):
        store.set(f"hpct/gen0/key{i}", b"v")
    counts = [s.stats().keys for s in servers]
    assert sum(counts) == 300 and min(counts) > 50, counts
    assert shard_of("hpct/gen0/key7", 3) == shard_of(b"hpct/gen0/key7", 3)


# The per-rank keys a formation writes: gloo's full mesh sets `<group>//cpu//<device>/<rank>`
# under our generation prefix (seen with a counting Store wrapper around init_process_group).
RANK_KEY_PREFIXES = st.one_of(
    st.builds(lambda gen, group, dev: f"hpct/gen{gen}/{group}//cpu//{dev}/",
              st.integers(0, 10**6), st.integers(0, 50), st.integers(0, 3)),
    st.text(min_size=0, max_size=20).map(lambda t: t + "/"))


@given(shards=st.integers(1, 256), extra=st.integers(0, 7 * 256), prefix=RANK_KEY_PREFIXES)
@settings(max_examples=300, deadline=None)
def test_rank_keys_spread_evenly(shards, extra, prefix):
    """N ranks each writing its own rank key, one shard per node (so at least as many ranks
    as shards, up to 8 a node, not necessarily a multiple): the busiest shard holds at most
    twice the average (a plain crc32 gave 3x at 64)."""
    ranks = shards + extra % (7 * shards + 1)
    counts = [0] * shards
    for rank in range(ranks):
        counts[shard_of(f"{prefix}{rank}", shards)] += 1
    assert max(counts) / (ranks / shards) <= 2, counts
    assert shard_of(f"{prefix}{ranks - 1}", shards) == shard_of(
        f"{prefix}{ranks - 1}".encode(), shards)


def test_rank_keys_one_per_shard_and_stable():
    keys = [f"hpct/gen3/0//cpu//0/{r}" for r in range(64)]
    assert sorted(shard_of(k, 64) for k in keys) == list(range(64))
    first = shard_of(keys[0], 64)
    assert [shard_of(k, 64) for k in keys] == [(first + r) % 64 for r in range(64)]
    # Pinned values: every process of a generation must agree on the map (no hash()).
    assert shard_of("hpct/gen3/0//cpu//0/5", 7) == 1
    assert shard_of("hpct/gen0/key7", 3) == 0  # no rank component: crc32 of the whole key


def test_rank_keys_spread_over_live_shards():
    """The same through real servers: 16 ranks (2 per node) on 8 shards, 2 keys on each."""
    servers = _servers(8)
    store = RootlessStore([s.address for s in servers], SECRET, datetime.timedelta(seconds=5))
    try:
        for rank in range(16):
            store.set(f"hpct/gen0/0//cpu//0/{rank}", b"addr")
        assert [s.stats().keys for s in servers] == [2] * 8
    finally:
        store.close()
        for s in servers:
            s.stop()


def test_get_blocks_until_another_client_sets(shards):
    _, store = shards
    other = store.clone()
    timer = threading.Timer(0.2, other.set, args=("late", b"value"))
    timer.start()
    assert store.get("late") == b"value"
    store.wait(["late"], SHORT)
    timer.join()
    other.close()


@pytest.mark.parametrize("via_clone", [False, True])
def test_abort_ends_a_blocked_get_at_once(shards, via_clone):
    """A STOP while the group forms: the rank's pending store requests (its clones' too: gloo
    clones the store) end with DistStoreError instead of waiting out the init timeout."""
    _, store = shards
    blocked = store.clone() if via_clone else store
    errors: list[BaseException] = []

    def get() -> None:
        try:
            blocked.get("never-set")
        except BaseException as exc:  # reported below
            errors.append(exc)
    t = threading.Thread(target=get, daemon=True)
    t.start()
    t.join(0.3)
    assert t.is_alive()  # parked on the shard: the key does not exist
    store.abort()
    t.join(2)
    assert not t.is_alive()
    assert isinstance(errors[0], dist.DistStoreError) and "aborted" in str(errors[0])
    with pytest.raises(dist.DistStoreError, match="aborted"):
        store.clone().set("after", b"1")  # later clones and requests fail at once too


def test_set_then_multi_get_publishes_before_it_waits(shards):
    """Two ranks each publish their key and read both in one round trip: each one's set is
    served before the multi_get that waits for it, so neither waits for itself."""
    _, store = shards
    other = store.clone()
    keys = ["g/0", "g/1", "g/2"]
    store.set("g/2", b"c")
    out: list[list[bytes]] = []
    t = threading.Thread(target=lambda: out.append(other.set_then_multi_get("g/1", b"b", keys)))
    t.start()
    assert store.set_then_multi_get("g/0", b"a", keys) == [b"a", b"b", b"c"]
    t.join(5)
    assert out == [[b"a", b"b", b"c"]]
    assert store.multi_get([]) == []
    other.close()


def test_wait_timeout_names_the_missing_key(shards):
    _, store = shards
    store.set("here", b"1")
    with pytest.raises(dist.DistStoreError, match="'not-here'"):
        store.wait(["here", "not-here"], SHORT)


@pytest.mark.parametrize("kind", ["rootless", "tcpstore"])
def test_compare_set_and_num_keys_against_tcpstore(shards, kind):
    """The same script gives the same answers on TCPStore (without wait_for_workers, which
    would add a key of its own)."""
    _, store = shards
    if kind == "tcpstore":
        store = dist.TCPStore("127.0.0.1", 0, 1, True, datetime.timedelta(seconds=5),
                              wait_for_workers=False)
    assert store.compare_set("k", "x", "y") == b"x"  # missing, expected set: not created
    assert not store.check(["k"])
    assert store.compare_set("k", "", "first") == b"first"  # missing, expected empty: created
    assert store.compare_set("k", "", "second") == b"first"  # present, mismatch
    assert store.compare_set("k", "first", "third") == b"third"
    assert store.add("n", 3) == 3 and store.add("n", -5) == -2
    assert store.get("n") == b"-2"
    assert store.num_keys() == 2
    assert store.delete_key("k") and not store.delete_key("k")
    assert store.num_keys() == 1


def test_wrong_secret_is_rejected_and_logged(tmp_path):
    log_path = tmp_path / "events.jsonl"
    servers = _servers(1, EventLog(log_path))
    try:
        intruder = RootlessStore([servers[0].address], b"x" * 32, SHORT)
        with pytest.raises(dist.DistNetworkError):
            intruder.set("k", b"v")
        good = RootlessStore([servers[0].address], SECRET, SHORT)
        assert not good.check(["k"])
        assert servers[0].stats().auth_rejected == 1
    finally:
        servers[0].stop()
    rejected = [e for e in read_events(log_path) if e["event"] == EVENT_AUTH_REJECTED]
    assert len(rejected) == 1 and rejected[0]["reason"] == "bad request tag"


def test_replayed_request_is_rejected(shards):
    """A request signed for one connection's nonce fails on another connection."""
    servers, store = shards
    host, port = servers[0].address

    def frame(nonce: bytes, payload: bytes) -> bytes:
        tag = hmac.new(SECRET, b"Q" + nonce + struct.pack("!Q", 0) + payload,
                       hashlib.sha256).digest()
        return struct.pack("!I", len(tag) + len(payload)) + tag + payload

    payload = bytes([1]) + struct.pack("!I", 1) + b"k" + struct.pack("!I", 1) + b"v"  # set k=v
    with socket.create_connection((host, port)) as a, socket.create_connection((host, port)) as b:
        nonce_a = a.recv(16)
        b.recv(16)
        b.sendall(frame(nonce_a, payload))
        b.settimeout(5)
        assert b.recv(100) == b""  # the server hung up on the replay
        a.sendall(frame(nonce_a, payload))
        assert len(a.recv(100)) > 32  # the original, on its own connection, is answered
    assert servers[0].stats().auth_rejected == 1
    assert store.check(["k"]) == (shard_of("k", 3) == 0)


def test_shard_port_in_use_is_a_clear_error(shards):
    servers, _ = shards
    host, port = servers[0].address
    with pytest.raises(HpctError, match=f"cannot listen on {host}:{port}"):
        ShardServer(host, port, SECRET)


def test_load_secret(tmp_path, monkeypatch):
    path = tmp_path / "secret"
    data = write_secret(path)
    assert load_secret(path) == data
    monkeypatch.setenv("HPCT_SECRET_FILE", str(path))
    assert load_secret() == data
    os.chmod(path, 0o644)
    with pytest.raises(HpctError, match="chmod 600"):
        load_secret(path)
    monkeypatch.delenv("HPCT_SECRET_FILE")
    with pytest.raises(HpctError, match="HPCT_SECRET_FILE is not set"):
        load_secret()
    short = tmp_path / "short"
    short.write_bytes(b"abc")
    os.chmod(short, 0o600)
    with pytest.raises(HpctError, match="does not hold a hex secret"):
        load_secret(short)


def test_client_waits_for_a_shard_that_starts_late():
    """Ranks may start before their node's shard server: connects retry until it is up."""
    probe = socket.socket()
    probe.bind(("127.0.0.1", 0))
    port = probe.getsockname()[1]
    probe.close()
    with pytest.raises(ConnectionRefusedError):
        socket.create_connection(("127.0.0.1", port)).close()
    store = RootlessStore([("127.0.0.1", port)], SECRET, datetime.timedelta(seconds=10))
    started: list[ShardServer] = []
    timer = threading.Timer(0.3, lambda: started.append(
        ShardServer("127.0.0.1", port, SECRET, events=EventLog())))
    timer.start()
    try:
        store.set("k", b"v")
        assert store.get("k") == b"v"
        timer.join()  # the server answers before the timer's thread has appended it
        assert started[0].stats().connections == 1
    finally:
        timer.join()
        store.close()
        for s in started:
            s.stop()


def test_gather_survives_a_shard_that_starts_after_the_strangers_timeout(monkeypatch):
    """A multi_get opens every shard's connection before it sends: while one node's shard is
    still down, the others' silent connections must not go stale (a shard drops a stranger
    after PREAUTH_TIMEOUT_S) and fail the whole formation."""
    from hpct_slurm.rendezvous import shard_server, store_client

    for side in (shard_server, store_client):  # each side reads the limit it keeps
        monkeypatch.setattr(side, "PREAUTH_TIMEOUT_S", 0.4)
    early = ShardServer("127.0.0.1", 0, SECRET, events=EventLog())
    probe = socket.socket()
    probe.bind(("127.0.0.1", 0))
    late_port = probe.getsockname()[1]
    probe.close()
    endpoints = [early.address, ("127.0.0.1", late_port)]
    keys = ["g/0", "g/1"]
    assert {shard_of(k, 2) for k in keys} == {0, 1}
    started: list[ShardServer] = []
    timer = threading.Timer(1.2, lambda: started.append(
        ShardServer("127.0.0.1", late_port, SECRET, events=EventLog())))
    store = RootlessStore(endpoints, SECRET, datetime.timedelta(seconds=10))
    timer.start()
    try:
        late_key = next(k for k in keys if shard_of(k, 2) == 1)
        early_key = next(k for k in keys if shard_of(k, 2) == 0)
        # the key on the late shard is set through a connection of its own once it is up
        def set_late() -> None:
            other = RootlessStore(endpoints, SECRET, datetime.timedelta(seconds=10))
            other.set(late_key, b"late")
            other.close()

        setter = threading.Timer(1.5, set_late)
        setter.start()
        got = store.set_then_multi_get(early_key, b"early", keys)
        setter.join()
        assert dict(zip(keys, got)) == {early_key: b"early", late_key: b"late"}
    finally:
        timer.join()
        store.close()
        early.stop()
        for s in started:
            s.stop()


def test_a_shard_that_dies_fails_requests_at_once():
    """Once reached, a shard that goes away is a dead node: no retrying until the timeout
    (survivors must get to re-form), even with no timeout at all."""
    server = ShardServer("127.0.0.1", 0, SECRET, events=EventLog())
    store = RootlessStore([server.address], SECRET, datetime.timedelta(0))
    store.set("k", b"v")
    server.stop()
    errors: list[BaseException] = []

    def two_requests() -> None:
        for _ in range(2):  # the first finds the old connection closed, the second is refused
            try:
                store.set("k", b"w")
            except dist.DistNetworkError as exc:
                errors.append(exc)

    worker = threading.Thread(target=two_requests, daemon=True)
    worker.start()
    worker.join(timeout=20)
    assert not worker.is_alive() and len(errors) == 2, errors
