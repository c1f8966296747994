"""Frames: the wire format, its MAC, and encoding and decoding whole frames (pure: no I/O).

One frame on the wire::

    u32 big-endian header length | header (UTF-8 JSON object) | MAC (32 bytes) | body

    header = {"v": 3, "type": "...", "job": "...", "seq": int,
              "parts": [[nbytes, "digest hex"], ...], "fields": {...}}
    MAC    = HMAC-SHA256(secret, b"hpct2" + direction + nonce + header bytes)

On every connection the server first sends NONCE_BYTES fresh random bytes; every frame on that
connection is MACed with that nonce and its direction (TO_SERVER or TO_CLIENT), see `Channel`.

The MAC covers only the header; the body is a sequence of parts, each bound to the header by its
`part_digest` (a BLAKE3 hash tree, digest.py). An attacker without the secret can forge no header,
so substituting a body means finding a second BLAKE3 preimage: the body stays authenticated
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

import hmac
import json
import struct
from dataclasses import dataclass
from typing import Any, Sequence, Union

from .digest import _flat, part_digest
from .errors import DigestMismatch, HeaderTooLarge, ProtocolError
from .messages import Envelope, _build, _fields_json

# 3: part digests are BLAKE3 trees (2 had SHA-256 ones): a peer of the other version is refused
# by its version, not by a digest mismatch on its first body.
VERSION = 3
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

Body = Union[bytes, bytearray, memoryview, Sequence[Union[bytes, bytearray, memoryview]]]


def _mac(secret: bytes, header: bytes, context: bytes) -> bytes:
    # `context` (direction + nonce, fixed length) cannot run into the header: that starts with {.
    # hmac.digest: the same HMAC-SHA256, in one C call (the controller MACs every frame)
    return hmac.digest(secret, _MAC_DOMAIN + context + header, "sha256")


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
        raise HeaderTooLarge(f"{msg.TYPE} header is {len(header)} bytes, over the {HEADER_MAX} "
                             f"limit")
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
            raise ProtocolError(f"header part {p!r:.80} is not [nbytes, digest hex]")
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
        raise ProtocolError(f"protocol version {obj.get('v')!r:.20} is not {VERSION} (a peer "
                            f"running another hpct-slurm release?)")
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

