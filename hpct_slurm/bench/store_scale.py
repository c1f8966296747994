"""`hpct-slurm bench store_scale`: the sharded store's busiest shard under the key traffic of
a large job's rendezvous, at 288 and 2,048 hosts (8 ranks each), without and with fan-out.

A request-count model over the store's real placement (`store.shard_of`) and the fan-out's
copy names (`rendezvous/fanout.py`), not a run of shard servers: every set, get and wait is
one request on the shard its key maps to, and the result is each pattern's busiest shard over
the average shard. Patterns:

* `gloo`: full-mesh rendezvous: every rank sets `<prefix>/<rank>` and reads every other
  rank's key (per-rank keys land on consecutive shards already);
* `nccl`: communicator creation: one unique id per communicator, written once by its first
  rank and read by every member: the world, one tensor-parallel group per node (8 ranks), 8
  data-parallel groups across the nodes (one rank per node each).

`plain` places every key where shard_of does; `fanout` gives communicator ids with more than
FANOUT_MIN_READERS readers a copy on each reader's own shard (the writer's extra sets count
on the shards they go to); gloo's per-rank keys are spread already and stay as they are.
"""
from __future__ import annotations

import statistics
from collections import Counter
from pathlib import Path
from typing import Any, Iterator

from ..rendezvous.fanout import copy_key, fans_out, reader_shards
from .common import write_result

TPN = 8
HOSTS = [288, 2048]


def _shard_of(key: str, n: int) -> int:
    from ..rendezvous.store import shard_of  # imports torch.distributed
    return shard_of(key, n)


def groups(pattern: str, hosts: int, tpn: int = TPN) -> Iterator[tuple[str, list[int]]]:
    """(key, member ranks) of every many-reader key of `pattern`; gloo's are per-rank keys."""
    world = hosts * tpn
    if pattern == "gloo":
        for r in range(world):
            yield f"hpct/gen0/0//cpu//0/{r}", list(range(world))
    elif pattern == "nccl":
        counter = 0
        comms = [list(range(world))]
        comms += [list(range(h * tpn, (h + 1) * tpn)) for h in range(hosts)]       # TP
        comms += [list(range(lr, world, tpn)) for lr in range(tpn)]                 # DP
        for members in comms:
            yield f"hpct/gen0/nccl/{counter}", members
            counter += 1
    else:
        raise ValueError(f"unknown pattern {pattern!r}: gloo or nccl")


def load(pattern: str, hosts: int, layout: str, tpn: int = TPN) -> Counter:
    """Requests per shard (one shard per host)."""
    per: Counter = Counter({s: 0 for s in range(hosts)})
    for key, members in groups(pattern, hosts, tpn):
        readers = members[1:] if pattern == "nccl" else members  # nccl: the writer is first
        home = _shard_of(key, hosts)
        per[home] += 1  # the set
        # gloo's per-rank keys are spread by shard_of already: only communicator ids fan out
        if layout == "fanout" and pattern == "nccl" and fans_out(len(readers)):
            hosts_of = [r // tpn for r in readers]
            for s in reader_shards(hosts_of, hosts):
                per[_shard_of(copy_key(key, s, hosts), hosts)] += 1  # the writer's copy
            for r in readers:
                per[r // tpn % hosts] += 1  # each reader reads its own shard's copy
        else:
            if pattern == "gloo":
                per[home] += len(readers) - 1  # every other rank reads it
            else:
                per[home] += len(readers)
    return per


def summary(per: Counter) -> dict[str, Any]:
    avg = statistics.fmean(per.values())
    busiest = max(per.values())
    return {"shards": len(per), "requests": sum(per.values()), "busiest": busiest,
            "average": avg, "busiest_over_average": busiest / avg}


def run(out_dir: Path, quick: bool = False) -> dict[str, Any]:
    hosts = [288] if quick else HOSTS
    results: dict[str, Any] = {}
    for n in hosts:
        for pattern in ("gloo", "nccl"):
            for layout in ("plain", "fanout"):
                results[f"{pattern}/{layout}/{n}"] = summary(load(pattern, n, layout))
    write_result(out_dir, "store_scale", {"model": "request count per shard (store.shard_of)",
                                          "tasks_per_node": TPN, "results": results})
    top = max(hosts)
    return {"hosts": top,
            "nccl_plain_busiest_over_average": results[f"nccl/plain/{top}"]["busiest_over_average"],
            "nccl_fanout_busiest_over_average": results[f"nccl/fanout/{top}"]["busiest_over_average"],
            "gloo_fanout_busiest_over_average": results[f"gloo/fanout/{top}"]["busiest_over_average"]}
