"""The control-message protocol shared by the controller and the ranks.

One frame on the wire::

    u32 big-endian header length | header (UTF-8 JSON object) | body (body_len bytes) | MAC (32 bytes)

    header = {"v": 1, "type": "...", "job": "...", "seq": int, "body_len": int, "fields": {...}}
    MAC    = HMAC-SHA256(secret, b"hpct1" + header bytes + body)

The length prefix covers only the header (capped at 64 KiB) and the header declares the body's
length: a state blob can exceed the 4 GiB a u32 could describe, and the receiver learns the body
size before reading it so it can `recv_into` a preallocated buffer. The MAC is a trailer so a
sender can stream a large body and hash it chunk by chunk without copying it.

Replay protection: the job id in the header rejects frames from another job (and the secret is
per job anyway); `Channel` rejects a sequence number that does not increase on one connection.
"""
from __future__ import annotations

import asyncio
import dataclasses
import hashlib
import hmac
import json
import os
import secrets
import socket
import stat
import struct
import time
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, ClassVar, Literal, Union

from .errors import HpctError

VERSION = 1
HEADER_MAX = 64 * 1024
DEFAULT_MAX_BODY = 1024 * 1024
MAC_LEN = 32
_LEN = struct.Struct(">I")
_MAC_DOMAIN = b"hpct1"
# Large bodies move through the kernel in slices this big; the MAC update per slice then runs
# while the slice is still warm in cache.
CHUNK = 4 * 1024 * 1024


class ProtocolError(HpctError):
    """A frame that cannot be trusted or understood; the connection should be dropped."""


class ConnectionClosed(ProtocolError):
    """The peer closed the connection cleanly between two frames."""


class ProtocolTimeout(ProtocolError):
    """No complete frame arrived within the timeout."""


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
    """A snapshot: the body is the layout JSON (`layout_nbytes`) followed by `nbytes` of data."""
    TYPE: ClassVar[str] = "state_blob"
    rank: int
    step: int
    checksum: int
    nbytes: int
    layout_nbytes: int = 0


Message = Union[Register, Heartbeat, Stop, Assign, Resume, StepDone, Ack, Goodbye,
                FetchState, StateBlob]
MESSAGE_TYPES: dict[str, type] = {cls.TYPE: cls for cls in typing.get_args(Message)}
_HINTS: dict[type, dict[str, Any]] = {cls: typing.get_type_hints(cls) for cls in MESSAGE_TYPES.values()}


@dataclass(frozen=True)
class Envelope:
    """A decoded, authenticated frame."""
    msg: Any
    job_id: str
    seq: int
    body: memoryview = memoryview(b"")


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

def _mac(secret: bytes, header: bytes) -> "hmac.HMAC":
    mac = hmac.new(secret, _MAC_DOMAIN, hashlib.sha256)
    mac.update(header)
    return mac


def _header_bytes(msg: Any, job_id: str, seq: int, body_len: int) -> bytes:
    fields = _fields_json(msg)
    header = json.dumps({"v": VERSION, "type": msg.TYPE, "job": job_id, "seq": seq,
                         "body_len": body_len, "fields": fields},
                        separators=(",", ":")).encode()
    if len(header) > HEADER_MAX:
        raise ProtocolError(f"{msg.TYPE} header is {len(header)} bytes, over the {HEADER_MAX} limit")
    return header


def encode(msg: Any, secret: bytes, seq: int, job_id: str = "", body: bytes | memoryview = b"") -> bytes:
    """Serialize `msg` (and an optional body) into one authenticated frame."""
    body = memoryview(body).cast("B")
    header = _header_bytes(msg, job_id, seq, len(body))
    mac = _mac(secret, header)
    mac.update(body)
    return b"".join((_LEN.pack(len(header)), header, body, mac.digest()))


@dataclass(frozen=True)
class _Header:
    msg: Any
    job_id: str
    seq: int
    body_len: int


def _parse_header(raw: bytes, max_body: int) -> _Header:
    try:
        obj = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ProtocolError(f"frame header is not JSON: {exc}") from None
    if not isinstance(obj, dict):
        raise ProtocolError(f"frame header must be a JSON object, got {type(obj).__name__}")
    if obj.get("v") != VERSION:
        raise ProtocolError(f"protocol version {obj.get('v')!r:.20} is not {VERSION}")
    job, seq, body_len = obj.get("job"), obj.get("seq"), obj.get("body_len")
    if not isinstance(job, str):
        raise ProtocolError(f"header 'job' must be a string, got {job!r:.80}")
    for name, v in (("seq", seq), ("body_len", body_len)):
        if isinstance(v, bool) or not isinstance(v, int) or v < 0:
            raise ProtocolError(f"header {name!r} must be a non-negative int, got {v!r:.80}")
    if body_len > max_body:
        raise ProtocolError(f"body of {body_len} bytes is over the {max_body}-byte limit")
    return _Header(_build(obj.get("type"), obj.get("fields")), job, seq, body_len)


def _check_len(n: int) -> None:
    if n == 0 or n > HEADER_MAX:
        raise ProtocolError(f"frame header length {n} is outside 1..{HEADER_MAX}")


def _verify(head: _Header, mac: "hmac.HMAC", tag: bytes, job_id: str | None) -> None:
    if not hmac.compare_digest(mac.digest(), tag):
        raise ProtocolError(f"bad MAC on {head.msg.TYPE} frame (wrong secret or tampered frame)")
    if job_id is not None and head.job_id != job_id:
        raise ProtocolError(f"frame for job {head.job_id!r:.80}, expected job {job_id!r}")


def decode_frame(frame: bytes | memoryview, secret: bytes, job_id: str | None = None,
                 max_body: int = DEFAULT_MAX_BODY) -> Envelope:
    """Parse and authenticate one complete frame; `job_id` given: reject other jobs' frames."""
    mv = memoryview(frame).cast("B")
    if len(mv) < _LEN.size:
        raise ProtocolError(f"truncated frame: {len(mv)} bytes, no length prefix")
    (hlen,) = _LEN.unpack(mv[:_LEN.size])
    _check_len(hlen)
    hend = _LEN.size + hlen
    if len(mv) < hend:
        raise ProtocolError(f"truncated frame: header needs {hlen} bytes, {len(mv) - _LEN.size} present")
    header = bytes(mv[_LEN.size:hend])
    head = _parse_header(header, max_body)
    need = hend + head.body_len + MAC_LEN
    if len(mv) != need:
        raise ProtocolError(f"frame is {len(mv)} bytes, its header says {need}")
    body = mv[hend:hend + head.body_len]
    mac = _mac(secret, header)
    mac.update(body)
    _verify(head, mac, bytes(mv[need - MAC_LEN:]), job_id)
    return Envelope(head.msg, head.job_id, head.seq, body)


def decode(frame: bytes | memoryview, secret: bytes, job_id: str | None = None,
           max_body: int = DEFAULT_MAX_BODY) -> Any:
    """Parse and authenticate one frame; returns the message."""
    return decode_frame(frame, secret, job_id, max_body).msg


class Channel:
    """Per-connection sequencing: outgoing numbers increase, incoming ones must increase.

    Sequence numbers start from the wall clock in ns, so a frame recorded on an earlier
    connection of the same job is rejected by a newer channel of the same peers.
    """

    def __init__(self, secret: bytes, job_id: str):
        self.secret = secret
        self.job_id = job_id
        self._next = time.time_ns()
        self._last_in = -1

    def next_seq(self) -> int:
        self._next = max(self._next + 1, time.time_ns())
        return self._next

    def accept(self, env: Envelope) -> Envelope:
        if env.seq <= self._last_in:
            raise ProtocolError(f"replayed or reordered frame: seq {env.seq} after {self._last_in}")
        self._last_in = env.seq
        return env


# ---------------------------------------------------------------------------------------------
# Blocking sockets.

# Given the decoded (not yet authenticated) message and its body length, return buffers whose
# lengths add up to the body length; the body is received straight into them.
BodySink = Callable[[Any, int], list[memoryview]]


def _default_sink(msg: Any, n: int) -> list[memoryview]:
    return [memoryview(bytearray(n))]


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


class FrameWriter:
    """Streams one frame whose body is written piece by piece from the caller's memory.

    The MAC is computed as the pieces go out; a sender that finds its data bad mid-way closes
    the socket instead of calling `finish`, and the receiver sees a truncated frame.
    """

    def __init__(self, sock: socket.socket, msg: Any, secret: bytes, seq: int, job_id: str,
                 body_len: int, timeout: float | None = None):
        self._sock, self._msg, self._left = sock, msg, body_len
        header = _header_bytes(msg, job_id, seq, body_len)
        self._mac = _mac(secret, header)
        sock.settimeout(timeout)
        self._send(_LEN.pack(len(header)) + header)

    def _send(self, data: bytes | memoryview) -> None:
        try:
            self._sock.sendall(data)
        except (socket.timeout, TimeoutError):
            raise ProtocolTimeout(f"timed out sending {self._msg.TYPE}") from None
        except OSError as exc:
            raise ProtocolError(f"connection failed sending {self._msg.TYPE}: {exc}") from None

    def write(self, data: bytes | memoryview) -> None:
        data = memoryview(data).cast("B")
        if len(data) > self._left:
            raise ProtocolError(f"{self._msg.TYPE}: body longer than the declared length")
        self._left -= len(data)
        for off in range(0, len(data), CHUNK):
            piece = data[off:off + CHUNK]
            self._mac.update(piece)
            self._send(piece)

    def finish(self) -> None:
        if self._left:
            raise ProtocolError(f"{self._msg.TYPE}: body {self._left} bytes short of the declared length")
        self._send(self._mac.digest())


def send_msg(sock: socket.socket, msg: Any, secret: bytes, seq: int, job_id: str = "",
             body: bytes | memoryview | list[bytes | memoryview] = b"",
             timeout: float | None = None) -> None:
    """Send one frame; the body (one buffer or a list gathered in order) is never copied whole."""
    parts = [memoryview(p).cast("B") for p in (body if isinstance(body, list) else [body])]
    total = sum(len(p) for p in parts)
    if total <= CHUNK:
        sock.settimeout(timeout)
        frame = encode(msg, secret, seq, job_id, b"".join(parts))
        try:
            sock.sendall(frame)
        except (socket.timeout, TimeoutError):
            raise ProtocolTimeout(f"timed out sending {msg.TYPE}") from None
        except OSError as exc:
            raise ProtocolError(f"connection failed sending {msg.TYPE}: {exc}") from None
        return
    writer = FrameWriter(sock, msg, secret, seq, job_id, total, timeout)
    for p in parts:
        writer.write(p)
    writer.finish()


def recv_msg(sock: socket.socket, secret: bytes, job_id: str | None = None,
             timeout: float | None = None, max_body: int = DEFAULT_MAX_BODY,
             body_sink: BodySink | None = None,
             on_piece: Callable[[int, memoryview], None] | None = None) -> Envelope:
    """Receive one frame within `timeout` seconds (None: wait forever) and authenticate it.

    With `body_sink`, the body lands in the caller's buffers; they hold unauthenticated bytes
    if this raises, so a caller must only use them after a successful return. `on_piece(i, view)`
    sees each received slice of body buffer `i` while it is still in cache (for a checksum).
    """
    deadline = None if timeout is None else time.monotonic() + timeout
    prefix = memoryview(bytearray(_LEN.size))
    _recv_exact(sock, prefix, deadline, "frame length", clean_eof=True)
    (hlen,) = _LEN.unpack(prefix)
    _check_len(hlen)
    hbuf = memoryview(bytearray(hlen))
    _recv_exact(sock, hbuf, deadline, "frame header")
    header = bytes(hbuf)
    head = _parse_header(header, max_body)
    parts = (body_sink or _default_sink)(head.msg, head.body_len)
    if sum(len(p) for p in parts) != head.body_len:
        raise ProtocolError(f"{head.msg.TYPE}: body buffers do not add up to {head.body_len} bytes")
    mac = _mac(secret, header)
    for i, part in enumerate(parts):
        part = part.cast("B") if part.format != "B" else part
        for off in range(0, len(part), CHUNK):
            piece = part[off:off + CHUNK]
            _recv_exact(sock, piece, deadline, f"{head.msg.TYPE} body")
            mac.update(piece)
            if on_piece is not None:
                on_piece(i, piece)
    tag = memoryview(bytearray(MAC_LEN))
    _recv_exact(sock, tag, deadline, "frame MAC")
    _verify(head, mac, bytes(tag), job_id)
    body = parts[0] if len(parts) == 1 else memoryview(b"")
    return Envelope(head.msg, head.job_id, head.seq, body)


# ---------------------------------------------------------------------------------------------
# asyncio streams (the controller side).

async def read_msg(reader: asyncio.StreamReader, secret: bytes, job_id: str | None = None,
                   max_body: int = DEFAULT_MAX_BODY) -> Envelope:
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
        header = await reader.readexactly(hlen)
        head = _parse_header(header, max_body)
        body = await reader.readexactly(head.body_len)
        tag = await reader.readexactly(MAC_LEN)
    except asyncio.IncompleteReadError as exc:
        raise ProtocolError(f"truncated frame: peer closed after {len(exc.partial)} of "
                            f"{exc.expected} bytes") from None
    except (ConnectionError, OSError) as exc:
        raise ProtocolError(f"connection failed while reading a frame: {exc}") from None
    mac = _mac(secret, header)
    mac.update(body)
    _verify(head, mac, tag, job_id)
    return Envelope(head.msg, head.job_id, head.seq, memoryview(body))


async def write_msg(writer: asyncio.StreamWriter, msg: Any, secret: bytes, seq: int,
                    job_id: str = "", body: bytes | memoryview = b"") -> None:
    writer.write(encode(msg, secret, seq, job_id, body))
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
