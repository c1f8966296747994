"""Frames over blocking sockets (the ranks' side: coordination client, transfer server and
pushers): `send_msg` streams a body straight from the caller's memory, `recv_msg` receives it
straight into the caller's buffers, authenticating the header before asking for them and
hashing the body's leaves while the next ones arrive.

These take the secret, sequence number and connection context explicitly; code outside the
protocol goes through a `Channel` (channel.py), which holds them.
"""
from __future__ import annotations

import socket
import time
from typing import Any, Callable, Sequence

from .digest import CHUNK, PartHasher, _flat
from .errors import ConnectionClosed, ConnectionCut, ProtocolError, ProtocolTimeout
from .messages import Envelope
from .wire import (_LEN, DEFAULT_MAX_BODY, MAC_LEN, Body, _authentic_header, _check_digests,
                   _check_len, _digests, _head, _parts, encode)


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
        except (socket.timeout, TimeoutError) as exc:
            if deadline is None and sock.gettimeout() is None:
                # no timeout of ours: the kernel gave up on the peer's host (ETIMEDOUT)
                raise ConnectionCut(f"connection failed receiving {what}: {exc}") from None
            raise ProtocolTimeout(f"timed out receiving {what}") from None
        except OSError as exc:
            raise ConnectionCut(f"connection failed receiving {what}: {exc}") from None
        if n == 0:
            if clean_eof and got == 0:
                raise ConnectionClosed("peer closed the connection")
            raise ConnectionCut(f"truncated frame: peer closed during {what} ({got}/{len(buf)} bytes)")
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
             header_timeout: float | None = None, inline_hash: bool = False) -> Envelope:
    """Receive one frame within `timeout` seconds and authenticate it. None: no limit of its own,
    each receive waits as long as the socket's own timeout (a server's limit on a stalled
    peer). `header_timeout`: the header, which is not authenticated yet, must have arrived
    within this many seconds (a stranger's bytes are not waited for as long as a peer's body).

    The header is authenticated before `body_sink` is asked for buffers. The body's leaves are
    hashed on the pool while the next ones arrive (`inline_hash`: in this thread, as each
    arrives, for one of several streams received at once: digest.PartHasher); the buffers hold
    unverified bytes if this raises, so a caller must only use them after a successful return.
    A body that does not match its digests raises `DigestMismatch` after the whole frame was
    read.
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
    hashers = [PartHasher(len(p), inline_hash) for p in parts]
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

