"""One node's shard of the rootless store: `ShardServer`, a selectors loop on one thread
that holds the keys living on its node and answers the ranks' requests, and `serve_shard`,
which starts a node's one for a generation.

Every node runs one, whatever ranks it runs, so it stands apart from the client
(store_client.py) and needs no torch; what both sides speak is store_wire.py. A connection
that has not authenticated yet is a stranger (store_wire.py): at most MAX_STRANGERS of them
are held, the oldest making room for a newcomer, and at most MAX_CONNECTIONS connections of
any kind.
"""
from __future__ import annotations

import _thread
import dataclasses
import errno
import hmac
import secrets
import selectors
import socket
import struct
import threading
import time
from typing import TYPE_CHECKING

from ..accept_pause import AcceptPause
from ..errors import HpctError
from ..events import Ev, EventLog, stderr_log
from .store_wire import (I64, MAX_FRAME, MIN_SECRET_BYTES, NONCE_BYTES, OP_ADD, OP_CAS,
                         OP_CHECK, OP_DELETE, OP_GET, OP_MULTI_GET, OP_NAMES, OP_NUM_KEYS,
                         OP_SET, OP_STATS, OP_WAIT, PREAUTH_MAX_FRAME, PREAUTH_TIMEOUT_S,
                         ST_BAD_REQUEST, ST_NOT_INT, ST_OK, ST_TIMEOUT, TAG_BYTES, U32, U64,
                         frame_tag, pack_fields, unpack_fields)

if TYPE_CHECKING:
    from .derive import RendezvousInfo

LISTEN_BACKLOG = 4096
MAX_STRANGERS = 256
# Every connection, authenticated or not; a rank holds one per store (and clone) per shard.
MAX_CONNECTIONS = 16384
# A frame that stops arriving half-way for this long holds a buffer for nothing: dropped.
STALL_TIMEOUT_S = 30.0
# Longest pause in accepting while the process is out of descriptors (EMFILE/ENFILE).
ACCEPT_BACKOFF_MAX = 1.0

EVENT_AUTH_REJECTED = Ev.STORE_AUTH_REJECTED
EVENT_SHARD_STARTED = Ev.STORE_SHARD_STARTED
EVENT_SHARD_STOPPED = Ev.STORE_SHARD_STOPPED
EVENT_ACCEPT_FAILED = Ev.STORE_ACCEPT_FAILED


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
        # out of descriptors: pause, say so once, go on (a failed record is held, not raised)
        self._pause = AcceptPause(lambda **f: self._events.emit(EVENT_ACCEPT_FAILED,
                                                                shard=self.name, **f),
                                  self._events, max_s=ACCEPT_BACKOFF_MAX)
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
                self._pause.accepted()
                return
            except OSError as exc:
                if exc.errno == errno.ECONNABORTED:
                    continue
                self._pause_accept(exc)
                return
            self._pause.accepted()
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
        self._accept_resume = time.monotonic() + self._pause.failed(exc)
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
            (n,) = U32.unpack_from(conn.rbuf, 0)
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
        if not hmac.compare_digest(tag, frame_tag(self._secret, b"Q", conn.nonce, conn.seq,
                                                  payload)):
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
            fields = unpack_fields(memoryview(payload)[1:])
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
            self._park_or_answer(conn, OP_GET, [f[0]], I64.unpack(f[1])[0])
        elif op in (OP_WAIT, OP_MULTI_GET):
            if op == OP_MULTI_GET and len(f) < 2:
                raise ValueError("multi_get of no keys")
            self._park_or_answer(conn, op, f[1:], I64.unpack(f[0])[0])
        elif op == OP_ADD:
            # Like HashStore, a missing or empty value counts as 0.
            current = data.get(f[0]) or b"0"
            try:
                value = int(current) + I64.unpack(f[1])[0]
            except ValueError:
                self._respond(conn, ST_NOT_INT, [current[:64]])
                return
            data[f[0]] = str(value).encode()
            self._respond(conn, ST_OK, [I64.pack(value)])
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
            self._respond(conn, ST_OK, [U64.pack(len(data))])
        elif op == OP_STATS:
            s = self.stats()
            self._respond(conn, ST_OK, [U64.pack(v) for v in dataclasses.astuple(s)])
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
        payload = bytes([status]) + pack_fields(fields)
        tag = frame_tag(self._secret, b"R", conn.nonce, conn.seq, payload)
        conn.seq += 1
        conn.wbuf += U32.pack(TAG_BYTES + len(payload)) + tag + payload
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


def serve_shard(info: "RendezvousInfo", secret: bytes, *,
                events: EventLog | None = None) -> ShardServer:
    """Start this node's shard server for `info`'s generation (one per node)."""
    return ShardServer(info.addresses[info.node_rank], info.store_port, secret, events=events,
                       name=f"{info.node_name}/gen{info.generation}")
