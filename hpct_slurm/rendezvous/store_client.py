"""The rootless store as a rank uses it: `RootlessStore`, the torch.distributed Store over
every member node's shard (shard_server.py), one `_Shard` connection per shard, `_pipelined`
to ask many shards in one round trip, and `make_store`, which picks it or stock TCPStore for
a generation. What it sends and how it is authenticated is store_wire.py.

A rank builds one per generation and may block in it while its group forms, so every wait
here looks at an abort flag: a STOP from the controller ends a formation at once.
"""
from __future__ import annotations

import contextlib
import datetime
import hmac
import socket
import threading
import time
import typing
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING, Literal

import torch.distributed as dist

from ..errors import HpctError
from .fanout import FanoutTable
from .grid import Grid
from .shard_server import ShardStats
from .store_wire import (I64, MAX_FRAME, NONCE_BYTES, OP_ADD, OP_CAS, OP_CHECK, OP_DELETE,
                         OP_GET, OP_MULTI_GET, OP_NUM_KEYS, OP_SET, OP_STATS, OP_WAIT,
                         PREAUTH_MAX_FRAME, PREAUTH_TIMEOUT_S, ST_NOT_INT, ST_OK, ST_TIMEOUT,
                         TAG_BYTES, U32, U64, frame_tag, load_secret, pack_fields, recv_exact,
                         shard_of, unpack_fields)

if TYPE_CHECKING:
    from .derive import RendezvousInfo

ABORT_POLL_S = 0.2
# Retrying a refused connect (the shard's node has not started it yet): a refusal costs the
# shard's host nothing (the kernel answers it), while each pause is time the whole rendezvous
# may wait, since every rank needs every rank's key. A 0.5 s cap cost a 64-rank formation up
# to 0.3 s whenever one node started its shard late.
CONNECT_RETRY_FIRST_S = 0.002
CONNECT_RETRY_MAX_S = 0.05


def _ms(timeout: datetime.timedelta) -> int:
    return max(0, int(timeout.total_seconds() * 1000))


class _Shard:
    """One client connection to one shard; requests on it are serialized by a lock."""

    def __init__(self, host: str, port: int, secret: bytes,
                 aborted: threading.Event | None = None):
        self.host = host
        self.port = port
        self._secret = secret
        self._aborted = aborted or threading.Event()
        self._lock = threading.Lock()
        self._sock: socket.socket | None = None
        self._nonce = b""
        self._seq = 0  # of the next response to read
        self._inflight = 0  # requests sent whose responses are not read yet
        self._reached = False

    def close(self) -> None:
        with self._lock:
            if self._sock is not None:
                self._sock.close()
                self._sock = None

    def abort(self) -> None:
        """Wake a request blocked on this shard (another thread holds the lock): shutdown,
        unlike close, makes its pending recv return at once."""
        sock = self._sock
        if sock is not None:
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass

    def _check_aborted(self, what: str) -> None:
        if self._aborted.is_set():
            raise dist.DistStoreError(f"store {what} on shard {self.host}:{self.port} aborted: "
                                      f"the controller stopped this generation")

    def _connect(self, deadline: float | None) -> socket.socket:
        while True:
            sock = self._open(deadline)
            try:
                self._read_nonce(sock)
                return sock
            except dist.DistNetworkError:
                # Hung up before its nonce (e.g. it dropped us to make room for a newcomer):
                # like a refusal, worth retrying until the shard has answered once.
                if self._reached or (deadline is not None and time.monotonic() > deadline):
                    raise
                time.sleep(0.01)

    def _read_nonce(self, sock: socket.socket) -> None:
        """The shard's nonce on a fresh connection (still under `_open`'s 1 s timeout)."""
        try:
            self._nonce = recv_exact(sock, NONCE_BYTES)
        except OSError as exc:
            sock.close()
            self._check_aborted("connect")
            raise dist.DistNetworkError(
                f"store shard {self.host}:{self.port} hung up before its nonce: {exc}") from None
        self._reached = True
        self._seq = 0
        self._inflight = 0
        # Reads wake up this often to look at the abort flag: shutdown() from the aborting
        # thread can miss a socket that was still connecting.
        sock.settimeout(ABORT_POLL_S)

    def _open(self, deadline: float | None) -> socket.socket:
        """A TCP connection to the shard, its nonce not read yet: `multi_get` opens many at
        once and reads their nonces after, so the shards' accepts overlap.

        The node's shard server may start a moment after this rank does: retry refusals
        until it has answered once. After that a refusal means its node is gone, and waiting
        out the timeout would only keep the survivors from re-forming.
        Connect attempts are short so an abort (a STOP while the group forms) is seen within
        a second even when the shard's host is gone without a trace (no refusal, no reset).
        """
        delay = CONNECT_RETRY_FIRST_S
        while True:
            self._check_aborted("connect")
            sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            try:
                sock.settimeout(1.0)
                sock.connect((self.host, self.port))
                return sock
            except OSError as exc:
                sock.close()
                unreachable = self._reached and not isinstance(exc, socket.timeout)
                if unreachable or (deadline is not None
                                   and time.monotonic() + delay > deadline):
                    raise dist.DistNetworkError(
                        f"store shard {self.host}:{self.port} unreachable: {exc}") from None
                time.sleep(delay)
                delay = min(delay * 2, CONNECT_RETRY_MAX_S)

    def request(self, op: int, fields: list[bytes], deadline: float | None,
                what: str) -> tuple[int, list[bytes]]:
        payload = bytes([op]) + pack_fields(fields)
        with self._lock:
            self._check_aborted(what)
            if self._sock is None:
                self._sock = self._connect(deadline)
            self._send(payload, what)
            return self._receive(what)

    def _send(self, payload: bytes, what: str) -> None:
        """Send one request on the open connection (lock held); its response is read by
        `_receive`. A first request too big for a stranger goes after a small one: the shard
        takes no frame this big before the connection has authenticated."""
        if self._seq + self._inflight == 0 and TAG_BYTES + len(payload) > PREAUTH_MAX_FRAME:
            self._send(bytes([OP_NUM_KEYS]), what)
            self._receive(what)
        sock = self._sock
        assert sock is not None
        tag = frame_tag(self._secret, b"Q", self._nonce, self._seq + self._inflight, payload)
        try:
            sock.sendall(U32.pack(TAG_BYTES + len(payload)) + tag + payload)
        except OSError as exc:
            self._fail(exc, what)
        self._inflight += 1

    def _receive(self, what: str) -> tuple[int, list[bytes]]:
        """The authenticated response to the oldest request in flight (lock held)."""
        sock = self._sock
        assert sock is not None and self._inflight > 0
        try:
            (n,) = U32.unpack(recv_exact(sock, 4, self._aborted))
            if n > MAX_FRAME or n < TAG_BYTES + 1:
                raise OSError(f"bad response length {n}")
            body = recv_exact(sock, n, self._aborted)
        except OSError as exc:
            self._fail(exc, what)
        resp_tag, resp = body[:TAG_BYTES], body[TAG_BYTES:]
        if not hmac.compare_digest(resp_tag, frame_tag(self._secret, b"R", self._nonce,
                                                       self._seq, resp)):
            self._drop()
            raise dist.DistNetworkError(
                f"store shard {self.host}:{self.port} sent an unauthenticated reply to "
                f"{what} (wrong secret?)")
        self._seq += 1
        self._inflight -= 1
        return resp[0], unpack_fields(memoryview(resp)[1:])

    def _drop(self) -> None:
        if self._sock is not None:
            self._sock.close()
        self._sock = None
        self._inflight = 0

    def _fail(self, exc: OSError, what: str) -> "typing.NoReturn":
        self._drop()
        self._check_aborted(what)
        raise dist.DistNetworkError(
            f"store shard {self.host}:{self.port} failed during {what}: {exc} (a shard "
            f"also hangs up on requests that fail authentication: check the secret)"
        ) from None


def _pipelined(calls: Sequence[tuple[_Shard, list[bytes]]], deadline: float | None,
               what: str) -> list[list[tuple[int, list[bytes]]]]:
    """Requests to several distinct shards, all in flight at once: connect to every shard not
    connected yet, then read the nonces, then send every request, then read the responses.
    Each phase waits for the slowest shard once instead of once per shard, which is what a
    rank gathering every other rank's key needs (one round trip, not N). Several requests to
    one shard go in order on its connection; only the last may park (a wait or get)."""
    with contextlib.ExitStack() as held:
        for shard, _ in calls:
            held.enter_context(shard._lock)
        try:
            fresh = []
            for shard, _ in calls:
                shard._check_aborted(what)
                if shard._sock is None:
                    shard._sock = shard._open(deadline)
                    fresh.append((shard, time.monotonic()))
            for shard, opened in fresh:
                sock, shard._sock = shard._sock, None
                if time.monotonic() - opened > PREAUTH_TIMEOUT_S / 2:
                    # A later shard took long to come up (its node started late): this
                    # shard may already have dropped the silent connection as a stranger.
                    sock.close()
                    sock = shard._open(deadline)
                try:
                    shard._read_nonce(sock)
                except dist.DistNetworkError:
                    if shard._reached:
                        raise
                    sock = shard._connect(deadline)  # dropped before its nonce: retry
                shard._sock = sock
            for shard, payloads in calls:
                for payload in payloads:
                    shard._send(payload, what)
            return [[shard._receive(what) for _ in payloads] for shard, payloads in calls]
        except BaseException:
            # A shard left with a request in flight would pair its late reply with the next
            # request: start those connections afresh.
            for shard, _ in calls:
                if shard._inflight:
                    shard._drop()
            raise


def _as_bytes(value: str | bytes) -> bytes:
    return value.encode() if isinstance(value, str) else bytes(value)


class RootlessStore(dist.Store):
    """A torch.distributed Store over per-node shard servers; no rank is special.

    Build one per generation over that generation's live members: the shard map is the member
    list, so a new membership gives a new map.

    `local_shard`: the index of this process's own node in the endpoints (host i runs shard
    i), where it reads the copies of fanned-out keys (`fan_out`); None reads every key at its
    home shard.
    """

    # multi_get asks every shard at once (rendezvous/gather.py gathers gloo's exchange in it).
    batched_multi_get = True

    def __init__(self, endpoints: Sequence[tuple[str, int]], secret: bytes,
                 timeout: datetime.timedelta = datetime.timedelta(seconds=300),
                 aborted: threading.Event | None = None, *, local_shard: int | None = None,
                 fanout: FanoutTable | None = None):
        super().__init__()
        if not endpoints:
            raise HpctError("RootlessStore needs at least one shard endpoint")
        self._endpoints = [(str(h), int(p)) for h, p in endpoints]
        if local_shard is not None and not 0 <= local_shard < len(self._endpoints):
            raise HpctError(f"local shard {local_shard} is not one of the "
                            f"{len(self._endpoints)} endpoints")
        self._secret = secret
        # Shared with clones (gloo clones the store per group): one abort reaches them all.
        self._aborted = aborted or threading.Event()
        self._shards = [_Shard(h, p, secret, self._aborted) for h, p in self._endpoints]
        self._clones: list[RootlessStore] = []
        self.local_shard = local_shard
        # Shared with clones too: a declaration made after cloning reaches the group's store.
        self._fanout = fanout or FanoutTable(len(self._endpoints))
        self._grid = Grid(len(self._endpoints))
        self.set_timeout(timeout)

    @property
    def endpoints(self) -> list[tuple[str, int]]:
        return list(self._endpoints)

    def close(self) -> None:
        for s in self._shards:
            s.close()

    def abort(self) -> None:
        """End every pending and future request of this store and its clones with
        DistStoreError: a STOP must interrupt a rank blocked forming its group, or it would
        wait out the init timeout for a member that is gone. Callable from any thread."""
        self._aborted.set()
        for store in [self, *self._clones]:
            for shard in store._shards:
                shard.abort()

    def clone(self) -> "RootlessStore":
        clone = RootlessStore(self._endpoints, self._secret, self.timeout, self._aborted,
                              local_shard=self.local_shard, fanout=self._fanout)
        self._clones.append(clone)
        return clone

    def fan_out(self, prefix: str, reader_hosts: Iterable[int]) -> None:
        """Declare the keys `<prefix><counter>` written once and read from `reader_hosts`
        (endpoint indices): a set of one also writes a copy to each reader host's shard, and a
        reader whose `local_shard` is one of them reads its own copy (fanout.py). Every member
        must declare it alike before the key is set or read; clones share declarations.
        `num_keys` counts the copies."""
        try:
            self._fanout.declare(prefix, reader_hosts)
        except ValueError as exc:
            raise HpctError(str(exc)) from None

    def _shard(self, key: str | bytes) -> _Shard:
        return self._shards[shard_of(key, len(self._shards))]

    def _read_key(self, key: str) -> str:
        return self._fanout.read_key(key, self.local_shard)

    def _write_once(self, key: str, what: str) -> None:
        if self._fanout.readers(key) is not None:
            raise dist.DistStoreError(f"store {what} of key '{key}': the key is declared "
                                      f"write-once (fan_out) and its copies would go stale")

    def _by_key_shard(self, keys: Sequence[str], op: int,
                      fields: Sequence[bytes] = ()) -> dict[int, list[bytes]]:
        """One `op` request payload per key, by the shard the key lives on."""
        requests: dict[int, list[bytes]] = {}
        for k in keys:
            requests.setdefault(shard_of(k, len(self._shards)), []).append(
                bytes([op]) + pack_fields([k.encode(), *fields]))
        return requests

    def _send_all(self, requests: dict[int, list[bytes]], deadline: float | None,
                  what: str) -> dict[int, list[tuple[int, list[bytes]]]]:
        order = sorted(requests)  # shard locks are taken in index order: no deadlock
        return dict(zip(order, _pipelined([(self._shards[i], requests[i]) for i in order],
                                          deadline, what)))

    def _deadline(self, timeout: datetime.timedelta) -> float | None:
        ms = _ms(timeout)
        return None if ms == 0 else time.monotonic() + ms / 1000

    def _call(self, key: str, op: int, fields: list[bytes], what: str) -> list[bytes]:
        status, out = self._shard(key).request(op, fields, self._deadline(self.timeout), what)
        if status == ST_NOT_INT:
            raise ValueError(f"store key '{key}' holds {out[0]!r}, not an integer: cannot add")
        if status != ST_OK:
            raise dist.DistStoreError(f"store {what} of key '{key}' failed: {out!r}")
        return out

    def set(self, key: str, value: str | bytes) -> None:
        keys = self._fanout.write_keys(key)
        if len(keys) == 1:
            self._call(key, OP_SET, [key.encode(), _as_bytes(value)], "set")
            return
        # A fanned-out key and its copies, every shard asked at once: one round trip.
        replies = self._send_all(self._by_key_shard(keys, OP_SET, [_as_bytes(value)]),
                                 self._deadline(self.timeout), "set")
        for status, out in (r for shard in replies.values() for r in shard):
            if status != ST_OK:
                raise dist.DistStoreError(f"store set of key '{key}' failed: {out!r}")

    def get(self, key: str) -> bytes:
        return self.get_within(key, self.timeout)

    def get_within(self, key: str, timeout: datetime.timedelta) -> bytes:
        """`get`, waiting up to `timeout` (not the store's) for the key to exist: a wait and
        a get in one round trip (gather.py answers lazy gloo's wait-then-get with it)."""
        read = self._read_key(key)
        status, out = self._shard(read).request(
            OP_GET, [read.encode(), I64.pack(_ms(timeout))], self._deadline(timeout), "get")
        if status == ST_TIMEOUT:
            raise dist.DistStoreError(
                f"store get of key '{key}' timed out after {timeout.total_seconds():g} s")
        if status != ST_OK:
            raise dist.DistStoreError(f"store get of key '{key}' failed: {out!r}")
        return out[0]

    def add(self, key: str, value: int) -> int:
        self._write_once(key, "add")
        out = self._call(key, OP_ADD, [key.encode(), I64.pack(int(value))], "add")
        return I64.unpack(out[0])[0]

    def compare_set(self, key: str, expected_value: str | bytes,
                    desired_value: str | bytes) -> bytes:
        self._write_once(key, "compare_set")
        out = self._call(key, OP_CAS, [key.encode(), _as_bytes(expected_value),
                                       _as_bytes(desired_value)], "compare_set")
        return out[0]

    def _by_shard(self, keys: Sequence[str]) -> dict[int, list[str]]:
        """The keys this process reads for `keys` (a fanned-out key's local copy), by shard."""
        groups: dict[int, list[str]] = {}
        for k in map(self._read_key, keys):
            groups.setdefault(shard_of(k, len(self._shards)), []).append(k)
        return groups

    def check(self, keys: list[str]) -> bool:
        deadline = self._deadline(self.timeout)
        for i, group in self._by_shard(keys).items():
            status, out = self._shards[i].request(OP_CHECK, [k.encode() for k in group],
                                                  deadline, "check")
            if status != ST_OK:
                raise dist.DistStoreError(f"store check of keys {group} failed: {out!r}")
            if out[0] != b"\x01":
                return False
        return True

    def wait(self, keys: list[str], timeout: datetime.timedelta | None = None) -> None:
        timeout = self.timeout if timeout is None else timeout
        deadline = self._deadline(timeout)
        for i, group in self._by_shard(keys).items():
            left_ms = 0 if deadline is None else max(1, int((deadline - time.monotonic()) * 1000))
            status, out = self._shards[i].request(
                OP_WAIT, [I64.pack(left_ms)] + [k.encode() for k in group], deadline, "wait")
            if status == ST_TIMEOUT:
                raise dist.DistStoreError(
                    f"store wait for key '{out[0].decode(errors='replace')}' timed out after "
                    f"{timeout.total_seconds():g} s")
            if status != ST_OK:
                raise dist.DistStoreError(f"store wait for keys {group} failed: {out!r}")

    def multi_get(self, keys: list[str]) -> list[bytes]:
        """Every key's value, waiting (up to the store timeout) until all exist. One request
        per shard the keys live on, all shards asked at once (see `_pipelined`)."""
        return self.set_then_multi_get(None, b"", keys)

    def set_then_multi_get(self, key: str | None, value: str | bytes,
                           keys: list[str]) -> list[bytes]:
        """`set(key, value)` (unless key is None), then `multi_get(keys)`, in the same round
        trip: the set goes just ahead of the multi_get on its shard's connection, which the
        shard serves in order. What a rank forming a group does: publish its own key, read
        everybody's."""
        if not keys and key is None:
            return []
        # The set (and a fanned-out key's copies) go first on their shards' connections.
        sets = {} if key is None else self._by_key_shard(
            self._fanout.write_keys(key), OP_SET, [_as_bytes(value)])
        values = self._set_and_read(key, sets, self._by_shard(keys))
        return [values[self._read_key(k)] for k in keys]

    def gather(self, own_key: str, value: str | bytes | None, keys: list[str]) -> list[bytes]:
        """An all-gather over the shard grid (grid.py): write `own_key` (unless `value` is
        None: written already) to every shard of its home's row, then read `keys` one
        request per row, in the same round trip; every key's value, waiting (up to the
        store timeout) until all exist. Every key of `keys` must have been written by its
        owner through `gather`, and `own_key` must be set nowhere else."""
        if self._fanout.readers(own_key) is not None:
            raise dist.DistStoreError(f"store gather of key '{own_key}': the key is declared "
                                      f"fanned out (fan_out); it cannot also be gathered")
        n, grid = len(self._shards), self._grid
        home = shard_of(own_key, n)
        sets: dict[int, list[bytes]] = {}
        if value is not None:
            payload = bytes([OP_SET]) + pack_fields([own_key.encode(), _as_bytes(value)])
            sets = {i: [payload] for i in grid.write_shards(home)}
        groups = {i: [keys[j] for j in idx] for i, idx in
                  grid.reads(home, [shard_of(k, n) for k in keys]).items()}
        values = self._set_and_read(own_key, sets, groups)
        return [values[k] for k in keys]

    def _set_and_read(self, key: str | None, sets: dict[int, list[bytes]],
                      groups: dict[int, list[str]]) -> dict[str, bytes]:
        """Send `sets` (payloads by shard), then one multi_get per shard of `groups`, all in
        one round trip; the values read, by key."""
        timeout = self.timeout
        requests = {i: list(payloads) for i, payloads in sets.items()}
        for i, group in groups.items():
            requests.setdefault(i, []).append(bytes([OP_MULTI_GET]) + pack_fields(
                [I64.pack(_ms(timeout))] + [k.encode() for k in group]))
        replies = self._send_all(requests, self._deadline(timeout), "multi_get")
        for i, payloads in sets.items():
            for status, out in replies[i][:len(payloads)]:
                if status != ST_OK:
                    raise dist.DistStoreError(f"store set of key '{key}' failed: {out!r}")
        values: dict[str, bytes] = {}
        for i, group in groups.items():
            status, out = replies[i][len(sets.get(i, ()))]
            if status == ST_TIMEOUT:
                raise dist.DistStoreError(
                    f"store multi_get: key '{out[0].decode(errors='replace')}' did not appear "
                    f"within {timeout.total_seconds():g} s")
            if status != ST_OK or len(out) != len(group):
                raise dist.DistStoreError(f"store multi_get of keys {group} failed: {out!r}")
            values.update(zip(group, out))
        return values

    def delete_key(self, key: str) -> bool:
        keys = self._fanout.write_keys(key)
        if len(keys) == 1:
            return self._call(key, OP_DELETE, [key.encode()], "delete_key")[0] == b"\x01"
        # The copies go with the key: a later set must not leave a reader an old copy.
        requests = self._by_key_shard(keys, OP_DELETE)
        home = shard_of(key, len(self._shards))
        replies = self._send_all(requests, self._deadline(self.timeout), "delete_key")
        for status, out in (r for shard in replies.values() for r in shard):
            if status != ST_OK:
                raise dist.DistStoreError(f"store delete_key of key '{key}' failed: {out!r}")
        return replies[home][0][1][0] == b"\x01"  # the key itself: first on its shard

    def num_keys(self) -> int:
        deadline = self._deadline(self.timeout)
        total = 0
        for s in self._shards:
            status, out = s.request(OP_NUM_KEYS, [], deadline, "num_keys")
            if status != ST_OK:
                raise dist.DistStoreError(f"store num_keys failed: {out!r}")
            total += U64.unpack(out[0])[0]
        return total

    def shard_stats(self) -> list[ShardStats]:
        """Each shard server's counters (connections, requests, rejected, keys)."""
        deadline = self._deadline(self.timeout)
        out = []
        for s in self._shards:
            _, fields = s.request(OP_STATS, [], deadline, "stats")
            out.append(ShardStats(*(U64.unpack(f)[0] for f in fields)))
        return out


def make_store(kind: Literal["rootless", "tcpstore"], info: "RendezvousInfo",
               secret: bytes | None = None,
               timeout: datetime.timedelta | None = None) -> dist.Store:
    """The store a generation rendezvouses over.

    `rootless` needs every member's shard server (see `serve_shard`); `tcpstore` is stock
    TCPStore with its server on rank 0 at MASTER_ADDR:MASTER_PORT.
    """
    if timeout is None:
        timeout = datetime.timedelta(seconds=info.init_timeout_s)
    if kind == "rootless":
        return RootlessStore(info.store_endpoints, secret if secret is not None else load_secret(),
                             timeout, local_shard=info.node_rank)
    if kind == "tcpstore":
        return dist.TCPStore(info.master_addr, info.master_port, info.world_size,
                             is_master=info.rank == 0, timeout=timeout, wait_for_workers=False)
    raise HpctError(f"store kind {kind!r} is not one of 'rootless', 'tcpstore'")
