"""Rendezvous load: rootless (sharded) store vs TCPStore, N loopback processes.

Each process plays one node with one task. For every N and store kind the same processes form
a gloo group (a fresh generation each time: new ports, new key prefix), run one allreduce,
and report. Measured per run:
  init_s      from a common start barrier to the end of the first allreduce, slowest rank
              (gloo connects its full mesh in init; with HPCT_GLOO_LAZY_INIT=1 it connects
              lazily, during that allreduce);
  load        per host, connections accepted + requests served by its store server.
Where each load number comes from:
  rootless    every shard server counts its own accepted connections and requests (measured);
  tcpstore    connections at the root: counted in /proc/net/tcp on rank 0 after the formation
              (measured); requests at the root: every store request of the formation goes to
              it, the same requests the rootless run spread over its shards (by construction,
              from the rootless total); every other host serves nothing (by construction).
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
            shard = serve_shard(info, secret, events=EventLog()) if kind == "rootless" else None
            store = make_store(kind, info, secret)
            pg.init(info, store, "gloo", shard=shard)
            t = torch.ones(1)
            dist.all_reduce(t)
            t1 = time.time()
            barrier.wait()  # every rank is formed: the servers' counters are final
            load: dict[str, int] = {}
            if shard is not None:
                s = shard.stats()
                load = {"connections": s.connections, "requests": s.requests}
            elif info.rank == 0:
                load = {"connections": _established_to_port(info.master_port)}
            if isinstance(store, RootlessStore):
                store.close()
            barrier.wait()  # nobody tears down a server another rank still reads
            pg.teardown()
            conn.send({"rank": info.rank, "t0": t0, "t1": t1, "sum": float(t[0]),
                       "load": load})
        except Exception:
            conn.send({"error": traceback.format_exc()})
            barrier.abort()


def _ratio(loads: list[float]) -> float:
    avg = sum(loads) / len(loads)
    return max(loads) / avg if avg else 0.0


def _one_size(n: int, reps: int, job_id: int, secret: bytes) -> dict[str, Any]:
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
        out: dict[str, Any] = {"ranks": n, "spawn_and_import_s": spawn_s}
        generation = 0
        for kind in ("rootless", "tcpstore"):
            runs = []
            for _ in range(reps):
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
                runs.append(results)
            out[kind] = _summarize(kind, runs, n)
        # The root serves every request the formation makes; the rootless runs counted them.
        root_requests = out["rootless"]["requests_total_median"]
        tcp = out["tcpstore"]
        tcp["requests_at_root"] = root_requests
        tcp["requests_at_root_source"] = ("by construction: at least the rootless runs' total "
                                          "(TCPStore adds a handshake of its own per client)")
        loads = [tcp["connections_at_root_median"] + root_requests] + [0] * (n - 1)
        tcp["busiest_over_avg"] = _ratio(loads)
        tcp["busiest_over_avg_source"] = ("root: measured connections + requests by "
                                          "construction; other hosts serve nothing")
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
        out.update({
            "connections_at_root": root,
            "connections_at_root_median": statistics.median(root),
            "connections_at_root_source": "measured: ESTABLISHED sockets on MASTER_PORT in "
                                          "/proc/net/tcp on rank 0 after the formation",
            "connections_at_root_by_construction": n,
        })
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


def run(out_dir: Path, quick: bool = False) -> dict:
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    counts = [4, 16] if quick else [4, 16, 32, 64]
    reps = 3
    skipped = []
    if not quick and _mem_available() < 64 * MEM_PER_RANK:
        counts.remove(64)
        skipped.append({"ranks": 64, "why": f"MemAvailable {_mem_available() >> 20} MiB < "
                                            f"{64 * MEM_PER_RANK >> 20} MiB"})
    secret = secrets.token_bytes(32)
    # A random job id keeps the derived ports apart from other runs on this machine.
    sizes = [_one_size(n, reps, random.randrange(1000, 1_000_000), secret) for n in counts]
    largest = sizes[-1]
    summary = {
        "bench": NAME,
        "ranks": largest["ranks"],
        "rootless_busiest_over_avg": round(largest["rootless"]["busiest_over_avg"], 3),
        "tcpstore_busiest_over_avg": round(largest["tcpstore"]["busiest_over_avg"], 3),
        "rootless_init_s": round(largest["rootless"]["init_s_median"], 4),
        "tcpstore_init_s": round(largest["tcpstore"]["init_s_median"], 4),
    }
    _plot(out_dir / f"{NAME}.png", sizes)
    write_result(out_dir, NAME, {
        "summary": summary, "quick": quick, "repetitions": reps, "sizes": sizes,
        "skipped": skipped, "method": __doc__,
        "when": datetime.datetime.now(datetime.timezone.utc).isoformat(),
    })
    return summary
