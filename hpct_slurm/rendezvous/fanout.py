"""Where a many-reader key's copies go and which copy a reader reads (issue 16): pure, no I/O.

An NCCL communicator's unique id is one key written once by the group's first rank and read by
every member (torch's ProcessGroupNCCL: rank 0 `set(<counter>)`, every other rank
`get(<counter>)`, under the group's store prefix `<group name>//cuda//`). On the sharded store
(store.py `shard_of`) that key lives on one shard, so the world communicator's id costs its
shard one read per rank: at 2,048 hosts x 8 ranks, 16,384 reads on one of 2,048 shards.

Fanning the key out removes the hot spot: the writer also sets one copy on every shard its
readers live on (`copy_key`: a name whose `shard_of` is that shard), and each reader reads the
copy on its own node's shard. The writer pays one set per reader shard, one on each; every
shard then serves only its own node's readers.

The store cannot tell from a key who will read it, so a prefix is *declared*
(`FanoutTable.declare`, `RootlessStore.fan_out`) with its readers' hosts, by code that every
member of the group runs alike (as every member calls torch's `new_group` alike): the writer
and the readers must agree on whether a key is fanned, or a reader would wait for a copy that
is never written. A declared key is `<prefix><counter>` (the counter in decimal, as NCCL's
per-communicator keys are); other keys under the prefix (NCCL's point-to-point keys `a:b`, read
by one peer) stay where `shard_of` puts them. The home key is written too, so a reader off the
declared hosts, `check`, `wait` from a store without the declaration and `delete_key` still see
the key where they would without fan-out.

Every declared group fans out, however few readers it has: a node-local tensor-parallel
group's id costs one more set and is then read on its own node's shard by its other members.
Left at home, each such id sits on the shard the crc32 of its group's name picks (a few groups
on the unluckiest shard): counted with `bench/store_scale.expected` and only the groups that
span nodes declared, the NCCL pattern's busiest/average is 1.73 at 288 hosts and 1.48 at 2,048,
against 1.09 and 1.06 with every group declared.
"""
from __future__ import annotations

import bisect
import zlib
from collections.abc import Iterable

FAN = "/fan/"
_MAX_COUNTER_DIGITS = 9


def copy_key(key: str, shard: int, n_shards: int) -> str:
    """The name of `key`'s copy that store.shard_of places on `shard`: a per-rank-style name
    `<key>/fan/<j>` with j chosen so that (crc32(`<key>/fan/`) + j) % n_shards == shard."""
    if not 0 <= shard < n_shards:
        raise ValueError(f"shard {shard} is outside 0..{n_shards - 1}")
    prefix = f"{key}{FAN}"
    return f"{prefix}{(shard - zlib.crc32(prefix.encode())) % n_shards}"


def reader_shards(reader_hosts: Iterable[int], n_shards: int) -> tuple[int, ...]:
    """The shards a key's copies go to: each reader host's own shard (host i runs shard i of
    the generation's member list), each once, in order."""
    shards = sorted(set(reader_hosts))
    if not shards:
        raise ValueError("a fanned-out key needs at least one reader host")
    if shards[0] < 0 or shards[-1] >= n_shards:
        raise ValueError(f"reader hosts {shards[0]}..{shards[-1]} are outside the "
                         f"{n_shards} shards 0..{n_shards - 1}")
    return tuple(shards)


class FanoutTable:
    """The declared many-reader prefixes of one store (and its clones) -> their reader shards.

    A lookup is one dict probe on the key's head (everything up to its last `/`), so a store
    that checks every key it touches stays O(1) per key with thousands of declared groups.
    """

    def __init__(self, n_shards: int):
        if n_shards < 1:
            raise ValueError(f"{n_shards} shards: need at least one")
        self.n_shards = n_shards
        self._readers: dict[str, tuple[int, ...]] = {}

    def declare(self, prefix: str, reader_hosts: Iterable[int]) -> None:
        """Keys `<prefix><counter>` are written once and read from `reader_hosts`' shards.
        Declaring a prefix again with other readers is an error: the members would disagree
        on where the copies are."""
        if not prefix.endswith("/"):
            raise ValueError(f"fan-out prefix {prefix!r} must end in '/' (keys are "
                             f"<prefix><counter>)")
        shards = reader_shards(reader_hosts, self.n_shards)
        known = self._readers.setdefault(prefix, shards)
        if known != shards:
            raise ValueError(f"fan-out prefix {prefix!r} is already declared with other "
                             f"reader hosts")

    def readers(self, key: str) -> tuple[int, ...] | None:
        """The reader shards of a declared key; None for any other key."""
        if not self._readers:  # gloo's 16,384-key gathers, with nothing declared
            return None
        head, sep, tail = key.rpartition("/")
        if not (sep and tail.isdigit() and len(tail) <= _MAX_COUNTER_DIGITS):
            return None
        return self._readers.get(head + sep)

    def write_keys(self, key: str) -> list[str]:
        """What a set of `key` writes: the key itself, then one copy per reader shard."""
        shards = self.readers(key)
        if shards is None:
            return [key]
        return [key] + [copy_key(key, s, self.n_shards) for s in shards]

    def read_key(self, key: str, local_shard: int | None) -> str:
        """What a reader on `local_shard` reads for `key`: its own shard's copy when the key is
        declared and read from that shard, else the key itself."""
        shards = self.readers(key)
        if shards is None or local_shard is None:
            return key
        at = bisect.bisect_left(shards, local_shard)  # sorted: O(log n) with 2,048 readers
        if at == len(shards) or shards[at] != local_shard:
            return key
        return copy_key(key, local_shard, self.n_shards)
