"""The control-message protocol shared by the controller and the ranks.

One frame on the wire::

    u32 big-endian header length | header (UTF-8 JSON object) | MAC (32 bytes) | body

    header = {"v": 2, "type": "...", "job": "...", "seq": int,
              "parts": [[nbytes, "digest hex"], ...], "fields": {...}}
    MAC    = HMAC-SHA256(secret, b"hpct2" + direction + nonce + header bytes)

On every connection the server first sends NONCE_BYTES fresh random bytes; every frame on that
connection is MACed with that nonce and its direction (TO_SERVER or TO_CLIENT), see `Channel`.

The MAC covers only the header; the body is a sequence of parts, each bound to the header by its
`part_digest` (a SHA-256 hash tree, below). An attacker without the secret can forge no header,
so substituting a body means finding a second SHA-256 preimage: the body stays authenticated
while the expensive per-byte work shrinks to one hash the sender usually already has (a
snapshot's digest is computed once at commit and reused by every send of it), and the receiver
hashes 4 MiB leaves on a thread pool while the next ones are still arriving.

The MAC precedes the body, so a receiver authenticates the header (sizes, message) before it
allocates or fills a buffer; the length prefix covers only the header (capped at 64 KiB): a state
blob can exceed 4 GiB.

Replay protection: the job id in the header rejects frames from another job (and the secret is
per job anyway). The server's nonce makes a frame recorded on one connection fail the MAC on any
other, the direction makes a server's own frames fail when reflected back at it (or a client's
at another client), and `Channel` rejects a sequence number that does not increase on one
connection, so nothing recorded can be replayed, reflected or reordered.
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import hashlib
import hmac
import json
import os
import secrets
import socket
import stat
import struct
import threading
import time
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, ClassVar, Iterable, Literal, Sequence, Union

from .errors import HpctError

VERSION = 2
HEADER_MAX = 64 * 1024
DEFAULT_MAX_BODY = 1024 * 1024
MAC_LEN = 32
DIGEST_LEN = 32
MAX_PARTS = 16
_LEN = struct.Struct(">I")
_MAC_DOMAIN = b"hpct2"
NONCE_BYTES = 16
# The direction of a frame, MACed with it: the server's frames and its clients' never verify as
# each other's.
TO_SERVER, TO_CLIENT = b">", b"<"
# Large bodies move through the kernel in slices this big, and each slice is one leaf of the
# part digest, hashed on the pool as soon as it has arrived.
CHUNK = 4 * 1024 * 1024


class ProtocolError(HpctError):
    """A frame that cannot be trusted or understood; the connection should be dropped."""


class ConnectionClosed(ProtocolError):
    """The peer closed the connection cleanly between two frames."""


class ProtocolTimeout(ProtocolError):
    """No complete frame arrived within the timeout."""


class DigestMismatch(ProtocolError):
    """An authentic header whose body does not match its digests (corrupted at the sender or on
    the way). The whole frame has been read, so the connection is still in step and usable."""

    def __init__(self, message: str, msg: Any):
        super().__init__(message)
        self.msg = msg


# ---------------------------------------------------------------------------------------------
# Part digests: a two-level SHA-256 tree, so leaves hash in parallel (hashlib releases the GIL)
# and a receiver hashes each leaf as soon as it has arrived.
#
#     leaf_i = SHA256(0x00 | data[i*CHUNK:(i+1)*CHUNK])
#     digest = SHA256(0x01 | u64 len(data) | u32 CHUNK | leaf_0 | leaf_1 | ...)
#
# The root binds the length and leaf size, so the tree shape is fixed by the data length and a
# collision of the root implies a SHA-256 collision. SHA-256 because it is the fastest strong
# hash in hashlib where SHA-NI exists (measured on the 2-core dev VM: sha256 1.42 GB/s,
# blake2b 0.93 GB/s).

_ROOT = struct.Struct(">QI")
_pool: concurrent.futures.ThreadPoolExecutor | None = None
_pool_lock = threading.Lock()


def hash_workers() -> int:
    """Threads hashing leaves: one per usable core, at most 8 (memory bandwidth saturates)."""
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:
        cores = os.cpu_count() or 1
    return max(1, min(8, cores))


def hash_pool() -> concurrent.futures.ThreadPoolExecutor:
    global _pool
    with _pool_lock:
        if _pool is None:
            _pool = concurrent.futures.ThreadPoolExecutor(hash_workers(),
                                                          thread_name_prefix="hpct-hash")
        return _pool


def _leaf(piece: memoryview) -> bytes:
    h = hashlib.sha256(b"\x00")
    h.update(piece)
    return h.digest()


def _root(nbytes: int, leaves: Iterable[bytes]) -> bytes:
    h = hashlib.sha256(b"\x01" + _ROOT.pack(nbytes, CHUNK))
    for leaf in leaves:
        h.update(leaf)
    return h.digest()


def _flat(data: bytes | bytearray | memoryview) -> memoryview:
    mv = memoryview(data)
    return mv if mv.format == "B" and mv.ndim == 1 else mv.cast("B")


def part_digest(data: bytes | bytearray | memoryview, parallel: bool = True,
                cancel: threading.Event | None = None) -> bytes | None:
    """The digest of one body part. `parallel`: leaves on the hash pool; otherwise in this thread,
    checking `cancel` between leaves (returns None once it is set)."""
    mv = _flat(data)
    pieces = [mv[off:off + CHUNK] for off in range(0, len(mv), CHUNK)]
    if parallel and len(pieces) > 1:
        return _root(len(mv), hash_pool().map(_leaf, pieces))
    leaves = []
    for piece in pieces:
        if cancel is not None and cancel.is_set():
            return None
        leaves.append(_leaf(piece))
    return _root(len(mv), leaves)


class PartHasher:
    """One part's digest, its CHUNK-sized leaves hashed on the pool as they are added (in
    order) while the caller goes on receiving or sending; `digest` waits for them."""

    def __init__(self, nbytes: int):
        self.nbytes = nbytes
        self._leaves: list[concurrent.futures.Future[bytes]] = []
        self._pool = hash_pool() if nbytes > CHUNK else None

    def add(self, piece: memoryview) -> None:
        if self._pool is None:
            done: concurrent.futures.Future[bytes] = concurrent.futures.Future()
            done.set_result(_leaf(piece))
            self._leaves.append(done)
        else:
            self._leaves.append(self._pool.submit(_leaf, piece))

    def digest(self) -> bytes:
        return _root(self.nbytes, (f.result() for f in self._leaves))

    def cancel(self) -> None:
        for f in self._leaves:
            f.cancel()


# ---------------------------------------------------------------------------------------------
# Messages. `TYPE` strings are part of the wire format: never rename them.

@dataclass(frozen=True)
class Register:
    TYPE: ClassVar[str] = "register"
    job_id: str
    node: str
    local_rank: int
    role: Literal["active", "spare"]
    pid: int
    host_addr: str
    transfer_port: int


@dataclass(frozen=True)
class Heartbeat:
    TYPE: ClassVar[str] = "heartbeat"
    rank: int
    generation: int
    step: int
    state: str


@dataclass(frozen=True)
class Stop:
    TYPE: ClassVar[str] = "stop"
    generation: int
    reason: str
    # The lost nodes' addresses: a rank cuts its own connections to them (gloo has no abort,
    # and a crashed or partitioned peer sends no FIN to end a blocked collective).
    lost_addrs: list[str] = field(default_factory=list)


@dataclass(frozen=True)
class Assign:
    TYPE: ClassVar[str] = "assign"
    generation: int
    rank: int
    world_size: int
    members: list[str]
    tasks_per_node: int
    restore_step: int
    # rank -> replica holders of that rank's state, in the order to try them.
    sources: dict[int, list[tuple[str, int]]] = field(default_factory=dict)
    # Data-parallel shards this rank computes each step (after an elastic shrink a survivor
    # also computes the lost ranks' shards) and the world they average over; empty/0: its
    # own rank and world_size.
    data_ranks: list[int] = field(default_factory=list)
    data_world: int = 0
    # rank -> its transfer server (host, port) in this generation: where a rank pushes the
    # replica it keeps on its ring neighbour, and where a replacement finds that neighbour.
    peers: dict[int, tuple[str, int]] = field(default_factory=dict)


@dataclass(frozen=True)
class Resume:
    TYPE: ClassVar[str] = "resume"
    generation: int
    step: int


@dataclass(frozen=True)
class StepDone:
    TYPE: ClassVar[str] = "step_done"
    rank: int
    generation: int
    step: int


@dataclass(frozen=True)
class Ack:
    TYPE: ClassVar[str] = "ack"
    ok: bool
    detail: str = ""


@dataclass(frozen=True)
class Goodbye:
    TYPE: ClassVar[str] = "goodbye"
    reason: str


@dataclass(frozen=True)
class FetchState:
    """Ask a transfer server for `rank`'s snapshot at `step` or later (`slot`: own|replica)."""
    TYPE: ClassVar[str] = "fetch_state"
    rank: int
    step: int
    slot: Literal["own", "replica", "any"] = "any"


@dataclass(frozen=True)
class StateBlob:
    """A snapshot: body part 0 is the layout JSON (`layout_nbytes`), part 1 the `nbytes` of data
    (whose part digest is the snapshot's digest)."""
    TYPE: ClassVar[str] = "state_blob"
    rank: int
    step: int
    nbytes: int
    layout_nbytes: int = 0


@dataclass(frozen=True)
class Holdings:
    """What a rank can restore from, sent right before its `ready` heartbeat after a fault:
    the controller picks a restore step only where every position of the next generation has
    a copy (its own, a ring replica, or disk). `rank` is the position it held (-1: none yet);
    `own`: steps of its own snapshot (the whole state in replicated mode, the shared state in
    jit mode); `rank_own`: steps of its own per-rank state; `replicas`: rank -> steps of that
    rank's state kept here; `error`: the failure that ended its generation; `shard_keys`: see
    below."""
    TYPE: ClassVar[str] = "holdings"
    rank: int
    generation: int
    mode: Literal["jit", "replicated"]
    rank_state: bool
    own: list[int]
    rank_own: list[int]
    replicas: dict[int, list[int]]
    error: str = ""
    # A sharded job's shard key of every rank (sharding.MeshSpec), by rank: ranks with the
    # same key hold the same state. Empty: plain data parallelism (one key).
    shard_keys: list[int] = field(default_factory=list)


Message = Union[Register, Heartbeat, Stop, Assign, Resume, StepDone, Ack, Goodbye,
                FetchState, StateBlob, Holdings]
MESSAGE_TYPES: dict[str, type] = {cls.TYPE: cls for cls in typing.get_args(Message)}
_HINTS: dict[type, dict[str, Any]] = {cls: typing.get_type_hints(cls) for cls in MESSAGE_TYPES.values()}


@dataclass(frozen=True)
class Envelope:
    """A decoded, authenticated frame; `digests` are the verified digests of its body parts."""
    msg: Any
    job_id: str
    seq: int
    body: memoryview = memoryview(b"")
    digests: tuple[bytes, ...] = ()


# ---------------------------------------------------------------------------------------------
# Field validation: JSON only has str keys and lists, so values are coerced back to the
# annotated types, and anything else is a clear error rather than a crash later.

def _coerce(value: Any, tp: Any, where: str) -> Any:
    origin = typing.get_origin(tp)
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ProtocolError(f"field {where} must be an int, got {value!r:.80}")
        return value
    if tp is bool or tp is str:
        if not isinstance(value, tp):
            raise ProtocolError(f"field {where} must be a {tp.__name__}, got {value!r:.80}")
        return value
    if tp is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ProtocolError(f"field {where} must be a number, got {value!r:.80}")
        return float(value)
    if origin is Literal:
        if value not in typing.get_args(tp):
            raise ProtocolError(f"field {where} must be one of {typing.get_args(tp)}, got {value!r:.80}")
        return value
    if origin is list:
        if not isinstance(value, list):
            raise ProtocolError(f"field {where} must be a list, got {value!r:.80}")
        (item,) = typing.get_args(tp)
        return [_coerce(v, item, f"{where}[{i}]") for i, v in enumerate(value)]
    if origin is tuple:
        items = typing.get_args(tp)
        if not isinstance(value, (list, tuple)) or len(value) != len(items):
            raise ProtocolError(f"field {where} must be a {len(items)}-item list, got {value!r:.80}")
        return tuple(_coerce(v, t, f"{where}[{i}]") for i, (v, t) in enumerate(zip(value, items)))
    if origin is dict:
        if not isinstance(value, dict):
            raise ProtocolError(f"field {where} must be an object, got {value!r:.80}")
        ktp, vtp = typing.get_args(tp)
        out = {}
        for k, v in value.items():
            if ktp is int:
                try:
                    key = int(k)
                except (TypeError, ValueError):
                    raise ProtocolError(f"field {where} key {k!r:.40} is not an int") from None
            else:
                key = _coerce(k, ktp, f"{where} key")
            out[key] = _coerce(v, vtp, f"{where}[{k!r:.40}]")
        return out
    raise TypeError(f"unsupported field annotation {tp!r}")  # a bug in this module, not input


def _build(type_name: Any, fields: Any) -> Any:
    cls = MESSAGE_TYPES.get(type_name) if isinstance(type_name, str) else None
    if cls is None:
        raise ProtocolError(f"unknown message type {type_name!r:.80}")
    if not isinstance(fields, dict):
        raise ProtocolError(f"{type_name}: 'fields' must be an object, got {fields!r:.80}")
    hints = _HINTS[cls]
    known = {f.name: f for f in dataclasses.fields(cls)}
    extra = set(fields) - set(known)
    if extra:
        raise ProtocolError(f"{type_name}: unknown fields {sorted(extra)!r:.120}")
    kwargs = {}
    for name, f in known.items():
        if name not in fields:
            if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
                raise ProtocolError(f"{type_name}: missing field {name!r}")
            continue
        kwargs[name] = _coerce(fields[name], hints[name], f"{type_name}.{name}")
    return cls(**kwargs)


def _fields_json(msg: Any) -> dict:
    if type(msg) not in _HINTS:
        raise ProtocolError(f"cannot send {type(msg).__name__}: not a protocol message")
    return dataclasses.asdict(msg)


# ---------------------------------------------------------------------------------------------
# Encoding and decoding of whole frames (pure).

Body = Union[bytes, bytearray, memoryview, Sequence[Union[bytes, bytearray, memoryview]]]


def _mac(secret: bytes, header: bytes, context: bytes) -> bytes:
    # `context` (direction + nonce, fixed length) cannot run into the header: that starts with {.
    return hmac.new(secret, _MAC_DOMAIN + context + header, hashlib.sha256).digest()


def _parts(body: Body) -> list[memoryview]:
    """A single buffer is one part (none when empty); a list is one part per item."""
    if isinstance(body, (bytes, bytearray, memoryview)):
        mv = _flat(body)
        return [mv] if len(mv) else []
    return [_flat(p) for p in body]


def _digests(parts: list[memoryview], known: Sequence[bytes | None] | None) -> list[bytes]:
    if known is not None and len(known) != len(parts):
        raise ProtocolError(f"{len(known)} digests given for {len(parts)} body parts")
    out = []
    for i, p in enumerate(parts):
        d = known[i] if known is not None else None
        out.append(d if d is not None else part_digest(p))  # type: ignore[arg-type]
    return out


def _head(msg: Any, secret: bytes, seq: int, job_id: str, sizes: Sequence[int],
          digests: Sequence[bytes], context: bytes) -> bytes:
    """Length prefix, header and MAC: everything that precedes the body."""
    fields = _fields_json(msg)
    if len(sizes) > MAX_PARTS:
        raise ProtocolError(f"{msg.TYPE}: {len(sizes)} body parts, over the {MAX_PARTS} limit")
    if len(sizes) != len(digests):
        raise ProtocolError(f"{len(digests)} digests given for {len(sizes)} body parts")
    header = json.dumps({"v": VERSION, "type": msg.TYPE, "job": job_id, "seq": seq,
                         "parts": [[n, d.hex()] for n, d in zip(sizes, digests)],
                         "fields": fields}, separators=(",", ":")).encode()
    if len(header) > HEADER_MAX:
        raise ProtocolError(f"{msg.TYPE} header is {len(header)} bytes, over the {HEADER_MAX} limit")
    return _LEN.pack(len(header)) + header + _mac(secret, header, context)


def encode(msg: Any, secret: bytes, seq: int, job_id: str = "", body: Body = b"",
           digests: Sequence[bytes | None] | None = None, *, context: bytes = b"") -> bytes:
    """Serialize `msg` (and an optional body) into one authenticated frame; `digests` may carry
    already known part digests (None entries are computed). `context`: the connection it is
    for (`Channel.send_context`); empty only for a frame that travels on no connection."""
    parts = _parts(body)
    head = _head(msg, secret, seq, job_id, [len(p) for p in parts], _digests(parts, digests),
                 context)
    return b"".join([head, *parts])


@dataclass(frozen=True)
class _Header:
    msg: Any
    job_id: str
    seq: int
    sizes: tuple[int, ...]
    digests: tuple[bytes, ...]

    @property
    def body_len(self) -> int:
        return sum(self.sizes)


def _parse_parts(parts: Any) -> tuple[tuple[int, ...], tuple[bytes, ...]]:
    if not isinstance(parts, list) or len(parts) > MAX_PARTS:
        raise ProtocolError(f"header 'parts' must be a list of at most {MAX_PARTS}, got {parts!r:.80}")
    sizes, digests = [], []
    for p in parts:
        ok = isinstance(p, list) and len(p) == 2 and isinstance(p[0], int) \
            and not isinstance(p[0], bool) and p[0] >= 0 and isinstance(p[1], str)
        try:
            d = bytes.fromhex(p[1]) if ok else b""
        except ValueError:
            d = b""
        if len(d) != DIGEST_LEN:
            raise ProtocolError(f"header part {p!r:.80} is not [nbytes, sha256 hex]")
        sizes.append(p[0])
        digests.append(d)
    return tuple(sizes), tuple(digests)


def _authentic_header(raw: bytes, tag: bytes, secret: bytes, job_id: str | None,
                      max_body: int, context: bytes) -> _Header:
    """Check the MAC first, so nothing unauthenticated is parsed, then the header's contents."""
    if not hmac.compare_digest(_mac(secret, raw, context), tag):
        raise ProtocolError("bad MAC on frame header (wrong secret, tampered frame, or a frame "
                            "replayed from another connection or direction)")
    try:
        obj = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ProtocolError(f"frame header is not JSON: {exc}") from None
    if not isinstance(obj, dict):
        raise ProtocolError(f"frame header must be a JSON object, got {type(obj).__name__}")
    if obj.get("v") != VERSION:
        raise ProtocolError(f"protocol version {obj.get('v')!r:.20} is not {VERSION}")
    job, seq = obj.get("job"), obj.get("seq")
    if not isinstance(job, str):
        raise ProtocolError(f"header 'job' must be a string, got {job!r:.80}")
    if isinstance(seq, bool) or not isinstance(seq, int) or seq < 0:
        raise ProtocolError(f"header 'seq' must be a non-negative int, got {seq!r:.80}")
    sizes, digests = _parse_parts(obj.get("parts"))
    head = _Header(_build(obj.get("type"), obj.get("fields")), job, seq, sizes, digests)
    if head.body_len > max_body:
        raise ProtocolError(f"body of {head.body_len} bytes is over the {max_body}-byte limit")
    if job_id is not None and job != job_id:
        raise ProtocolError(f"frame for job {job!r:.80}, expected job {job_id!r}")
    return head


def _check_len(n: int) -> None:
    if n == 0 or n > HEADER_MAX:
        raise ProtocolError(f"frame header length {n} is outside 1..{HEADER_MAX}")


def _check_digests(head: _Header, got: Sequence[bytes]) -> None:
    for i, (want, have) in enumerate(zip(head.digests, got)):
        if not hmac.compare_digest(want, have):
            raise DigestMismatch(f"{head.msg.TYPE} body part {i} ({head.sizes[i]} bytes) does not "
                                 f"match its digest (corrupted or substituted body)", head.msg)


def decode_frame(frame: bytes | memoryview, secret: bytes, job_id: str | None = None,
                 max_body: int = DEFAULT_MAX_BODY, *, context: bytes = b"") -> Envelope:
    """Parse and authenticate one complete frame; `job_id` given: reject other jobs' frames."""
    mv = _flat(frame)
    if len(mv) < _LEN.size:
        raise ProtocolError(f"truncated frame: {len(mv)} bytes, no length prefix")
    (hlen,) = _LEN.unpack(mv[:_LEN.size])
    _check_len(hlen)
    hend = _LEN.size + hlen + MAC_LEN
    if len(mv) < hend:
        raise ProtocolError(f"truncated frame: header and MAC need {hlen + MAC_LEN} bytes, "
                            f"{len(mv) - _LEN.size} present")
    head = _authentic_header(bytes(mv[_LEN.size:hend - MAC_LEN]), bytes(mv[hend - MAC_LEN:hend]),
                             secret, job_id, max_body, context)
    if len(mv) != hend + head.body_len:
        raise ProtocolError(f"frame is {len(mv)} bytes, its header says {hend + head.body_len}")
    body = mv[hend:]
    offs = [hend + sum(head.sizes[:i]) for i in range(len(head.sizes))]
    _check_digests(head, [part_digest(mv[o:o + n]) for o, n in zip(offs, head.sizes)])
    return Envelope(head.msg, head.job_id, head.seq, body, head.digests)


def decode(frame: bytes | memoryview, secret: bytes, job_id: str | None = None,
           max_body: int = DEFAULT_MAX_BODY, *, context: bytes = b"") -> Any:
    """Parse and authenticate one frame; returns the message."""
    return decode_frame(frame, secret, job_id, max_body, context=context).msg


class Channel:
    """One connection's authentication: the per-job secret, the nonce the server sent when the
    connection opened, the direction of each frame, and sequence numbers (outgoing ones
    increase, incoming ones must increase).

    A frame MACed for one connection and direction fails on every other, so a recording of a
    connection is worth nothing on a new one; within a connection the sequence numbers refuse
    replays and reordering. Open one with `server_hello`/`server_hello_async` (the accepting
    end) or `client_hello` (the connecting end).
    """

    def __init__(self, secret: bytes, job_id: str, nonce: bytes,
                 side: Literal["server", "client"]):
        if len(nonce) != NONCE_BYTES:
            raise ProtocolError(f"connection nonce is {len(nonce)} bytes, not {NONCE_BYTES}")
        self.secret = secret
        self.job_id = job_id
        outgoing, incoming = (TO_CLIENT, TO_SERVER) if side == "server" else (TO_SERVER, TO_CLIENT)
        self.send_context = outgoing + nonce
        self.recv_context = incoming + nonce
        self._next = 0
        self._last_in = -1

    def next_seq(self) -> int:
        self._next += 1
        return self._next

    def accept(self, env: Envelope) -> Envelope:
        if env.seq <= self._last_in:
            raise ProtocolError(f"replayed or reordered frame: seq {env.seq} after {self._last_in}")
        self._last_in = env.seq
        return env

    # Blocking sockets.
    def send(self, sock: socket.socket, msg: Any, body: Body = b"", timeout: float | None = None,
             digests: Sequence[bytes | None] | None = None) -> None:
        send_msg(sock, msg, self.secret, self.next_seq(), self.job_id, body, timeout, digests,
                 context=self.send_context)

    def writer(self, sock: socket.socket, msg: Any, sizes: Sequence[int],
               digests: Sequence[bytes], timeout: float | None = None) -> "FrameWriter":
        return FrameWriter(sock, msg, self.secret, self.next_seq(), self.job_id, sizes, digests,
                           timeout, context=self.send_context)

    def recv(self, sock: socket.socket, timeout: float | None = None,
             max_body: int = DEFAULT_MAX_BODY, body_sink: BodySink | None = None,
             header_timeout: float | None = None) -> Envelope:
        return self.accept(recv_msg(sock, self.secret, self.job_id, timeout, max_body, body_sink,
                                    context=self.recv_context, header_timeout=header_timeout))

    # asyncio streams.
    async def read(self, reader: asyncio.StreamReader,
                   max_body: int = DEFAULT_MAX_BODY) -> Envelope:
        return self.accept(await read_msg(reader, self.secret, self.job_id, max_body,
                                          context=self.recv_context))

    async def write(self, writer: asyncio.StreamWriter, msg: Any, body: Body = b"") -> None:
        await write_msg(writer, msg, self.secret, self.next_seq(), self.job_id, body,
                        context=self.send_context)


def server_hello(sock: socket.socket, secret: bytes, job_id: str,
                 timeout: float | None) -> Channel:
    """The accepting end of a new connection: send it a fresh nonce."""
    nonce = secrets.token_bytes(NONCE_BYTES)
    sock.settimeout(timeout)
    _sendall(sock, nonce, "connection nonce")
    return Channel(secret, job_id, nonce, "server")


def client_hello(sock: socket.socket, secret: bytes, job_id: str,
                 timeout: float | None) -> Channel:
    """The connecting end of a new connection: receive the server's nonce."""
    nonce = memoryview(bytearray(NONCE_BYTES))
    _recv_exact(sock, nonce, None if timeout is None else time.monotonic() + timeout,
                "connection nonce")
    return Channel(secret, job_id, bytes(nonce), "client")


async def server_hello_async(writer: asyncio.StreamWriter, secret: bytes,
                             job_id: str) -> Channel:
    """`server_hello` on an asyncio stream."""
    nonce = secrets.token_bytes(NONCE_BYTES)
    writer.write(nonce)
    await writer.drain()
    return Channel(secret, job_id, nonce, "server")


# ---------------------------------------------------------------------------------------------
# Blocking sockets.

# Given the authenticated message and its body part sizes, return one buffer per part, each
# exactly that size; the body is received straight into them.
BodySink = Callable[[Any, Sequence[int]], Sequence[memoryview]]


def _default_sink(msg: Any, sizes: Sequence[int]) -> list[memoryview]:
    return [memoryview(bytearray(n)) for n in sizes]


def _recv_exact(sock: socket.socket, buf: memoryview, deadline: float | None, what: str,
                clean_eof: bool = False) -> None:
    got = 0
    while got < len(buf):
        if deadline is not None:
            left = deadline - time.monotonic()
            if left <= 0:
                raise ProtocolTimeout(f"timed out receiving {what}")
            sock.settimeout(left)
        try:
            n = sock.recv_into(buf[got:got + CHUNK])
        except (socket.timeout, TimeoutError):
            raise ProtocolTimeout(f"timed out receiving {what}") from None
        except OSError as exc:
            raise ProtocolError(f"connection failed receiving {what}: {exc}") from None
        if n == 0:
            if clean_eof and got == 0:
                raise ConnectionClosed("peer closed the connection")
            raise ProtocolError(f"truncated frame: peer closed during {what} ({got}/{len(buf)} bytes)")
        got += n


def _sendall(sock: socket.socket, data: bytes | memoryview, what: str) -> None:
    try:
        sock.sendall(data)
    except (socket.timeout, TimeoutError):
        raise ProtocolTimeout(f"timed out sending {what}") from None
    except OSError as exc:
        raise ProtocolError(f"connection failed sending {what}: {exc}") from None


class FrameWriter:
    """Streams one frame whose body parts (sizes and digests known up front) are written piece
    by piece from the caller's memory.

    A sender that finds its data bad mid-way closes the socket instead of calling `finish`, and
    the receiver sees a truncated frame.
    """

    def __init__(self, sock: socket.socket, msg: Any, secret: bytes, seq: int, job_id: str,
                 sizes: Sequence[int], digests: Sequence[bytes], timeout: float | None = None,
                 *, context: bytes):
        self._sock, self._msg, self._left = sock, msg, sum(sizes)
        head = _head(msg, secret, seq, job_id, sizes, digests, context)
        sock.settimeout(timeout)
        _sendall(sock, head, msg.TYPE)

    def write(self, data: bytes | memoryview) -> None:
        data = _flat(data)
        if len(data) > self._left:
            raise ProtocolError(f"{self._msg.TYPE}: body longer than the declared length")
        self._left -= len(data)
        for off in range(0, len(data), CHUNK):
            _sendall(self._sock, data[off:off + CHUNK], self._msg.TYPE)

    def finish(self) -> None:
        if self._left:
            raise ProtocolError(f"{self._msg.TYPE}: body {self._left} bytes short of the declared length")


def send_msg(sock: socket.socket, msg: Any, secret: bytes, seq: int, job_id: str = "",
             body: Body = b"", timeout: float | None = None,
             digests: Sequence[bytes | None] | None = None, *, context: bytes) -> None:
    """Send one frame; the body (one buffer, or a list of parts) is never copied whole.
    `digests`: part digests the caller already knows (a snapshot's), None entries are computed."""
    parts = _parts(body)
    known = _digests(parts, digests)
    if sum(len(p) for p in parts) <= CHUNK:
        sock.settimeout(timeout)
        _sendall(sock, encode(msg, secret, seq, job_id, parts, known, context=context), msg.TYPE)
        return
    writer = FrameWriter(sock, msg, secret, seq, job_id, [len(p) for p in parts], known, timeout,
                         context=context)
    for p in parts:
        writer.write(p)
    writer.finish()


def recv_msg(sock: socket.socket, secret: bytes, job_id: str | None = None,
             timeout: float | None = None, max_body: int = DEFAULT_MAX_BODY,
             body_sink: BodySink | None = None, *, context: bytes,
             header_timeout: float | None = None) -> Envelope:
    """Receive one frame within `timeout` seconds and authenticate it. None: no limit of its own,
    each receive waits as long as the socket's own timeout (a server's limit on a stalled
    peer). `header_timeout`: the header, which is not authenticated yet, must have arrived
    within this many seconds (a stranger's bytes are not waited for as long as a peer's body).

    The header is authenticated before `body_sink` is asked for buffers. The body's leaves are
    hashed on the pool while the next ones arrive; the buffers hold unverified bytes if this
    raises, so a caller must only use them after a successful return. A body that does not match
    its digests raises `DigestMismatch` after the whole frame was read.
    """
    now = time.monotonic()
    deadline = None if timeout is None else now + timeout
    head_deadline = deadline if header_timeout is None else now + header_timeout
    stall_limit = sock.gettimeout()
    prefix = memoryview(bytearray(_LEN.size))
    _recv_exact(sock, prefix, head_deadline, "frame length", clean_eof=True)
    (hlen,) = _LEN.unpack(prefix)
    _check_len(hlen)
    hbuf = memoryview(bytearray(hlen + MAC_LEN))
    _recv_exact(sock, hbuf, head_deadline, "frame header")
    head = _authentic_header(bytes(hbuf[:hlen]), bytes(hbuf[hlen:]), secret, job_id, max_body,
                             context)
    if deadline is None:
        sock.settimeout(stall_limit)  # the header deadline set its own
    parts = [_flat(p) for p in (body_sink or _default_sink)(head.msg, head.sizes)]
    if [len(p) for p in parts] != list(head.sizes):
        raise ProtocolError(f"{head.msg.TYPE}: body buffers {[len(p) for p in parts]} do not match "
                            f"the parts {list(head.sizes)}")
    hashers = [PartHasher(len(p)) for p in parts]
    try:
        for part, hasher in zip(parts, hashers):
            for off in range(0, len(part), CHUNK):
                piece = part[off:off + CHUNK]
                _recv_exact(sock, piece, deadline, f"{head.msg.TYPE} body")
                hasher.add(piece)
    except BaseException:
        for hasher in hashers:
            hasher.cancel()
        raise
    _check_digests(head, [h.digest() for h in hashers])
    body = parts[0] if len(parts) == 1 else memoryview(b"")
    return Envelope(head.msg, head.job_id, head.seq, body, head.digests)


# ---------------------------------------------------------------------------------------------
# asyncio streams (the controller side).

async def read_msg(reader: asyncio.StreamReader, secret: bytes, job_id: str | None = None,
                   max_body: int = DEFAULT_MAX_BODY, *, context: bytes) -> Envelope:
    """Read one authenticated frame; wrap in `asyncio.wait_for` for a timeout."""
    try:
        prefix = await reader.readexactly(_LEN.size)
    except asyncio.IncompleteReadError as exc:
        if not exc.partial:
            raise ConnectionClosed("peer closed the connection") from None
        raise ProtocolError("truncated frame: peer closed during frame length") from None
    (hlen,) = _LEN.unpack(prefix)
    _check_len(hlen)
    try:
        raw = await reader.readexactly(hlen + MAC_LEN)
        head = _authentic_header(raw[:hlen], raw[hlen:], secret, job_id, max_body, context)
        body = memoryview(await reader.readexactly(head.body_len))
    except asyncio.IncompleteReadError as exc:
        raise ProtocolError(f"truncated frame: peer closed after {len(exc.partial)} of "
                            f"{exc.expected} bytes") from None
    except (ConnectionError, OSError) as exc:
        raise ProtocolError(f"connection failed while reading a frame: {exc}") from None
    offs = [sum(head.sizes[:i]) for i in range(len(head.sizes))]
    _check_digests(head, [part_digest(body[o:o + n]) for o, n in zip(offs, head.sizes)])
    return Envelope(head.msg, head.job_id, head.seq, body, head.digests)


async def write_msg(writer: asyncio.StreamWriter, msg: Any, secret: bytes, seq: int,
                    job_id: str = "", body: Body = b"", *, context: bytes) -> None:
    writer.write(encode(msg, secret, seq, job_id, body, context=context))
    await writer.drain()


# ---------------------------------------------------------------------------------------------
# The per-job secret file.

SECRET_BYTES = 32


def new_secret_file(path: str | os.PathLike) -> bytes:
    """Create `path` holding a fresh secret (hex), readable by the owner only; returns it.

    O_EXCL: an existing file (maybe planted by someone else) is an error, never reused.
    """
    secret = secrets.token_bytes(SECRET_BYTES)
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:
        raise HpctError(f"secret file '{path}' already exists; remove it or use another path") from None
    with os.fdopen(fd, "w") as f:
        f.write(secret.hex() + "\n")
    return secret


def load_secret(path: str | os.PathLike) -> bytes:
    """Read a secret written by `new_secret_file`, refusing a file others could read."""
    p = Path(path)
    try:
        st = p.stat()
    except FileNotFoundError:
        raise HpctError(f"secret file '{p}' does not exist") from None
    if st.st_mode & (stat.S_IRWXG | stat.S_IRWXO):
        raise HpctError(f"secret file '{p}' has mode {stat.S_IMODE(st.st_mode):04o}; "
                        f"it must not be group/other accessible (chmod 600 '{p}')")
    if st.st_uid != os.getuid():
        raise HpctError(f"secret file '{p}' is owned by uid {st.st_uid}, not by you ({os.getuid()})")
    text = p.read_text().strip()
    try:
        secret = bytes.fromhex(text)
    except ValueError:
        raise HpctError(f"secret file '{p}' does not hold a hex secret") from None
    if len(secret) < 16:
        raise HpctError(f"secret in '{p}' is {len(secret)} bytes; at least 16 are needed")
    return secret
