"""Frames over asyncio streams (the controller's side). A frame to the controller carries no
large body, so it is read whole and hashed in one go; code outside the protocol goes through a
`Channel` (channel.py)."""
from __future__ import annotations

import asyncio
from typing import Any

from .digest import part_digest
from .errors import ConnectionClosed, ProtocolError
from .messages import Envelope
from .wire import (_LEN, DEFAULT_MAX_BODY, MAC_LEN, Body, _authentic_header, _check_digests,
                   _check_len, encode)


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

