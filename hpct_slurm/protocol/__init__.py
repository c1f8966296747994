"""The control-message protocol shared by the controller, the ranks and their transfer servers.

One frame on the wire::

    u32 big-endian header length | header (UTF-8 JSON object) | MAC (32 bytes) | body

    header = {"v": 3, "type": "...", "job": "...", "seq": int,
              "parts": [[nbytes, "digest hex"], ...], "fields": {...}}
    MAC    = HMAC-SHA256(secret, b"hpct2" + direction + nonce + header bytes)

By concern (each module says more):

- `wire`: the frame format, its MAC and limits; encoding and decoding whole frames (pure).
- `digest`: the part digests that bind a body to its authenticated header, hashed on a pool.
- `messages`: the message dataclasses and their checked reconstruction from JSON.
- `errors`: `ProtocolError` and its kinds.
- `blocking`: frames over blocking sockets, bodies streamed from and into the caller's memory.
- `aio`: frames over asyncio streams (the controller).
- `channel`: `Channel`, one connection's secret, nonce, direction and sequence numbers, and the
  hellos that open one. Code outside this package sends and receives through a Channel.
- `secret`: the per-job secret file.

`from hpct_slurm import protocol as P` gives all of their public names as `P.<name>`.
"""
from __future__ import annotations

from .aio import read_msg, write_msg
from .blocking import BodySink, FrameWriter, recv_msg, send_msg
from .channel import (Channel, client_hello, client_hello_async, server_hello,
                      server_hello_async)
from .digest import (CHUNK, PartHasher, hash_pool, hash_workers, leaf_digests, part_digest,
                     range_digest)
from .errors import (ConnectionClosed, ConnectionCut, DigestMismatch, HeaderTooLarge,
                     ProtocolError, ProtocolTimeout)
from .messages import (MESSAGE_TYPES, Ack, Assign, Batch, Envelope, FetchState, Goodbye,
                       Heartbeat, Holdings, Left, Message, Register, RelayHello, Resume,
                       SCRIPT_ERROR, StateBlob, StepDone, Stop)
from .secret import SECRET_BYTES, load_secret, new_secret_file
from .wire import (DEFAULT_MAX_BODY, DIGEST_LEN, HEADER_MAX, MAC_LEN, MAX_PARTS, NONCE_BYTES,
                   TO_CLIENT, TO_SERVER, VERSION, Body, decode, decode_frame, encode)

__all__ = [
    "read_msg", "write_msg",
    "BodySink", "FrameWriter", "recv_msg", "send_msg",
    "Channel", "client_hello", "client_hello_async", "server_hello", "server_hello_async",
    "CHUNK", "PartHasher", "hash_pool", "hash_workers", "part_digest", "leaf_digests",
    "range_digest",
    "ConnectionClosed", "ConnectionCut", "DigestMismatch", "HeaderTooLarge", "ProtocolError", "ProtocolTimeout",
    "MESSAGE_TYPES", "Ack", "Assign", "Envelope", "FetchState", "Goodbye", "Heartbeat",
    "Holdings", "Message", "Register", "Resume", "StateBlob", "StepDone", "Stop",
    "Batch", "Left", "RelayHello", "SCRIPT_ERROR",
    "SECRET_BYTES", "load_secret", "new_secret_file",
    "DEFAULT_MAX_BODY", "DIGEST_LEN", "HEADER_MAX", "MAC_LEN", "MAX_PARTS", "NONCE_BYTES",
    "TO_CLIENT", "TO_SERVER", "VERSION", "Body", "decode", "decode_frame", "encode",
]
