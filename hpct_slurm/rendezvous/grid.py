"""Where an all-gather's keys are written and read: a grid of shards (issue 15). Pure, no I/O.

gloo's full-mesh formation is an all-gather through the store: every rank writes its own
address key `<head>/<rank>` once and reads everyone's. With each key only on its home shard
(store.shard_of), every rank reads every shard: N x N store connections for N ranks on N
hosts, each a TCP handshake, a nonce and a teardown on both ends. On 16 loopback ranks that
was the whole difference from TCPStore's 16 connections: the shards' CPU (bench rendezvous).

The grid: the shards are laid out in R ~ sqrt(n) rows of contiguous shards, of near-equal
length. A rank writes its key to every shard of its key's home row (the home shard is one of
them) and reads, from every row, the one shard in its own column (its home's position in its
row; a longer row's last column spreads over a shorter row's shards). That shard holds the
whole row's keys, so one request per row returns them all. Each rank then talks to about
2 sqrt(n) shards instead of n: 7 of 16, 15 of 64, 95 of 2,304. The load stays even: a shard
takes its row's writes and its column's reads, about sqrt(n) each (rows differ in length by
one at most).

Every writer of a gathered key must write it this way, and only its owner writes it (gloo's
addresses: gather.GatherPlan holds exactly those). The key's home shard always has a copy, so
a plain get of one key still finds it where shard_of says.

A member that overwrites another's key on one shard of its row would split the view: the
readers of that shard see another address than the rest. `own_row` says which copies a reader
can hold against their owner's without a new connection (gather.FormationStore compares them).
"""
from __future__ import annotations

import math
from collections.abc import Iterable


class Grid:
    """The rows of `n_shards` shards and who reads what where."""

    def __init__(self, n_shards: int):
        if n_shards < 1:
            raise ValueError(f"a grid needs at least one shard, not {n_shards}")
        n_rows = max(1, round(math.sqrt(n_shards)))
        self.n_shards = n_shards
        self.rows = [range(r * n_shards // n_rows, (r + 1) * n_shards // n_rows)
                     for r in range(n_rows)]
        self._row_of = [r for r, row in enumerate(self.rows) for _ in row]

    def _check(self, shard: int) -> None:
        if not 0 <= shard < self.n_shards:
            raise ValueError(f"shard {shard} is outside 0..{self.n_shards - 1}")

    def write_shards(self, home: int) -> range:
        """The shards a key whose home shard is `home` is written to: its home's row."""
        self._check(home)
        return self.rows[self._row_of[home]]

    def read_shard(self, reader_home: int, key_home: int) -> int:
        """The shard a reader (whose own key's home is `reader_home`) reads a key from: the
        key's row, at the reader's column."""
        self._check(reader_home)
        self._check(key_home)
        reader_row = self._row_of[reader_home]
        column = reader_home - self.rows[reader_row].start
        row = self.rows[self._row_of[key_home]]
        if column >= len(row):
            # A longer row's last column reading a shorter row: the readers of that column
            # (one from each longer row) go to different shards of it, not all to its first.
            column = reader_row + column
        return row.start + column % len(row)

    def own_row(self, reader_home: int, key_homes: Iterable[int]) -> list[int]:
        """Indices into `key_homes` of the keys of this reader's own row homed on another shard
        of it. The reader reads them on its own home shard (`read_shard`), a row copy, and
        their owner's copy is on a shard of its row, which it writes its own key to anyway.

        Every shard is some reader's home in a gathering (rank keys land on consecutive shards,
        store.shard_of, and a generation has a rank on every shard's node), so every row copy
        that any reader reads is also read this way by that shard's own ranks."""
        row = self.write_shards(reader_home)
        return [i for i, home in enumerate(key_homes) if home in row and home != reader_home]

    def reads(self, reader_home: int, key_homes: Iterable[int]) -> dict[int, list[int]]:
        """Indices into `key_homes`, by the shard this reader reads them from."""
        out: dict[int, list[int]] = {}
        for i, home in enumerate(key_homes):
            out.setdefault(self.read_shard(reader_home, home), []).append(i)
        return out
