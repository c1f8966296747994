"""A connection's authentication state, `Channel`, and the hellos that open one.

Everything outside the protocol sends and receives through a Channel: it holds the per-job
secret, the job id, the nonce-and-direction context of each frame and the sequence numbers, so
replay protection lives here and nowhere else.
"""
from __future__ import annotations

import asyncio
import secrets
import socket
import time
from typing import Any, Literal, Sequence

from .aio import read_msg, write_msg
from .blocking import BodySink, FrameWriter, _recv_exact, _sendall, recv_msg, send_msg
from .errors import HeaderTooLarge, ProtocolError
from .messages import Batch, Envelope
from .wire import (DEFAULT_MAX_BODY, NONCE_BYTES, TO_CLIENT, TO_SERVER, Body, decode_frame,
                   encode)


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
        """The sequence number of the next outgoing frame."""
        self._next += 1
        return self._next

    def accept(self, env: Envelope) -> Envelope:
        """`env`, an authentic incoming frame, unless its sequence number does not increase."""
        if env.seq <= self._last_in:
            raise ProtocolError(f"replayed or reordered frame: seq {env.seq} after {self._last_in}")
        self._last_in = env.seq
        return env

    # Whole frames in memory (a frame recorded, forged or relayed by a test or a proxy).
    def encode(self, msg: Any, body: Body = b"",
               digests: Sequence[bytes | None] | None = None) -> bytes:
        """The next outgoing frame, as bytes."""
        return encode(msg, self.secret, self.next_seq(), self.job_id, body, digests,
                      context=self.send_context)

    def encode_batch(self, pairs: list[tuple[int, Any]]) -> list[bytes]:
        """(local rank, message) pairs as the fewest Batch frames whose headers fit: one
        normally; halves, recursively, when they do not (8 full-view Assigns of a 512-rank
        world are ~120 KB). A single message too large for a frame of its own raises."""
        try:
            return [self.encode(Batch.of(pairs))]
        except HeaderTooLarge:
            if len(pairs) < 2:
                raise
        half = len(pairs) // 2
        return self.encode_batch(pairs[:half]) + self.encode_batch(pairs[half:])

    def decode(self, frame: bytes | memoryview, max_body: int = DEFAULT_MAX_BODY) -> Envelope:
        """Authenticate one whole incoming frame and check its sequence number."""
        return self.accept(decode_frame(frame, self.secret, self.job_id, max_body,
                                        context=self.recv_context))

    # Blocking sockets.
    def send(self, sock: socket.socket, msg: Any, body: Body = b"", timeout: float | None = None,
             digests: Sequence[bytes | None] | None = None) -> None:
        send_msg(sock, msg, self.secret, self.next_seq(), self.job_id, body, timeout, digests,
                 context=self.send_context)

    def writer(self, sock: socket.socket, msg: Any, sizes: Sequence[int],
               digests: Sequence[bytes], timeout: float | None = None) -> FrameWriter:
        return FrameWriter(sock, msg, self.secret, self.next_seq(), self.job_id, sizes, digests,
                           timeout, context=self.send_context)

    def recv(self, sock: socket.socket, timeout: float | None = None,
             max_body: int = DEFAULT_MAX_BODY, body_sink: BodySink | None = None,
             header_timeout: float | None = None, inline_hash: bool = False) -> Envelope:
        return self.accept(recv_msg(sock, self.secret, self.job_id, timeout, max_body, body_sink,
                                    context=self.recv_context, header_timeout=header_timeout,
                                    inline_hash=inline_hash))

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


async def client_hello_async(reader: asyncio.StreamReader, secret: bytes,
                             job_id: str) -> Channel:
    """`client_hello` on an asyncio stream; wrap in `asyncio.wait_for` for a timeout."""
    try:
        nonce = await reader.readexactly(NONCE_BYTES)
    except asyncio.IncompleteReadError as exc:
        raise ProtocolError(f"truncated connection nonce: peer closed after {len(exc.partial)} "
                            f"of {NONCE_BYTES} bytes") from None
    return Channel(secret, job_id, nonce, "client")
