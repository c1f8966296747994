"""A key-value store for torch.distributed with no root: keys are sharded over one small
server per node.

TCPStore puts every rank's connection and request on rank 0's host; at a few dozen ranks its
listen backlog already stalls connects for seconds (torch-distributed.md). Here each node runs a
`ShardServer`, every key lives on the shard chosen by `shard_of` (per-rank keys on consecutive
shards, other keys by a stable hash), so a rendezvous spreads its connections and requests
evenly over all nodes.

A key read by every member of a group (an NCCL communicator's unique id) would still be one
shard's O(world) hot spot: a prefix declared with `RootlessStore.fan_out` has its keys written
once more to every reader host's shard and read there (fanout.py).

Wire protocol (TCP, one request in flight per connection):
  on accept, the server sends a 16-byte random nonce;
  each frame is `u32 length | body`;
  request body  = `tag(32) | op(u8) | fields`, tag = HMAC-SHA256(secret, "Q" nonce seq op fields)
  response body = `tag(32) | status(u8) | fields`, tag = HMAC-SHA256(secret, "R" nonce seq ...)
  fields = repeated `u32 length | bytes`; seq counts the requests on the connection, so a
  recorded request replayed on this or any other connection fails authentication.

Nothing is authenticated before a whole frame has arrived, so a connection is a stranger until
its first request passes: its frames may be at most PREAUTH_MAX_FRAME bytes, it must pass within
PREAUTH_TIMEOUT_S, and at most MAX_STRANGERS of them are held (the oldest makes room for a
newcomer). A client whose first request is larger sends a small one first.
"""
from __future__ import annotations

import _thread
import contextlib
import dataclasses
import datetime
import errno
import hashlib
import hmac
import os
import secrets
import selectors
import socket
import struct
import threading
import time
import typing
import zlib
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING, Literal

import torch.distributed as dist

from .. import config as C
from .. import protocol
from ..errors import HpctError
from ..events import Ev, EventLog, stderr_log
from .fanout import FanoutTable
from .grid import Grid

if TYPE_CHECKING:
    from .derive import RendezvousInfo

SECRET_ENV = C.SECRET_FILE
MIN_SECRET_BYTES = 16
ABORT_POLL_S = 0.2
NONCE_BYTES = 16
TAG_BYTES = 32
MAX_FRAME = 16 << 20
LISTEN_BACKLOG = 4096
PREAUTH_MAX_FRAME = 64 << 10
PREAUTH_TIMEOUT_S = 10.0
MAX_STRANGERS = 256
# Every connection, authenticated or not; a rank holds one per store (and clone) per shard.
MAX_CONNECTIONS = 16384
# A frame that stops arriving half-way for this long holds a buffer for nothing: dropped.
STALL_TIMEOUT_S = 30.0
# Retrying a refused connect (the shard's node has not started it yet): a refusal costs the
# shard's host nothing (the kernel answers it), while each pause is time the whole rendezvous
# may wait, since every rank needs every rank's key. A 0.5 s cap cost a 64-rank formation up
# to 0.3 s whenever one node started its shard late.
CONNECT_RETRY_FIRST_S = 0.002
CONNECT_RETRY_MAX_S = 0.05
# Longest pause in accepting while the process is out of descriptors (EMFILE/ENFILE).
ACCEPT_BACKOFF_MAX = 1.0

EVENT_AUTH_REJECTED = Ev.STORE_AUTH_REJECTED
EVENT_SHARD_STARTED = Ev.STORE_SHARD_STARTED
EVENT_SHARD_STOPPED = Ev.STORE_SHARD_STOPPED
EVENT_ACCEPT_FAILED = Ev.STORE_ACCEPT_FAILED

(OP_SET, OP_GET, OP_ADD, OP_CAS, OP_CHECK, OP_WAIT, OP_DELETE, OP_NUM_KEYS, OP_STATS,
 OP_MULTI_GET) = range(1, 11)
OP_NAMES = {OP_SET: "set", OP_GET: "get", OP_ADD: "add", OP_CAS: "compare_set",
            OP_CHECK: "check", OP_WAIT: "wait", OP_DELETE: "delete_key",
            OP_NUM_KEYS: "num_keys", OP_STATS: "stats", OP_MULTI_GET: "multi_get"}
ST_OK, ST_TIMEOUT, ST_NOT_INT, ST_BAD_REQUEST = range(4)

_U32 = struct.Struct("!I")
_I64 = struct.Struct("!q")
_U64 = struct.Struct("!Q")


# ---------------------------------------------------------------- secret


def load_secret(path: str | os.PathLike | None = None) -> bytes:
    """The per-job secret: from `path`, else from the file named by $HPCT_SECRET_FILE. The
    file format and its checks are the control protocol's: one secret per job for both."""
    if path is None:
        path = C.require(None, SECRET_ENV, "the store needs the per-job secret file")
    return protocol.load_secret(path)


write_secret = protocol.new_secret_file


# ---------------------------------------------------------------- framing


def _pack_fields(fields: Sequence[bytes]) -> bytes:
    return b"".join(_U32.pack(len(f)) + f for f in fields)


def _unpack_fields(data: bytes | memoryview) -> list[bytes]:
    out = []
    i = 0
    while i < len(data):
        if i + 4 > len(data):
            raise ValueError("truncated field length")
        (n,) = _U32.unpack_from(data, i)
        i += 4
        if i + n > len(data):
            raise ValueError("truncated field")
        out.append(bytes(data[i:i + n]))
        i += n
    return out


def _tag(secret: bytes, direction: bytes, nonce: bytes, seq: int, payload: bytes) -> bytes:
    return hmac.new(secret, direction + nonce + _U64.pack(seq) + payload,
                    hashlib.sha256).digest()


_MAX_RANK_DIGITS = 9


def shard_of(key: str | bytes, n_shards: int) -> int:
    """The shard that holds `key`; stable across processes and Python versions (unlike
    hash()).

    A key whose last `/` component is a decimal number is a per-rank key: gloo's full-mesh
    rendezvous has every rank set `<prefix>/<rank>` (e.g. `hpct/gen0/0//cpu//0/5`) and every
    rank read all of them; NCCL's unique-id keys end in a counter the same way. Those go to
    `(crc32(<prefix>/) + number) % n_shards`: the ranks of one prefix land on consecutive
    shards, so N rank keys over N shards put exactly one on each (a plain hash puts up to 3-4
    on the busiest at 64), and the crc32 offset keeps different groups' rank 0 off the same
    shard. Every other key: crc32 of the whole key.
    """
    if isinstance(key, str):
        key = key.encode()
    head, sep, tail = key.rpartition(b"/")
    if sep and tail.isdigit() and len(tail) <= _MAX_RANK_DIGITS:
        return (zlib.crc32(head + sep) + int(tail)) % n_shards
    return zlib.crc32(key) % n_shards


def _ms(timeout: datetime.timedelta) -> int:
    return max(0, int(timeout.total_seconds() * 1000))


# ---------------------------------------------------------------- server


@dataclasses.dataclass
class ShardStats:
    connections: int = 0
    requests: int = 0
    auth_rejected: int = 0
    keys: int = 0


class _Conn:
    __slots__ = ("sock", "peer", "nonce", "seq", "rbuf", "wbuf", "wait_keys", "wait_op",
                 "deadline", "authed", "progress_at")

    def __init__(self, sock: socket.socket, peer: str, nonce: bytes):
        self.sock = sock
        self.peer = peer
        self.nonce = nonce
        self.seq = 0
        self.rbuf = bytearray()
        self.wbuf = bytearray()
        self.wait_keys: list[bytes] | None = None
        self.wait_op = 0
        self.deadline: float | None = None
        self.authed = False  # one of its requests has passed authentication
        self.progress_at = time.monotonic()  # when its last bytes arrived


class ShardServer:
    """One node's shard: a selectors loop on one thread, fast accept, large listen backlog.

    Blocking gets and waits are parked on the server and answered when the key arrives or
    their deadline passes, so clients never poll.
    """

    def __init__(self, host: str, port: int, secret: bytes, *, events: EventLog | None = None,
                 name: str = ""):
        if len(secret) < MIN_SECRET_BYTES:
            raise HpctError(f"store secret of {len(secret)} bytes is shorter than "
                            f"{MIN_SECRET_BYTES}")
        self._secret = secret
        self._events = events or stderr_log("store")
        self._data: dict[bytes, bytes] = {}
        self._waiters: dict[bytes, set[_Conn]] = {}
        self._parked: set[_Conn] = set()
        self._conns: set[_Conn] = set()
        self._strangers: dict[_Conn, float] = {}  # not authenticated yet -> deadline, oldest first
        self._accept_resume: float | None = None  # listener paused (out of fds) until then
        self._accept_backoff = 0.0
        self._next_sweep = 0.0
        self._stats = ShardStats()
        self._stats_lock = threading.Lock()
        self._sel = selectors.DefaultSelector()
        self._listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            self._listener.bind((host, port))
        except OSError as exc:
            self._listener.close()
            raise HpctError(f"store shard cannot listen on {host}:{port}: {exc.strerror}"
                            ) from None
        self._listener.listen(LISTEN_BACKLOG)
        self._listener.setblocking(False)
        self.address: tuple[str, int] = self._listener.getsockname()[:2]
        self.name = name or f"{self.address[0]}:{self.address[1]}"
        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_r.setblocking(False)
        self._sel.register(self._listener, selectors.EVENT_READ, None)
        self._sel.register(self._wake_r, selectors.EVENT_READ, None)
        self._stopping = False
        # threading.Thread.start() returns only once the new thread has run: when every rank
        # of a formation wakes at once on busy cores, that wait was the slowest rank's 1-6 ms
        # (bench rendezvous, "shard" phase), on the formation's critical path, while the
        # listening socket already queues connections. The loop starts without that wait;
        # `_done` stands in for join().
        self._done = threading.Event()
        _thread.start_new_thread(self._serve, ())
        self._events.emit(EVENT_SHARD_STARTED, shard=self.name, address=list(self.address))

    @property
    def port(self) -> int:
        return self.address[1]

    def stats(self) -> ShardStats:
        with self._stats_lock:
            return dataclasses.replace(self._stats, keys=len(self._data))

    def stop(self) -> None:
        if self._stopping:
            return
        self._stopping = True
        try:
            self._wake_w.send(b"x")
        except OSError:
            pass
        self._done.wait(timeout=10)
        self._events.emit(EVENT_SHARD_STOPPED, shard=self.name, **dataclasses.asdict(self.stats()))

    def __enter__(self) -> "ShardServer":
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # -- event loop

    def _serve(self) -> None:
        try:
            self._loop()
        finally:
            self._done.set()

    def _loop(self) -> None:
        try:
            while not self._stopping:
                for key, mask in self._sel.select(self._next_timeout()):
                    sock = key.fileobj
                    if sock is self._listener:
                        self._accept()
                    elif sock is self._wake_r:
                        self._wake_r.recv(64)
                    else:
                        conn: _Conn = key.data
                        if mask & selectors.EVENT_READ:
                            self._readable(conn)
                        if mask & selectors.EVENT_WRITE and conn.sock.fileno() >= 0:
                            self._flush(conn)
                self._expire()
        finally:
            for key in list(self._sel.get_map().values()):
                key.fileobj.close()
            self._listener.close()  # not registered while accepting is paused
            self._sel.close()
            self._wake_w.close()

    def _next_timeout(self) -> float | None:
        deadlines = [c.deadline for c in self._parked if c.deadline is not None]
        if self._strangers:
            deadlines.append(next(iter(self._strangers.values())))
        if self._accept_resume is not None:
            deadlines.append(self._accept_resume)
        if self._conns:
            deadlines.append(self._next_sweep)
        if not deadlines:
            return None
        return max(0.0, min(deadlines) - time.monotonic())

    def _accept(self) -> None:
        # Drain the whole backlog in one go: a burst of N ranks connecting at once must not
        # wait one select round per connection.
        while True:
            try:
                sock, peer = self._listener.accept()
            except (BlockingIOError, InterruptedError):
                self._accept_backoff = 0.0
                return
            except OSError as exc:
                if exc.errno == errno.ECONNABORTED:
                    continue
                self._pause_accept(exc)
                return
            peer_name = f"{peer[0]}:{peer[1]}"
            if len(self._strangers) >= MAX_STRANGERS or len(self._conns) >= MAX_CONNECTIONS:
                if not self._strangers:
                    sock.close()
                    self._events.emit(EVENT_AUTH_REJECTED, shard=self.name, peer=peer_name,
                                      reason=f"{len(self._conns)} connections open, all "
                                             f"authenticated: refused")
                    continue
                self._reject(next(iter(self._strangers)),
                             "dropped for a newer connection: no authenticated request yet")
            sock.setblocking(False)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            conn = _Conn(sock, peer_name, secrets.token_bytes(NONCE_BYTES))
            conn.wbuf += conn.nonce
            with self._stats_lock:
                self._stats.connections += 1
            self._conns.add(conn)
            self._strangers[conn] = time.monotonic() + PREAUTH_TIMEOUT_S
            self._sel.register(sock, selectors.EVENT_READ, conn)
            self._flush(conn)

    def _pause_accept(self, exc: OSError) -> None:
        """Out of descriptors (or memory): the listener stays readable, so selecting on it at
        once again would spin a core. Leave it alone for a while, longer each time in a row."""
        if self._accept_backoff == 0.0:
            self._events.emit(EVENT_ACCEPT_FAILED, shard=self.name,
                              error=f"{exc.strerror or exc} (errno {exc.errno}); retrying")
        self._accept_backoff = min(ACCEPT_BACKOFF_MAX, self._accept_backoff * 2 or 0.01)
        self._accept_resume = time.monotonic() + self._accept_backoff
        self._sel.unregister(self._listener)

    def _close(self, conn: _Conn) -> None:
        self._conns.discard(conn)
        self._strangers.pop(conn, None)
        if self._accept_resume is not None:
            self._accept_resume = time.monotonic()  # a descriptor is free again: accept now
        self._unpark(conn)
        try:
            self._sel.unregister(conn.sock)
        except (KeyError, ValueError):
            pass
        conn.sock.close()

    def _readable(self, conn: _Conn) -> None:
        try:
            chunk = conn.sock.recv(1 << 16)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            chunk = b""
        if not chunk:
            self._close(conn)
            return
        conn.rbuf += chunk
        conn.progress_at = time.monotonic()
        while len(conn.rbuf) >= 4:
            (n,) = _U32.unpack_from(conn.rbuf, 0)
            limit = MAX_FRAME if conn.authed else PREAUTH_MAX_FRAME
            if n > limit or n < TAG_BYTES + 1:
                self._reject(conn, f"frame length {n} outside {TAG_BYTES + 1}..{limit}"
                                   + ("" if conn.authed else " (not authenticated yet)"))
                return
            if len(conn.rbuf) < 4 + n:
                return
            body = bytes(conn.rbuf[4:4 + n])
            del conn.rbuf[:4 + n]
            if not self._request(conn, body):
                return

    def _reject(self, conn: _Conn, why: str) -> None:
        with self._stats_lock:
            self._stats.auth_rejected += 1
        self._events.emit(EVENT_AUTH_REJECTED, shard=self.name, peer=conn.peer, reason=why)
        self._close(conn)

    def _request(self, conn: _Conn, body: bytes) -> bool:
        tag, payload = body[:TAG_BYTES], body[TAG_BYTES:]
        if not hmac.compare_digest(tag, _tag(self._secret, b"Q", conn.nonce, conn.seq, payload)):
            self._reject(conn, "bad request tag")
            return False
        if not conn.authed:
            conn.authed = True
            del self._strangers[conn]
        if conn.wait_keys is not None:
            self._reject(conn, "request while another is pending")
            return False
        with self._stats_lock:
            self._stats.requests += 1
        op = payload[0]
        try:
            fields = _unpack_fields(memoryview(payload)[1:])
            self._dispatch(conn, op, fields)
        except (ValueError, IndexError, struct.error):
            self._respond(conn, ST_BAD_REQUEST, [f"bad {OP_NAMES.get(op, op)} request".encode()])
        return True

    def _dispatch(self, conn: _Conn, op: int, f: list[bytes]) -> None:
        data = self._data
        if op == OP_SET:
            data[f[0]] = f[1]
            self._respond(conn, ST_OK, [])
            self._wake(f[0])
        elif op == OP_GET:
            self._park_or_answer(conn, OP_GET, [f[0]], _I64.unpack(f[1])[0])
        elif op in (OP_WAIT, OP_MULTI_GET):
            if op == OP_MULTI_GET and len(f) < 2:
                raise ValueError("multi_get of no keys")
            self._park_or_answer(conn, op, f[1:], _I64.unpack(f[0])[0])
        elif op == OP_ADD:
            # Like HashStore, a missing or empty value counts as 0.
            current = data.get(f[0]) or b"0"
            try:
                value = int(current) + _I64.unpack(f[1])[0]
            except ValueError:
                self._respond(conn, ST_NOT_INT, [current[:64]])
                return
            data[f[0]] = str(value).encode()
            self._respond(conn, ST_OK, [_I64.pack(value)])
            self._wake(f[0])
        elif op == OP_CAS:
            key, expected, desired = f
            current = data.get(key)
            # HashStore's semantics: a missing key is only created when expected is empty;
            # otherwise the caller gets back the current value (or its own expected one).
            if current is None:
                if expected == b"":
                    data[key] = desired
                    self._respond(conn, ST_OK, [desired])
                    self._wake(key)
                else:
                    self._respond(conn, ST_OK, [expected])
            elif current == expected:
                data[key] = desired
                self._respond(conn, ST_OK, [desired])
            else:
                self._respond(conn, ST_OK, [current])
        elif op == OP_CHECK:
            self._respond(conn, ST_OK, [b"\x01" if all(k in data for k in f) else b"\x00"])
        elif op == OP_DELETE:
            existed = data.pop(f[0], None) is not None
            self._respond(conn, ST_OK, [b"\x01" if existed else b"\x00"])
        elif op == OP_NUM_KEYS:
            self._respond(conn, ST_OK, [_U64.pack(len(data))])
        elif op == OP_STATS:
            s = self.stats()
            self._respond(conn, ST_OK, [_U64.pack(v) for v in dataclasses.astuple(s)])
        else:
            raise ValueError(f"unknown op {op}")

    def _park_or_answer(self, conn: _Conn, op: int, keys: list[bytes], timeout_ms: int) -> None:
        if all(k in self._data for k in keys):
            self._answer_wait(conn, op, keys)
            return
        conn.wait_keys = keys
        conn.wait_op = op
        conn.deadline = time.monotonic() + timeout_ms / 1000 if timeout_ms > 0 else None
        self._parked.add(conn)
        for k in keys:
            self._waiters.setdefault(k, set()).add(conn)

    def _answer_wait(self, conn: _Conn, op: int, keys: list[bytes]) -> None:
        if op == OP_GET:
            self._respond(conn, ST_OK, [self._data[keys[0]]])
        elif op == OP_MULTI_GET:
            self._respond(conn, ST_OK, [self._data[k] for k in keys])
        else:
            self._respond(conn, ST_OK, [])

    def _unpark(self, conn: _Conn) -> None:
        if conn.wait_keys is None:
            return
        for k in conn.wait_keys:
            waiting = self._waiters.get(k)
            if waiting is not None:
                waiting.discard(conn)
                if not waiting:
                    del self._waiters[k]
        conn.wait_keys = None
        conn.deadline = None
        self._parked.discard(conn)

    def _wake(self, key: bytes) -> None:
        for conn in list(self._waiters.get(key, ())):
            keys = conn.wait_keys
            if keys is not None and all(k in self._data for k in keys):
                op = conn.wait_op
                self._unpark(conn)
                self._answer_wait(conn, op, keys)

    def _expire(self) -> None:
        now = time.monotonic()
        if self._accept_resume is not None and now >= self._accept_resume:
            self._accept_resume = None
            self._sel.register(self._listener, selectors.EVENT_READ, None)
        while self._strangers:
            conn, deadline = next(iter(self._strangers.items()))
            if deadline > now:
                break
            self._reject(conn, f"no authenticated request within {PREAUTH_TIMEOUT_S:g} s")
        if now >= self._next_sweep:
            self._next_sweep = now + 1.0
            for conn in [c for c in self._conns
                         if c.rbuf and now - c.progress_at > STALL_TIMEOUT_S]:
                self._reject(conn, f"frame stalled for {STALL_TIMEOUT_S:g} s")
        for conn in [c for c in self._parked if c.deadline is not None and c.deadline <= now]:
            missing = next(k for k in conn.wait_keys if k not in self._data)
            self._unpark(conn)
            self._respond(conn, ST_TIMEOUT, [missing])

    def _respond(self, conn: _Conn, status: int, fields: list[bytes]) -> None:
        payload = bytes([status]) + _pack_fields(fields)
        tag = _tag(self._secret, b"R", conn.nonce, conn.seq, payload)
        conn.seq += 1
        conn.wbuf += _U32.pack(TAG_BYTES + len(payload)) + tag + payload
        self._flush(conn)

    def _flush(self, conn: _Conn) -> None:
        if conn.wbuf:
            try:
                sent = conn.sock.send(conn.wbuf)
                del conn.wbuf[:sent]
            except (BlockingIOError, InterruptedError):
                pass
            except OSError:
                self._close(conn)
                return
        events = selectors.EVENT_READ | (selectors.EVENT_WRITE if conn.wbuf else 0)
        try:
            self._sel.modify(conn.sock, events, conn)
        except (KeyError, ValueError):
            pass


# ---------------------------------------------------------------- client


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
            self._nonce = _recv_exact(sock, NONCE_BYTES)
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
        payload = bytes([op]) + _pack_fields(fields)
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
        tag = _tag(self._secret, b"Q", self._nonce, self._seq + self._inflight, payload)
        try:
            sock.sendall(_U32.pack(TAG_BYTES + len(payload)) + tag + payload)
        except OSError as exc:
            self._fail(exc, what)
        self._inflight += 1

    def _receive(self, what: str) -> tuple[int, list[bytes]]:
        """The authenticated response to the oldest request in flight (lock held)."""
        sock = self._sock
        assert sock is not None and self._inflight > 0
        try:
            (n,) = _U32.unpack(_recv_exact(sock, 4, self._aborted))
            if n > MAX_FRAME or n < TAG_BYTES + 1:
                raise OSError(f"bad response length {n}")
            body = _recv_exact(sock, n, self._aborted)
        except OSError as exc:
            self._fail(exc, what)
        resp_tag, resp = body[:TAG_BYTES], body[TAG_BYTES:]
        if not hmac.compare_digest(resp_tag, _tag(self._secret, b"R", self._nonce,
                                                  self._seq, resp)):
            self._drop()
            raise dist.DistNetworkError(
                f"store shard {self.host}:{self.port} sent an unauthenticated reply to "
                f"{what} (wrong secret?)")
        self._seq += 1
        self._inflight -= 1
        return resp[0], _unpack_fields(memoryview(resp)[1:])

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


def _recv_exact(sock: socket.socket, n: int, aborted: threading.Event | None = None) -> bytes:
    """`n` bytes; with `aborted`, the socket has a short timeout and the wait ends (OSError)
    once the event is set, else a timeout only means "nothing yet"."""
    buf = bytearray(n)
    view = memoryview(buf)
    got = 0
    while got < n:
        try:
            r = sock.recv_into(view[got:])
        except socket.timeout:
            if aborted is None:
                raise
            if aborted.is_set():
                raise ConnectionAbortedError("aborted while waiting for the shard") from None
            continue
        if r == 0:
            raise ConnectionResetError("connection closed by the shard server")
        got += r
    return bytes(buf)


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
                bytes([op]) + _pack_fields([k.encode(), *fields]))
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
            OP_GET, [read.encode(), _I64.pack(_ms(timeout))], self._deadline(timeout), "get")
        if status == ST_TIMEOUT:
            raise dist.DistStoreError(
                f"store get of key '{key}' timed out after {timeout.total_seconds():g} s")
        if status != ST_OK:
            raise dist.DistStoreError(f"store get of key '{key}' failed: {out!r}")
        return out[0]

    def add(self, key: str, value: int) -> int:
        self._write_once(key, "add")
        out = self._call(key, OP_ADD, [key.encode(), _I64.pack(int(value))], "add")
        return _I64.unpack(out[0])[0]

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
                OP_WAIT, [_I64.pack(left_ms)] + [k.encode() for k in group], deadline, "wait")
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
            payload = bytes([OP_SET]) + _pack_fields([own_key.encode(), _as_bytes(value)])
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
            requests.setdefault(i, []).append(bytes([OP_MULTI_GET]) + _pack_fields(
                [_I64.pack(_ms(timeout))] + [k.encode() for k in group]))
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
            total += _U64.unpack(out[0])[0]
        return total

    def shard_stats(self) -> list[ShardStats]:
        """Each shard server's counters (connections, requests, rejected, keys)."""
        deadline = self._deadline(self.timeout)
        out = []
        for s in self._shards:
            _, fields = s.request(OP_STATS, [], deadline, "stats")
            out.append(ShardStats(*(_U64.unpack(f)[0] for f in fields)))
        return out


# ---------------------------------------------------------------- factory


def serve_shard(info: "RendezvousInfo", secret: bytes, *,
                events: EventLog | None = None) -> ShardServer:
    """Start this node's shard server for `info`'s generation (one per node)."""
    return ShardServer(info.addresses[info.node_rank], info.store_port, secret, events=events,
                       name=f"{info.node_name}/gen{info.generation}")


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
