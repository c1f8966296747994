"""The rootless store's wire: what a shard server (shard_server.py) and its clients
(store_client.py) both speak, so that neither side holds the other's half of a frame.

TCP, one request in flight per connection:
  on accept, the server sends a 16-byte random nonce;
  each frame is `u32 length | body`;
  request body  = `tag(32) | op(u8) | fields`, tag = HMAC-SHA256(secret, "Q" nonce seq op fields)
  response body = `tag(32) | status(u8) | fields`, tag = HMAC-SHA256(secret, "R" nonce seq ...)
  fields = repeated `u32 length | bytes`; seq counts the requests on the connection, so a
  recorded request replayed on this or any other connection fails authentication.

Nothing is authenticated before a whole frame has arrived, so a connection is a stranger until
its first request passes: its frames may be at most PREAUTH_MAX_FRAME bytes and it must pass
within PREAUTH_TIMEOUT_S (the server drops it then; a client reopens a connection it left
silent that long). A client whose first request is larger sends a small one first.

Also here: the per-job secret both sides key their tags with, the op and status codes, and
`shard_of`, the key-to-shard map every client must compute alike. Nothing here needs torch.
"""
from __future__ import annotations

import hashlib
import hmac
import os
import socket
import struct
import threading
import zlib
from collections.abc import Sequence

from .. import config as C
from .. import protocol

SECRET_ENV = C.SECRET_FILE
MIN_SECRET_BYTES = 16
NONCE_BYTES = 16
TAG_BYTES = 32
MAX_FRAME = 16 << 20
PREAUTH_MAX_FRAME = 64 << 10
PREAUTH_TIMEOUT_S = 10.0

(OP_SET, OP_GET, OP_ADD, OP_CAS, OP_CHECK, OP_WAIT, OP_DELETE, OP_NUM_KEYS, OP_STATS,
 OP_MULTI_GET) = range(1, 11)
OP_NAMES = {OP_SET: "set", OP_GET: "get", OP_ADD: "add", OP_CAS: "compare_set",
            OP_CHECK: "check", OP_WAIT: "wait", OP_DELETE: "delete_key",
            OP_NUM_KEYS: "num_keys", OP_STATS: "stats", OP_MULTI_GET: "multi_get"}
ST_OK, ST_TIMEOUT, ST_NOT_INT, ST_BAD_REQUEST = range(4)

U32 = struct.Struct("!I")
I64 = struct.Struct("!q")
U64 = struct.Struct("!Q")


# ---------------------------------------------------------------- secret


def load_secret(path: str | os.PathLike | None = None) -> bytes:
    """The per-job secret: from `path`, else from the file named by $HPCT_SECRET_FILE. The
    file format and its checks are the control protocol's: one secret per job for both."""
    if path is None:
        path = C.require(None, SECRET_ENV, "the store needs the per-job secret file")
    return protocol.load_secret(path)


write_secret = protocol.new_secret_file


# ---------------------------------------------------------------- framing


def pack_fields(fields: Sequence[bytes]) -> bytes:
    return b"".join(U32.pack(len(f)) + f for f in fields)


def unpack_fields(data: bytes | memoryview) -> list[bytes]:
    out = []
    i = 0
    while i < len(data):
        if i + 4 > len(data):
            raise ValueError("truncated field length")
        (n,) = U32.unpack_from(data, i)
        i += 4
        if i + n > len(data):
            raise ValueError("truncated field")
        out.append(bytes(data[i:i + n]))
        i += n
    return out


def recv_exact(sock: socket.socket, n: int, aborted: threading.Event | None = None) -> bytes:
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


def frame_tag(secret: bytes, direction: bytes, nonce: bytes, seq: int, payload: bytes) -> bytes:
    return hmac.new(secret, direction + nonce + U64.pack(seq) + payload,
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
