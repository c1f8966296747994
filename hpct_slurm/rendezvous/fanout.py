"""Where a many-reader key's readers read it (issue 16): pure, no I/O.

An NCCL communicator's unique id is one key written once by the group's first rank and read by
every member. On the sharded store (store.py `shard_of`) that key lives on one shard, so the
world communicator's id costs its shard one read per rank: at 2,048 hosts x 8 ranks, 16,384
reads on one of 2,048 shards, ~1,000 x the average. Fanning the key out removes the hot spot:
the writer also sets one copy on every shard its readers live on (`copy_key`: a name whose
`shard_of` is that shard), and each reader reads the copy on its own node's shard. The writer
pays one set per reader shard (spread over all shards, one each); every shard then serves only
its own node's readers.

Keys read by at most FANOUT_MIN_READERS ranks (a node-local tensor-parallel group) gain
nothing from copies and stay where `shard_of` puts them.
"""
from __future__ import annotations

import zlib

FANOUT_MIN_READERS = 8


def copy_key(key: str, shard: int, n_shards: int) -> str:
    """The name of `key`'s copy that store.shard_of places on `shard`: a per-rank-style name
    `<key>/fan/<j>` with j chosen so that (crc32(`<key>/fan/`) + j) % n_shards == shard."""
    if not 0 <= shard < n_shards:
        raise ValueError(f"shard {shard} is outside 0..{n_shards - 1}")
    prefix = f"{key}/fan/"
    return f"{prefix}{(shard - zlib.crc32(prefix.encode())) % n_shards}"


def reader_shards(reader_hosts: list[int], n_shards: int) -> list[int]:
    """The shards a key's copies go to: each reader host's own shard (host i runs shard i of
    the generation's member list), each once, in order."""
    return sorted({h % n_shards for h in reader_hosts})


def fans_out(readers: int) -> bool:
    return readers > FANOUT_MIN_READERS
