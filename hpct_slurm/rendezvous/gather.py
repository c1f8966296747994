"""One round trip instead of 2N: gloo's address exchange, gathered in a single all-gather.

gloo (torch 2.13) forms its full mesh by having every rank `set("<head>/<own rank>")` and then,
for every rank i in turn, `wait(["<head>/i"])` and `get("<head>/i")`: 2N sequential store
round trips per rank, each one a wake-up of a Python shard server on another host. It never
calls `multi_get`, even for a store that has one. Measured on 64 loopback ranks: 129 store
calls per rank took 2.6 s of the 3.2 s init.

`FormationStore` wraps the store during `init_process_group` only. This rank's set of its own
key `<head>/<rank>` makes `<head>/` a *gather head* and is held back a moment; the first wait
or get under it sends that set and a read of `<head>/0 .. <head>/N-1` in one round trip
(`RootlessStore.gather`: the set to every shard of its grid row, one multi_get per row, every
shard asked at once; grid.py) and answers gloo's 2N calls from the reply. Any other call
sends a held set first, to its grid row too; everything else goes to the store unchanged.

Lazy gloo (TORCH_GLOO_LAZY_INIT=1, opt-in here: HPCT_GLOO_LAZY_INIT in config.py) only
sets its key in init and reads a peer's key when it first uses the pair to that peer, after
init: a `wait([k])` then a `get(k)`. pg.init then calls `finish(barrier=True)`: the held set
goes out with the read of its head after all (`gather_unread`), which waits for every
rank's key under the store's (init) timeout, the formation's barrier: lazy gloo's own init
waits for nobody, and its pairs get only a short timeout (pg._pair_timeout). The values are
kept, and a pair's first wait-then-get is answered from them, no round trip (`late_read`).
Without the barrier such a wait is answered by one `get` that itself waits for the key.

A split view fails the formation (SplitViewError): a member that overwrote another rank's key
on one shard of its row would hand the readers of that shard another address than everyone
else. Each rank holds the copies of its own row's keys it read on its own home shard against
their owners' copies (grid.Grid.own_row): one more multi_get, a second round trip (the keys
exist by then, so nothing waits) on shards it already wrote its key to, so no new connection;
its own key is held against what it wrote. Reading every key's owner's copy would have every
rank talk to every shard, what the grid exists to avoid; and this much already covers every
copy anyone reads, since every shard is some rank's home. What it does not see: a copy
overwritten after the ranks of its shard compared it.

Why only heads this rank has set its own key under: those keys are, by that pattern, one per
rank and each written once before anybody reads them (gloo's addresses). A key that merely
ends in a number (NCCL's unique-id key `<head>/0`, set by rank 0 alone) must not make a rank
wait for `<head>/1 .. <head>/N-1`, which nobody will ever set. A cached value is handed out
once (the get after the wait); a second get goes to the store.
"""
from __future__ import annotations

import datetime
import re
import threading
import typing
from collections.abc import Callable, Sequence

import torch.distributed as dist

from .grid import Grid
from .store_wire import shard_of

_MAX_RANK_DIGITS = 9
# gloo's own heads end in its device prefix, e.g. "hpct/gen3/0//cpu//0/". Only a set under such a
# head is held back: gloo waits for the keys right after it. Any other own-rank key (a future
# fan-out copy `<key>/fan/<j>`, a script's own) goes out at once, so that nothing this rank
# then blocks on can wait for a set still held here; its head is still gathered.
_GLOO_HEAD = re.compile(r"//[a-z]+//[0-9]+/$")
# (this rank's held set or None, the keys) -> the keys' values
Fetch = Callable[[tuple[str, bytes] | None, list[str]], Sequence[bytes]]


class SplitViewError(dist.DistStoreError):
    """Two copies of a gathered key disagree: the formation is refused, not formed on it."""


def split_rank_key(key: str) -> tuple[str, int] | None:
    """`("<head>/", i)` for a key `<head>/<i>` (i a decimal number), else None."""
    head, sep, tail = key.rpartition("/")
    if sep and tail.isdigit() and len(tail) <= _MAX_RANK_DIGITS:
        return head + sep, int(tail)
    return None


class GatherPlan:
    """Which keys to fetch together, and the fetched values not handed out yet. Pure logic
    (the fetch is passed in) shared by a FormationStore and its clones."""

    def __init__(self, rank: int, world_size: int):
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} is not in 0..{world_size - 1}")
        self.rank = rank
        self.world_size = world_size
        self.active = True
        self.heads: set[str] = set()
        self.fetched: set[str] = set()
        self.cache: dict[str, bytes] = {}
        self.held: tuple[str, bytes] | None = None  # this rank's own key, not sent yet
        # What this rank wrote under its last gloo head: its pairs' addresses, which a STOP
        # in the connect phase reads to wake them (gloo_wake.py).
        self.own_gloo_value: bytes | None = None
        # ... and what every rank wrote there, read back: the listeners this rank's own pairs
        # connect to, whose connects in flight the STOP resets (gloo_wake.reset_connects).
        self.gloo_values: tuple[bytes, ...] = ()
        # Heads whose own key was held: written over the shard grid, and read back that way.
        self.grid_heads: set[str] = set()
        self.formation_heads: frozenset[str] = frozenset()  # set by finish()
        # Peers' keys gathered at the end of a lazy formation, for lazy gloo's first reads.
        self.late_values: dict[str, bytes] = {}
        self.fetches = 0
        self._lock = threading.Lock()

    def hold(self, key: str, value: bytes) -> bool:
        """This rank sets `key`: True if it is this rank's own key under a new head, held
        back to go out with that head's read (the caller sends nothing now)."""
        parts = split_rank_key(key)
        if not self.active or parts is None or parts[1] != self.rank:
            return False
        with self._lock:
            if self.held is not None or parts[0] in self.heads:
                return False
            self.heads.add(parts[0])
            if not _GLOO_HEAD.search(parts[0]):
                return False
            self.held = (key, value)
            self.own_gloo_value = value
            self.grid_heads.add(parts[0])
            return True

    def gridded(self, key: str) -> bool:
        """Whether `key`'s head is one whose keys go over the shard grid."""
        parts = split_rank_key(key)
        return parts is not None and parts[0] in self.grid_heads

    def release(self) -> tuple[str, bytes] | None:
        """The held set, which the caller must now send (before any other request)."""
        with self._lock:
            held, self.held = self.held, None
            return held

    def _covered(self, key: str) -> str | None:
        parts = split_rank_key(key)
        if not self.active or parts is None:
            return None
        head, index = parts
        if head not in self.heads or index >= self.world_size:
            return None
        return head

    def _ensure(self, head: str, fetch: Fetch) -> None:
        if head in self.fetched:
            return
        keys = [f"{head}{i}" for i in range(self.world_size)]
        held = self.held if self.held is not None and self.held[0].startswith(head) else None
        values = fetch(held, keys)
        if held is not None:
            self.held = None
        if len(values) != len(keys):
            raise dist.DistStoreError(f"multi_get of {len(keys)} keys under '{head}' returned "
                                      f"{len(values)} values")
        self.cache.update(zip(keys, values))
        if _GLOO_HEAD.search(head):
            self.gloo_values = tuple(values)
        self.fetched.add(head)
        self.fetches += 1

    def holds(self, key: str, fetch: Fetch) -> bool:
        """Whether `key` is known to exist (fetching its head's keys first if they are due)."""
        with self._lock:
            head = self._covered(key)
            if head is None:
                return False
            self._ensure(head, fetch)
            return key in self.cache

    def take(self, key: str, fetch: Fetch) -> bytes | None:
        """`key`'s fetched value, handed out once; None: ask the store."""
        with self._lock:
            head = self._covered(key)
            if head is None:
                return None
            self._ensure(head, fetch)
            return self.cache.pop(key, None)

    def gather_unread(self, fetch: Fetch) -> None:
        """Fetch every gloo head this rank set its own key under but gloo never read (lazy
        gloo reads no key in init): the formation's barrier, every rank's key waited for
        under the store's (init) timeout, and the values kept for the pairs' first reads."""
        with self._lock:
            for head in sorted(self.heads - self.fetched):
                if _GLOO_HEAD.search(head):
                    self._ensure(head, fetch)

    def finish(self) -> None:
        """The formation is over: pass every call through from now on, except lazy gloo's
        first read of a peer's key under one of the formation's heads (`late_read`), which a
        value gathered by gather_unread answers."""
        with self._lock:
            self.active = False
            self.formation_heads = frozenset(self.heads)
            self.late_values = {k: v for k, v in self.cache.items() if self.late_read(k)}
            self.heads.clear()
            self.cache.clear()

    def late_read(self, key: str) -> bool:
        """After the formation: `key` is a peer's key under a head this rank set its own
        key under in init (lazy gloo connecting a pair on first use)."""
        parts = split_rank_key(key)
        return (not self.active and parts is not None and parts[0] in self.formation_heads
                and parts[1] < self.world_size and parts[1] != self.rank)


class FormationStore(dist.Store):
    """`inner` with gloo's address exchange gathered (see the module doc). `inner` must have
    `multi_get`, `set_then_multi_get` and `gather` that wait for every key, as
    RootlessStore's do."""

    def __init__(self, inner: dist.Store, rank: int, world_size: int,
                 plan: GatherPlan | None = None):
        super().__init__()
        self.inner = inner
        self.plan = plan or GatherPlan(rank, world_size)
        # Peer keys read by a late wait, for the get that follows it (see late_read).
        self._late: dict[str, bytes] = {}
        super().set_timeout(inner.timeout)

    def _fetch(self, held: tuple[str, bytes] | None, keys: list[str]) -> list[bytes]:
        # A held key is gloo's address, and every rank holds its own alike: it goes out
        # over the shard grid (grid.py), and its head is read back the same way.
        own = keys[self.plan.rank]
        if self.plan.gridded(own):
            values = self.inner.gather(own, None if held is None else held[1], keys)
            self._check_view(keys, values, held)
            return values
        if held is None:
            return self.inner.multi_get(keys)
        return self.inner.set_then_multi_get(held[0], held[1], keys)

    def _check_view(self, keys: list[str], values: Sequence[bytes],
                    held: tuple[str, bytes] | None) -> None:
        """SplitViewError where a row copy read by `gather` is not its owner's copy (see the
        module doc), or this rank's own key is not what it wrote."""
        rank = self.plan.rank
        if held is not None and values[rank] != held[1]:
            self._split(keys[rank], "this rank's own: its home shard holds another value than "
                                    "this rank wrote")
        endpoints = getattr(self.inner, "endpoints", None)
        if endpoints is None:
            return  # a wrapper that does not say where its shards are: no grid to check
        n = len(endpoints)
        homes = [shard_of(k, n) for k in keys]
        check = Grid(n).own_row(homes[rank], homes)
        if not check:
            return
        owners = self.inner.multi_get([keys[i] for i in check])
        for i, owner in zip(check, owners):
            if owner != values[i]:
                self._split(keys[i], f"its copy on shard {homes[rank]}, which this rank read, "
                                     f"differs from its owner's copy on its home shard "
                                     f"{homes[i]}")

    @staticmethod
    def _split(key: str, what: str) -> typing.NoReturn:
        raise SplitViewError(
            f"split view of gathered key '{key}' ({what}): a member wrote it on some shards "
            f"of its row only, or two processes claim that rank. The group is not formed on "
            f"addresses that not every rank sees alike")

    def _send_held(self) -> None:
        held = self.plan.release()
        if held is not None:
            self.inner.gather(held[0], held[1], [])  # to its grid row, as the peers read it

    def finish(self, barrier: bool = False) -> None:
        """The formation is over: with `barrier`, gather what lazy gloo set but never read
        (GatherPlan.gather_unread: waits for every rank); send a set still held; then pass
        everything through."""
        if barrier:
            self.plan.gather_unread(self._fetch)
        self._send_held()
        self.plan.finish()

    def set(self, key: str, value: str | bytes) -> None:
        if not self.plan.hold(key, value if isinstance(value, bytes) else value.encode()):
            self._send_held()
            self.inner.set(key, value)

    def get(self, key: str) -> bytes:
        late = self._late.pop(key, None)
        if late is not None:
            return late
        value = self.plan.take(key, self._fetch)
        if value is not None:
            return value
        self._send_held()
        return self.inner.get(key)

    def wait(self, keys: list[str],
             timeout: datetime.timedelta | None = None) -> None:
        if keys and all(self.plan.holds(k, self._fetch) for k in keys):
            return
        gathered = self.plan.late_values.pop(keys[0], None) if len(keys) == 1 else None
        if gathered is not None:
            self._late[keys[0]] = gathered
            return
        if len(keys) == 1 and self.plan.late_read(keys[0]) and hasattr(self.inner, "get_within"):
            # Lazy gloo's first use of a pair: fetch the value now, the get follows at once.
            self._late[keys[0]] = self.inner.get_within(
                keys[0], self.timeout if timeout is None else timeout)
            return
        self._send_held()
        if timeout is None:
            self.inner.wait(keys)
        else:
            self.inner.wait(keys, timeout)

    def check(self, keys: list[str]) -> bool:
        self._send_held()
        return self.inner.check(keys)

    def add(self, key: str, value: int) -> int:
        self._send_held()
        return self.inner.add(key, value)

    def compare_set(self, key: str, expected_value: str | bytes,
                    desired_value: str | bytes) -> bytes:
        self._send_held()
        return self.inner.compare_set(key, expected_value, desired_value)

    def delete_key(self, key: str) -> bool:
        self._send_held()
        return self.inner.delete_key(key)

    def num_keys(self) -> int:
        self._send_held()
        return self.inner.num_keys()

    def multi_get(self, keys: list[str]) -> list[bytes]:
        self._send_held()
        return self.inner.multi_get(keys)

    def set_timeout(self, timeout: datetime.timedelta) -> None:
        super().set_timeout(timeout)
        self.inner.set_timeout(timeout)

    def clone(self) -> "FormationStore":
        clone = FormationStore(self.inner.clone(), self.plan.rank, self.plan.world_size,
                               self.plan)
        clone._late = self._late  # a wait on one and the get on another still pair up
        return clone


def wraps(store: dist.Store) -> bool:
    """Whether `store`'s multi_get is worth gathering through: one request per shard, all at
    once (RootlessStore). Stock TCPStore stays as torch uses it (it is the baseline)."""
    return bool(getattr(store, "batched_multi_get", False))
