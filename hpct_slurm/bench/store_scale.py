"""`hpct-slurm bench store_scale`: the sharded store's busiest shard under the key traffic of a
large job's rendezvous, on real shard servers, at 288 and 2,048 hosts (8 ranks each), without
and with fan-out (issue 16).

One `ShardServer` per simulated host (the store's own server code; all in this process, one
thread each, on loopback), driven through real `RootlessStore` clients by WORKERS threads, each
with its own store over all the shards; a simulated rank's requests go through a worker's
store with `local_shard` set to the rank's host. Every shard server counts the requests it
served (`ShardStats.requests`): the headline is each pattern's busiest shard over the average
shard, from those counts. Every phase's writes finish before its reads start, so no request
waits for another worker's (the counts do not depend on the order).

Patterns, with torch 2.13's key names under generation 0's prefix:

* `gloo`: the full-mesh exchange as gather.py makes it: every rank writes `<head><rank>`
  (`hpct/gen0/0//cpu//0/<rank>`) to every shard of its key's grid row and reads every rank's
  key with one multi_get per row, at its own column (`RootlessStore.gather`, grid.py).
  GLOO_READERS ranks (evenly spaced) read and every rank writes: the whole exchange at 2,048
  hosts would be 1.5 million requests. gloo's keys are never declared: both layouts carry
  the same traffic.
* `nccl`: communicator creation, one unique id per communicator, set by its first member and
  read (`get`) by every other: the world (group `0`), one tensor-parallel group per node (8
  ranks; groups `1`..`hosts`), 8 data-parallel groups across the nodes (one rank per node
  each), each id at `nccl_id_prefix(0, <group>)` + `0`.

`plain`: no declarations, every key where `shard_of` puts it. `fanout`: every member's store
declares each communicator's prefix with its members' hosts (`RootlessStore.fan_out`), so the
writer also sets a copy on each of those shards and each reader gets its own shard's copy.
`fanout_spanning` (nccl only): only the communicators that span nodes are declared, the
node-local TP groups' ids stay at their home shards: why fanout.py fans out every group.

Cross-check: `expected` counts the same traffic from `shard_of` and the fan-out table alone
(no sockets); each run records whether the servers' counts equal it, shard for shard.
"""
from __future__ import annotations

import dataclasses
import datetime
import secrets
import statistics
import threading
import time
from collections import Counter
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

from ..errors import HpctError
from ..events import EventLog
from ..rendezvous.fanout import FanoutTable
from .common import plot_bars, write_result
from .scale_sim import raise_fd_limit

TPN = 8
HOSTS = [288, 2048]
GLOO_READERS = 64
# Each worker holds a connection to every shard it talks to (gloo's readers: all of them), and
# both ends live in this process next to 4 descriptors per server: 2 workers at 2,048 shards
# need ~16,400 descriptors; more workers would not be faster anyway (one interpreter runs
# clients and servers).
WORKERS = 2
FDS_PER_SERVER = 4  # listener, selector, wake-up socket pair
GLOO_HEAD = "hpct/gen0/0//cpu//0/"
ID_BYTES = 128  # an ncclUniqueId
LAYOUTS = ("plain", "fanout", "fanout_spanning")
# gloo declares nothing: its fan-out run is there to show that, fanout_spanning would repeat it
RUNS = (("gloo", "plain"), ("gloo", "fanout"),
        ("nccl", "plain"), ("nccl", "fanout"), ("nccl", "fanout_spanning"))


@dataclasses.dataclass(frozen=True)
class Op:
    """One simulated rank's store call: `set` or `get` of keys[0]; `gather` of keys by the
    rank whose own key is `own` (no keys: it writes `own`, over the grid)."""
    host: int
    kind: str
    keys: tuple[str, ...]
    own: str = ""


def nccl_groups(hosts: int, tpn: int = TPN) -> list[tuple[str, list[int]]]:
    """(id key prefix, member ranks) of every communicator, in torch's group-name order."""
    from ..rendezvous.pg import nccl_id_prefix

    world = hosts * tpn
    comms = [list(range(world))]
    comms += [list(range(h * tpn, (h + 1) * tpn)) for h in range(hosts)]       # TP
    comms += [list(range(lr, world, tpn)) for lr in range(tpn)]                 # DP
    return [(nccl_id_prefix(0, str(g)), members) for g, members in enumerate(comms)]


def phases(pattern: str, hosts: int, tpn: int = TPN,
           gloo_readers: int = GLOO_READERS) -> list[list[Op]]:
    """The pattern's calls: its writes, then its reads."""
    world = hosts * tpn
    if pattern == "gloo":
        keys = tuple(f"{GLOO_HEAD}{r}" for r in range(world))
        readers = sorted({i * world // gloo_readers for i in range(min(gloo_readers, world))})
        return [[Op(r // tpn, "gather", (), keys[r]) for r in range(world)],
                [Op(r // tpn, "gather", keys, keys[r]) for r in readers]]
    if pattern == "nccl":
        groups = nccl_groups(hosts, tpn)
        return [[Op(members[0] // tpn, "set", (prefix + "0",)) for prefix, members in groups],
                [Op(r // tpn, "get", (prefix + "0",)) for prefix, members in groups
                 for r in members[1:]]]
    raise ValueError(f"unknown pattern {pattern!r}: gloo or nccl")


def declarations(pattern: str, hosts: int, layout: str,
                 tpn: int = TPN) -> Iterator[tuple[str, list[int]]]:
    """(prefix, member hosts) that every member declares in `layout`: the communicators'."""
    if layout not in LAYOUTS:
        raise ValueError(f"unknown layout {layout!r}: one of {', '.join(LAYOUTS)}")
    if pattern == "nccl" and layout != "plain":
        for prefix, members in nccl_groups(hosts, tpn):
            member_hosts = sorted({r // tpn for r in members})
            if layout == "fanout" or len(member_hosts) > 1:
                yield prefix, member_hosts


def expected(pattern: str, hosts: int, layout: str, tpn: int = TPN,
             gloo_readers: int = GLOO_READERS) -> Counter:
    """Requests per shard, counted from shard_of and the fan-out table alone."""
    from ..rendezvous.grid import Grid
    from ..rendezvous.store import shard_of

    grid = Grid(hosts)
    table = FanoutTable(hosts)
    for prefix, member_hosts in declarations(pattern, hosts, layout, tpn):
        table.declare(prefix, member_hosts)
    per: Counter = Counter({s: 0 for s in range(hosts)})
    for op in (op for phase in phases(pattern, hosts, tpn, gloo_readers) for op in phase):
        if op.kind == "set":
            per.update(shard_of(k, hosts) for k in table.write_keys(op.keys[0]))
        elif op.kind == "gather" and not op.keys:  # a write to every shard of the row
            per.update(grid.write_shards(shard_of(op.own, hosts)))
        elif op.kind == "gather":  # one multi_get per row
            per.update(grid.reads(shard_of(op.own, hosts),
                                  [shard_of(k, hosts) for k in op.keys]).keys())
        else:  # a get
            per.update({shard_of(table.read_key(k, op.host), hosts) for k in op.keys})
    return per


def measure(pattern: str, hosts: int, layout: str, tpn: int = TPN,
            gloo_readers: int = GLOO_READERS, workers: int = WORKERS) -> tuple[Counter, float]:
    """Requests per shard as the shard servers counted them, and the run's wall seconds."""
    from ..rendezvous.store import RootlessStore, ShardServer

    need = hosts * (FDS_PER_SERVER + 2 * workers) + 256
    limit = raise_fd_limit()
    if limit < need:
        raise HpctError(f"{hosts} shard servers and {workers} clients need ~{need} open files; "
                        f"this process may open {limit} (ulimit -Hn): raise the hard limit")
    secret = secrets.token_bytes(32)
    quiet = EventLog()  # no path, no stream: 2,048 servers' start/stop events go nowhere
    servers: list[ShardServer] = []
    stores: list[RootlessStore] = []
    try:
        for _ in range(hosts):
            servers.append(ShardServer("127.0.0.1", 0, secret, events=quiet))
        endpoints = [s.address for s in servers]
        for _ in range(workers):
            store = RootlessStore(endpoints, secret, datetime.timedelta(seconds=120))
            for prefix, member_hosts in declarations(pattern, hosts, layout, tpn):
                store.fan_out(prefix, member_hosts)
            stores.append(store)
        t0 = time.monotonic()
        for phase in phases(pattern, hosts, tpn, gloo_readers):
            _drive(stores, phase)
        wall = time.monotonic() - t0
        return Counter({i: s.stats().requests for i, s in enumerate(servers)}), wall
    finally:
        for store in stores:
            store.close()
        for server in servers:
            server.stop()


def _drive(stores: Sequence[Any], ops: Sequence[Op]) -> None:
    """`ops` spread over one thread per store; the first error is raised here."""
    errors: list[BaseException] = []
    value = b"\x01" * ID_BYTES

    def work(store: Any, mine: Sequence[Op]) -> None:
        try:
            for op in mine:
                store.local_shard = op.host  # this call is that rank's, on its node
                if op.kind == "set":
                    store.set(op.keys[0], value)
                elif op.kind == "get":
                    store.get(op.keys[0])
                else:
                    store.gather(op.own, None if op.keys else value, list(op.keys))
        except BaseException as exc:  # reported by the caller
            errors.append(exc)

    threads = [threading.Thread(target=work, args=(store, ops[i::len(stores)]), daemon=True)
               for i, store in enumerate(stores)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]


def summary(per: Counter) -> dict[str, Any]:
    avg = statistics.fmean(per.values())
    busiest = max(per.values())
    return {"shards": len(per), "requests": sum(per.values()), "busiest": busiest,
            "busiest_shard": max(per, key=per.__getitem__), "average": avg,
            "busiest_over_average": busiest / avg}


def run(out_dir: Path, quick: bool = False) -> dict[str, Any]:
    hosts = [288] if quick else HOSTS
    results: dict[str, Any] = {}
    for n in hosts:
        for pattern, layout in RUNS:
            counts, wall = measure(pattern, n, layout)
            model = expected(pattern, n, layout)
            results[f"{pattern}/{layout}/{n}"] = {
                **summary(counts), "wall_s": round(wall, 2),
                "model_busiest_over_average": summary(model)["busiest_over_average"],
                "servers_match_model": counts == model}
    top = max(hosts)
    ratio = {f"{p}_{lay}": results[f"{p}/{lay}/{top}"]["busiest_over_average"]
             for p, lay in RUNS}
    goal = ratio["nccl_fanout"] <= 2 and ratio["gloo_fanout"] <= 2
    write_result(out_dir, "store_scale", {
        "source": "request counts of real shard servers (ShardStats.requests), one per host",
        "tasks_per_node": TPN, "gloo_readers": GLOO_READERS, "workers": WORKERS,
        "goal": "busiest/average <= 2 for both patterns with fan-out at the largest size",
        "goal_met": goal, "results": results})
    labels = [f"{p} {lay}\n{n}" for n in hosts for p, lay in RUNS]
    plot_bars(Path(out_dir) / "store_scale.png", labels,
              [results[f"{p}/{lay}/{n}"]["busiest_over_average"]
               for n in hosts for p, lay in RUNS],
              "busiest shard / average", "requests per shard server (measured)")
    return {"bench": "store_scale", "hosts": top,
            **{f"{k}_busiest_over_average": round(v, 3) for k, v in ratio.items()},
            "servers_match_model": all(r["servers_match_model"] for r in results.values()),
            "goal_met": goal}
