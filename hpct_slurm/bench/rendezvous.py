"""Rendezvous load: rootless (sharded) store vs TCPStore, N loopback processes.

Each process plays one node with one task. For every N the same processes form a gloo group
(a fresh generation each time: new ports, new key prefix), run one allreduce, and report; the
two store kinds take turns, each first in every other round, so both see the same load.
Below 16 ranks a size gets 16 // N times the formations asked for (`formations`): they take
milliseconds, and a small sample's median moved by more than the stores differ.
Measured per run:
  init_s      from a common start barrier (the earliest rank to leave it) to the end of the
              first allreduce (the slowest rank): starting this node's shard server, the
              store, init_process_group, one allreduce. Both stores run gloo the same way,
              as a job does: by default gloo connects its full mesh in init; with
              HPCT_GLOO_LAZY_INIT=1 (opt-in) it connects a pair on its first use, so the
              ring's 2 pairs per rank connect during that allreduce, and a later barrier or
              broadcast connects its own pairs then (not timed here);
  phases      per rank: its shard server's start, its store client, init_process_group, the
              allreduce, and the CPU seconds its main thread and its whole process spent in
              them; the results keep each phase's slowest rank (median over runs), how far
              apart the ranks left the start barrier, and the CPU of all ranks together;
  load        per host, connections accepted + requests served by its store server.
Where each number comes from:
  requests    every rank's store (either kind) is wrapped in the same counting Store proxy,
              which counts the requests the formation makes through it (measured, client
              side; rootless: gloo's 2N waits/gets reach it as one multi_get, see
              rendezvous/gather.py);
  rootless    every shard server counts its own accepted connections and requests (measured,
              server side; a multi-key wait/check is one request per shard it touches);
  tcpstore    connections at the root: ESTABLISHED sockets on MASTER_PORT in /proc/net/tcp
              on rank 0 after the formation (measured); requests at the root: the sum of every
              rank's counted requests (measured; TCPStore's own per-connection handshake is
              not seen by the proxy, so this is a lower bound).
  tcpstore busiest/avg is structural, not a measurement: TCPStore has one server, on the
              root's host, and every request goes to it; no other host serves anything, so
              busiest/avg = root / (root / N) = N whatever the root's measured load is.
"""
from __future__ import annotations

import datetime
import multiprocessing as mp
import random
import secrets
import statistics
import time
import traceback
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

from .. import config as C
from .common import write_result

NAME = "rendezvous"
INIT_TIMEOUT_S = 120.0
MEM_PER_RANK = 256 << 20  # RSS of one process with torch imported: 220 MiB, much of it shared


def _node_environ(job_id: int, node: str, nodes: list[str]) -> dict[str, str]:
    return {"SLURM_JOB_ID": str(job_id), "SLURM_JOB_NODELIST": ",".join(nodes),
            "SLURMD_NODENAME": node, "SLURM_STEP_NODELIST": node, "SLURM_PROCID": "0",
            "SLURM_LOCALID": "0", "SLURM_NODEID": "0", "SLURM_NTASKS": "1",
            "SLURM_TASKS_PER_NODE": "1"}


def _established_to_port(port: int) -> int:
    """Server-side ESTABLISHED TCP sockets on `port` (IPv4 and IPv6 tables)."""
    count = 0
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            with open(table, encoding="ascii") as f:
                next(f)
                for line in f:
                    fields = line.split()
                    if int(fields[1].rsplit(":", 1)[1], 16) == port and fields[3] == "01":
                        count += 1
        except OSError:
            continue
    return count


def _counting_store(inner: Any) -> Any:
    """`inner` behind a torch.distributed.Store that counts the requests made through it."""
    import torch.distributed as dist

    class CountingStore(dist.Store):
        def __init__(self, inner: dist.Store, counts: dict[str, int]):
            super().__init__()
            self.inner = inner
            self.counts = counts

        def _count(self, op: str) -> None:
            self.counts[op] = self.counts.get(op, 0) + 1

        def set(self, key, value):  # type: ignore[no-untyped-def]
            self._count("set")
            self.inner.set(key, value)

        def get(self, key):  # type: ignore[no-untyped-def]
            self._count("get")
            return self.inner.get(key)

        def add(self, key, value):  # type: ignore[no-untyped-def]
            self._count("add")
            return self.inner.add(key, value)

        def compare_set(self, key, expected, desired):  # type: ignore[no-untyped-def]
            self._count("compare_set")
            return self.inner.compare_set(key, expected, desired)

        def check(self, keys):  # type: ignore[no-untyped-def]
            self._count("check")
            return self.inner.check(keys)

        def wait(self, keys, timeout=None):  # type: ignore[no-untyped-def]
            self._count("wait")
            if timeout is None:
                self.inner.wait(keys)
            else:
                self.inner.wait(keys, timeout)

        def get_within(self, key, timeout):  # type: ignore[no-untyped-def]
            self._count("get_within")
            return self.inner.get_within(key, timeout)

        def multi_get(self, keys):  # type: ignore[no-untyped-def]
            self._count("multi_get")
            return self.inner.multi_get(keys)

        def set_then_multi_get(self, key, value, keys):  # type: ignore[no-untyped-def]
            self._count("set_then_multi_get")
            return self.inner.set_then_multi_get(key, value, keys)

        def gather(self, own_key, value, keys):  # type: ignore[no-untyped-def]
            self._count("gather")
            return self.inner.gather(own_key, value, keys)

        @property
        def batched_multi_get(self) -> bool:
            return bool(getattr(self.inner, "batched_multi_get", False))

        def delete_key(self, key):  # type: ignore[no-untyped-def]
            self._count("delete_key")
            return self.inner.delete_key(key)

        def num_keys(self):  # type: ignore[no-untyped-def]
            self._count("num_keys")
            return self.inner.num_keys()

        def set_timeout(self, timeout):  # type: ignore[no-untyped-def]
            super().set_timeout(timeout)
            self.inner.set_timeout(timeout)

        def clone(self):  # type: ignore[no-untyped-def]
            return CountingStore(self.inner.clone(), self.counts)

        def close(self) -> None:
            close = getattr(self.inner, "close", None)
            if close is not None:
                close()

    proxy = CountingStore(inner, {})
    proxy.set_timeout(inner.timeout)
    return proxy


def _rank_main(node: str, nodes: list[str], job_id: int, secret: bytes,
               barrier: Any, conn: Connection) -> None:
    import torch
    import torch.distributed as dist

    from ..events import EventLog
    from ..rendezvous import pg
    from ..rendezvous.derive import derive
    from ..rendezvous.store import RootlessStore, make_store, serve_shard
    from ..slurm.env import SlurmEnv

    torch.set_num_threads(1)
    env = SlurmEnv.from_environ(_node_environ(job_id, node, nodes))
    conn.send("ready")
    while True:
        cmd = conn.recv()
        if cmd is None:
            return
        kind, generation = cmd
        try:
            info = derive(env, generation, nodes, tasks_per_node=1,
                          resolve=lambda name: "127.0.0.1", init_timeout_s=INIT_TIMEOUT_S)
            barrier.wait()
            t0 = time.time()
            c0 = time.thread_time(), time.process_time()
            shard = serve_shard(info, secret, events=EventLog()) if kind == "rootless" else None
            t_shard = time.time()
            store = _counting_store(make_store(kind, info, secret))
            t_store = time.time()
            pg.init(info, store, "gloo", shard=shard)
            t_init = time.time()
            t = torch.ones(1)
            dist.all_reduce(t)
            t1 = time.time()
            c1 = time.thread_time(), time.process_time()
            phases = {"cpu_main_thread": c1[0] - c0[0], "cpu_process": c1[1] - c0[1],
                      "shard": t_shard - t0, "store": t_store - t_shard,
                      "init_process_group": t_init - t_store, "allreduce": t1 - t_init}
            barrier.wait()  # every rank is formed: the servers' counters are final
            load: dict[str, int] = {}
            if shard is not None:
                s = shard.stats()
                load = {"connections": s.connections, "requests": s.requests}
            elif info.rank == 0:
                load = {"connections": _established_to_port(info.master_port)}
            client = dict(store.counts)
            if isinstance(store.inner, RootlessStore):
                store.close()
            barrier.wait()  # nobody tears down a server another rank still reads
            pg.teardown()
            conn.send({"rank": info.rank, "t0": t0, "t1": t1, "sum": float(t[0]), "phases": phases,
                       "load": load, "client_requests": sum(client.values()),
                       "client_ops": client})
        except Exception:
            conn.send({"error": traceback.format_exc()})
            barrier.abort()


def _ratio(loads: list[float]) -> float:
    avg = sum(loads) / len(loads)
    return max(loads) / avg if avg else 0.0


# Below this many ranks a size gets proportionally more formations (`formations`): a 4-rank
# formation takes ~7 ms, so a process descheduled for a millisecond moves it by 15 %, and 5 of
# them gave medians a millisecond either way from one run to the next; 20 cost 0.2 s.
EVEN_SAMPLE_RANKS = 16


def formations(n: int, reps: int) -> int:
    """Formations per store at `n` ranks: `reps`, times EVEN_SAMPLE_RANKS // n below it."""
    return reps * max(1, EVEN_SAMPLE_RANKS // n)


def _one_size(n: int, n_formations: int, job_id: int, secret: bytes) -> dict[str, Any]:
    nodes = [f"b{i}" for i in range(n)]
    ctx = mp.get_context("spawn")
    barrier = ctx.Barrier(n)
    pipes = [ctx.Pipe() for _ in nodes]
    procs = [ctx.Process(target=_rank_main, daemon=True,
                         args=(node, nodes, job_id, secret, barrier, pipes[i][1]))
             for i, node in enumerate(nodes)]
    t_spawn = time.time()
    for p in procs:
        p.start()
    try:
        for parent, _ in pipes:
            if not parent.poll(300) or parent.recv() != "ready":
                raise RuntimeError(f"a rank of the {n}-rank run did not start")
        spawn_s = time.time() - t_spawn
        out: dict[str, Any] = {"ranks": n, "spawn_and_import_s": spawn_s,
                               "formations": n_formations}
        generation = 0
        runs: dict[str, list[list[dict[str, Any]]]] = {"rootless": [], "tcpstore": []}
        # The two stores take turns, each going first every other round: 2 cores shared by N
        # processes drift in speed over a run, and both kinds must see the same drift.
        for rep in range(n_formations):
            for kind in (("rootless", "tcpstore") if rep % 2 == 0 else ("tcpstore", "rootless")):
                for parent, _ in pipes:
                    parent.send((kind, generation))
                generation += 1
                results = []
                for parent, _ in pipes:
                    if not parent.poll(INIT_TIMEOUT_S + 60):
                        raise RuntimeError(f"{kind} formation of {n} ranks did not finish")
                    results.append(parent.recv())
                errors = [r["error"] for r in results if "error" in r]
                if errors:
                    raise RuntimeError(f"{kind} formation of {n} ranks failed:\n{errors[0]}")
                if any(r["sum"] != n for r in results):
                    raise RuntimeError(f"{kind} allreduce of {n} ranks gave a wrong sum")
                runs[kind].append(results)
        for kind, kind_runs in runs.items():
            out[kind] = _summarize(kind, kind_runs, n)
        return out
    finally:
        for parent, _ in pipes:
            try:
                parent.send(None)
            except OSError:
                pass
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()


def _summarize(kind: str, runs: list[list[dict[str, Any]]], n: int) -> dict[str, Any]:
    init = [max(r["t1"] for r in res) - min(r["t0"] for r in res) for res in runs]
    out: dict[str, Any] = {"init_s": init, "init_s_median": statistics.median(init)}
    # Where a formation's time goes: per run, each phase's slowest rank and how far apart
    # the ranks left the start barrier; medians over the runs.
    out["phases_s_median"] = {
        name: statistics.median(max(r["phases"][name] for r in res) for res in runs)
        for name in runs[0][0]["phases"]}
    out["start_skew_s_median"] = statistics.median(
        max(r["t0"] for r in res) - min(r["t0"] for r in res) for res in runs)
    # On cores shared by every rank, a formation takes about its ranks' CPU over the cores.
    out["cpu_process_all_ranks_s_median"] = statistics.median(
        sum(r["phases"]["cpu_process"] for r in res) for res in runs)
    if kind == "rootless":
        ratios, conn_ratios, totals = [], [], []
        per_host = []
        for res in runs:
            loads = [r["load"]["connections"] + r["load"]["requests"] for r in res]
            ratios.append(_ratio(loads))
            conn_ratios.append(_ratio([r["load"]["connections"] for r in res]))
            totals.append(sum(r["load"]["requests"] for r in res))
            per_host.append([r["load"] for r in res])
        out.update({
            "busiest_over_avg": statistics.median(ratios),
            "busiest_over_avg_source": "measured: each shard server's connections + requests",
            "connections_busiest_over_avg": statistics.median(conn_ratios),
            "requests_total_median": statistics.median(totals),
            "load_per_host_last_run": per_host[-1],
        })
    else:
        root = [next(r["load"]["connections"] for r in res if r["rank"] == 0) for res in runs]
        # One server serves every client: the requests it served are the ones every rank made.
        requests = [sum(r["client_requests"] for r in res) for res in runs]
        root_load = [c + q for c, q in zip(root, requests)]
        out.update({
            "connections_at_root": root,
            "connections_at_root_median": statistics.median(root),
            "connections_at_root_source": "measured: ESTABLISHED sockets on MASTER_PORT in "
                                          "/proc/net/tcp on rank 0 after the formation",
            "requests_at_root": requests,
            "requests_at_root_median": statistics.median(requests),
            "requests_at_root_source": "measured: every rank's requests, counted by a Store "
                                       "proxy around its TCPStore client, summed (all go to "
                                       "the one server; its per-connection handshake is not "
                                       "counted)",
            "load_at_root_median": statistics.median(root_load),
            "busiest_over_avg": _ratio([statistics.median(root_load)] + [0] * (n - 1)),
            "busiest_over_avg_source": "structural, not measured: TCPStore's one server on the "
                                       "root's host serves every request and no other host "
                                       "serves any, so busiest/avg = N; the root's load itself "
                                       "(load_at_root_median) is measured",
        })
    out["client_requests_total_median"] = statistics.median(
        sum(r["client_requests"] for r in res) for res in runs)
    out["client_ops_of_one_rank_last_run"] = runs[-1][0]["client_ops"]
    return out


def _mem_available() -> int:
    with open("/proc/meminfo", encoding="ascii") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    return 0


def _plot(path: Path, sizes: list[dict[str, Any]]) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib import ticker

    ns = [s["ranks"] for s in sizes]
    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 3.8))
    for kind, color in (("rootless", "#4c72b0"), ("tcpstore", "#dd8452")):
        a.plot(ns, [s[kind]["init_s_median"] for s in sizes], "o-", color=color, label=kind)
        b.plot(ns, [s[kind]["busiest_over_avg"] for s in sizes], "o-", color=color, label=kind)
    a.set(ylabel="init + first allreduce, s (median)", title="rendezvous time")
    b.set(ylabel="busiest host / average host", title="store load (connections + requests)")
    b.set_yscale("log", base=2)
    b.yaxis.set_major_formatter(ticker.ScalarFormatter())
    for ax in (a, b):
        ax.set_xscale("log", base=2)
        ax.set_xticks(ns, [str(n) for n in ns])
        ax.xaxis.set_minor_formatter(ticker.NullFormatter())
        ax.set_xlabel("ranks (loopback processes)")
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


GOAL_64_RANKS_S = 0.5
GOAL_BUSIEST_OVER_AVG = 2.0


def _goals(sizes: list[dict[str, Any]]) -> dict[str, Any]:
    """Issue 15's rendezvous goals, each checked on the medians of this run."""
    at = {s["ranks"]: s for s in sizes}
    out: dict[str, Any] = {
        "rootless_not_slower_than_tcpstore": {
            str(n): s["rootless"]["init_s_median"] <= s["tcpstore"]["init_s_median"]
            for n, s in at.items()},
        f"rootless_busiest_over_avg_le_{GOAL_BUSIEST_OVER_AVG:g}": {
            str(n): s["rootless"]["busiest_over_avg"] <= GOAL_BUSIEST_OVER_AVG
            for n, s in at.items()},
    }
    if 64 in at:
        out[f"rootless_64_ranks_le_{GOAL_64_RANKS_S:g}_s"] = (
            at[64]["rootless"]["init_s_median"] <= GOAL_64_RANKS_S)
    return out


SMOKE_SIZES = [2, 4]
QUICK_SIZES = [4, 16]
FULL_SIZES = [4, 16, 32, 64]


def run(out_dir: Path, quick: bool = False, sizes: list[int] | None = None,
        reps: int | None = None, smoke: bool = False) -> dict:
    """`sizes`: rank counts to sweep (default 4, 16 with `quick`, else up to 64); `reps`:
    formations per size and store kind (default 3). `smoke`: 2 and 4 ranks, one formation
    each, to check the command works. The summary is the largest size's."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    counts = sorted(set(sizes)) if sizes else list(
        SMOKE_SIZES if smoke else QUICK_SIZES if quick else FULL_SIZES)
    if counts[0] < 2:
        raise ValueError(f"rendezvous sizes {counts} must be at least 2 ranks")
    reps = (1 if smoke else 3) if reps is None else reps
    if reps < 1:
        raise ValueError(f"repetitions {reps} must be at least 1")
    skipped = []
    for n in [c for c in counts if c > 32]:  # 32 and fewer fit anywhere this runs
        if _mem_available() < n * MEM_PER_RANK:
            counts.remove(n)
            skipped.append({"ranks": n, "why": f"MemAvailable {_mem_available() >> 20} MiB < "
                                               f"{n * MEM_PER_RANK >> 20} MiB"})
    if not counts:
        raise ValueError(f"every size was skipped: {skipped}")
    secret = secrets.token_bytes(32)
    # A random job id keeps the derived ports apart from other runs on this machine.
    sizes = [_one_size(n, 1 if smoke else formations(n, reps), random.randrange(1000, 1_000_000),
                       secret) for n in counts]
    largest = sizes[-1]
    summary = {
        "bench": NAME,
        "ranks": largest["ranks"],
        "rootless_busiest_over_avg": round(largest["rootless"]["busiest_over_avg"], 3),
        "tcpstore_busiest_over_avg": round(largest["tcpstore"]["busiest_over_avg"], 3),
        "rootless_init_s": round(largest["rootless"]["init_s_median"], 4),
        "tcpstore_init_s": round(largest["tcpstore"]["init_s_median"], 4),
        "gloo_lazy_init": bool(C.read(None, C.GLOO_LAZY_INIT)),
        "init_s_per_size": {str(s["ranks"]): {k: round(s[k]["init_s_median"], 4)
                                              for k in ("rootless", "tcpstore")}
                            for s in sizes},
    }
    summary["goals"] = _goals(sizes)
    _plot(out_dir / f"{NAME}.png", sizes)
    write_result(out_dir, NAME, {
        "summary": summary, "quick": quick, "smoke": smoke, "repetitions": reps, "sizes": sizes,
        "skipped": skipped, "method": __doc__,
        "notes": {"rootless_busiest_over_avg": "measured (shard servers' own counters)",
                  "tcpstore_busiest_over_avg": "structural: equals the rank count, since "
                                               "TCPStore's one server takes every request; "
                                               "see sizes[].tcpstore.load_at_root_median for "
                                               "the measured root load"},
        "when": datetime.datetime.now(datetime.timezone.utc).isoformat(),
    })
    return summary
