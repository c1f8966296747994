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

The store is three modules, one per side of a connection and one for what passes over it:

- `store_wire`: the frame format and its HMAC tags, the per-job secret (`load_secret`), the op
  and status codes, the frame limits, and `shard_of`;
- `shard_server`: `ShardServer`, one node's shard, and `serve_shard`;
- `store_client`: `RootlessStore`, what a rank uses, and `make_store`.

This module only gives their names under the one name the rest of the code and the tests
import from (`from hpct_slurm.rendezvous.store import ...`).
"""
from __future__ import annotations

from .shard_server import (ACCEPT_BACKOFF_MAX, EVENT_ACCEPT_FAILED, EVENT_AUTH_REJECTED,
                           EVENT_SHARD_STARTED, EVENT_SHARD_STOPPED, LISTEN_BACKLOG,
                           MAX_CONNECTIONS, MAX_STRANGERS, STALL_TIMEOUT_S, ShardServer,
                           ShardStats, serve_shard)
from .store_client import (ABORT_POLL_S, CONNECT_RETRY_FIRST_S, CONNECT_RETRY_MAX_S,
                           RootlessStore, make_store)
from .store_wire import (MAX_FRAME, MIN_SECRET_BYTES, NONCE_BYTES, OP_ADD, OP_CAS, OP_CHECK,
                         OP_DELETE, OP_GET, OP_MULTI_GET, OP_NAMES, OP_NUM_KEYS, OP_SET,
                         OP_STATS, OP_WAIT, PREAUTH_MAX_FRAME, PREAUTH_TIMEOUT_S, SECRET_ENV,
                         ST_BAD_REQUEST, ST_NOT_INT, ST_OK, ST_TIMEOUT, TAG_BYTES, load_secret,
                         shard_of, write_secret)

__all__ = [
    "ACCEPT_BACKOFF_MAX", "EVENT_ACCEPT_FAILED", "EVENT_AUTH_REJECTED", "EVENT_SHARD_STARTED",
    "EVENT_SHARD_STOPPED", "LISTEN_BACKLOG", "MAX_CONNECTIONS", "MAX_STRANGERS",
    "STALL_TIMEOUT_S", "ShardServer", "ShardStats", "serve_shard",
    "ABORT_POLL_S", "CONNECT_RETRY_FIRST_S", "CONNECT_RETRY_MAX_S", "RootlessStore",
    "make_store",
    "MAX_FRAME", "MIN_SECRET_BYTES", "NONCE_BYTES", "OP_ADD", "OP_CAS", "OP_CHECK", "OP_DELETE",
    "OP_GET", "OP_MULTI_GET", "OP_NAMES", "OP_NUM_KEYS", "OP_SET", "OP_STATS", "OP_WAIT",
    "PREAUTH_MAX_FRAME", "PREAUTH_TIMEOUT_S", "SECRET_ENV", "ST_BAD_REQUEST", "ST_NOT_INT",
    "ST_OK", "ST_TIMEOUT", "TAG_BYTES", "load_secret", "shard_of", "write_secret",
]
