"""Ranks for tests: store tests on real shard servers (the servers, and ranks as threads of the
test process), and gloo ranks as processes of their own."""
from __future__ import annotations

import contextlib
import multiprocessing as mp
import threading
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

from hpct_slurm.bench.common import free_port
from hpct_slurm.events import EventLog
from hpct_slurm.rendezvous.store import ShardServer

T = TypeVar("T")


@contextlib.contextmanager
def shard_servers(n: int, secret: bytes) -> Iterator[list[ShardServer]]:
    """`n` shard servers on loopback ports, their events dropped; stopped on the way out."""
    servers = [ShardServer("127.0.0.1", 0, secret, events=EventLog()) for _ in range(n)]
    try:
        yield servers
    finally:
        for s in servers:
            s.stop()


def run_ranks(n: int, rank: Callable[[int], T], timeout_s: float = 30) -> dict[int, T]:
    """`rank(r)` for r in 0..n-1, each on its own thread, all at once; their results by rank.
    The first exception a rank raised is raised here, after every thread has ended."""
    out: dict[int, T] = {}
    errors: list[BaseException] = []

    def run(r: int) -> None:
        try:
            out[r] = rank(r)
        except BaseException as exc:  # raised below, in the test's thread
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(r,), daemon=True) for r in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout_s)
    if errors:
        raise errors[0]
    missing = sorted(set(range(n)) - set(out))
    assert not missing, f"ranks {missing} did not finish within {timeout_s:g} s"
    return out


def gloo_processes(world: int, worker: Callable[..., None], timeout_s: float = 120) -> list:
    """`worker(rank, port, queue)` in `world` spawned processes (a gloo group's ranks, whose
    tcp:// rendezvous is 127.0.0.1:port); what each put on the queue, sorted."""
    port = free_port()
    ctx = mp.get_context("spawn")
    q: Any = ctx.Queue()
    procs = [ctx.Process(target=worker, args=(r, port, q), daemon=True) for r in range(world)]
    for p in procs:
        p.start()
    try:
        return sorted(q.get(timeout=timeout_s) for _ in range(world))
    finally:
        for p in procs:
            p.join(30)
            if p.is_alive():
                p.kill()
