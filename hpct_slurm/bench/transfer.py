"""Peer state transfer throughput vs a raw TCP sendall/recv_into of the same bytes (loopback).

Three child processes (three survivors) hold the same ~256 MB snapshot. The first serves it
three ways: through `TransferServer` as deployed (`single`: MAC'd header carrying the
snapshot's sealed digest; the receiver hashes every byte on its hash threads while receiving),
through a `TransferServer` that also re-hashes on serve (`serve_verify`), and through a bare
socket that just `sendall`s the bytes (`raw`). `striped2` and `striped3` pull the same state
from the first two / all three holders at once (recovery/striped.py: a manifest, then
leaf-aligned stripes verified on arrival). The parent alternates fetches of every mode into
one preallocated buffer, so all see the same machine state; the summary gives the ratio of
median throughputs to raw per mode, and `throughput_ratio` for the best of single and striped.
"""
from __future__ import annotations

import multiprocessing as mp
import secrets
import socket
import statistics
import threading
import time
from pathlib import Path
from typing import Any

from .common import plot_bars, write_result

JOB = "bench"
HOLDERS = 3
MODES = ("raw", "single", "serve_verify", "striped2", "striped3")


def _serve_raw(listener: socket.socket, data: memoryview, stop: threading.Event) -> None:
    from ..recovery.transfer import _tune
    while not stop.is_set():
        try:
            conn, _ = listener.accept()
        except OSError:
            return
        with conn:
            _tune(conn)
            conn.recv(1)  # the request
            conn.sendall(data)


def _holder(conn: Any, nbytes: int, secret: bytes) -> None:
    import torch

    from ..recovery.snapshot import SnapshotStore
    from ..recovery.state import TrainState
    from ..recovery.transfer import TransferServer

    state = TrainState()
    torch.manual_seed(0)  # every holder the same bytes, as survivors under data parallelism
    state.extras["weights"] = torch.randn(nbytes // 4)
    store = SnapshotStore(state, scopes=("rank",), background_seal=False)
    snap = store.commit(1)
    stop = threading.Event()
    listener = socket.create_server(("127.0.0.1", 0))
    threading.Thread(target=_serve_raw, args=(listener, snap.data, stop), daemon=True).start()
    snap.digest()  # sealed after commit, as the background sealer does in a training process
    with TransferServer(secret, JOB, 0, own=store) as ours, \
            TransferServer(secret, JOB, 0, own=store, verify_on_serve=True) as serve_check:
        conn.send({"nbytes": snap.layout.nbytes, "raw": listener.getsockname()[:2],
                   "ours": ours.address, "ours_serve_verify": serve_check.address})
        conn.recv()  # parent says stop
    stop.set()
    listener.close()


def _raw_fetch(addr: tuple[str, int], into: memoryview) -> None:
    from ..recovery.transfer import _connect
    with _connect(addr, 60) as sock:
        sock.sendall(b"?")
        got = 0
        while got < len(into):
            n = sock.recv_into(into[got:])
            if n == 0:
                raise ConnectionError("raw server closed early")
            got += n


def run(out_dir: Path, quick: bool = False, smoke: bool = False) -> dict:
    """`smoke`: 4 MiB, one timed round: checks the command works; its numbers mean nothing."""
    import torch

    from ..protocol import hash_workers
    from ..recovery.copies import as_memoryview
    from ..recovery.striped import fetch_striped
    from ..recovery.transfer import fetch_state

    nbytes = (4 if smoke else 32 if quick else 256) * 1024 * 1024
    reps = 1 if smoke else 3 if quick else 7
    secret = secrets.token_bytes(32)
    ctx = mp.get_context("spawn")
    pipes, procs = [], []
    holders = 2 if smoke else HOLDERS  # a smoke run only checks that each mode works
    modes = MODES[:4] if smoke else MODES
    for _ in range(holders):
        parent, child = ctx.Pipe()
        proc = ctx.Process(target=_holder, args=(child, nbytes, secret), daemon=True)
        proc.start()
        pipes.append(parent)
        procs.append(proc)
    try:
        infos = [p.recv() for p in pipes]
        info = infos[0]
        n = info["nbytes"]
        into = torch.empty(n + 4096, dtype=torch.uint8)
        view = as_memoryview(into)
        times: dict[str, list[float]] = {m: [] for m in modes}
        used: dict[str, set[int]] = {m: set() for m in modes if m.startswith("striped")}
        for rep in range(reps + 1):  # the first round warms page tables and socket buffers
            for kind in times:
                t0 = time.perf_counter()
                if kind == "raw":
                    _raw_fetch(tuple(info["raw"]), view[:n])
                elif kind.startswith("striped"):
                    k = int(kind[len("striped"):])
                    res = fetch_striped([(0, tuple(i["ours"])) for i in infos[:k]], 0, secret,
                                        JOB, 1, into=into)
                    assert res.layout.nbytes == n
                    used[kind].add(len(res.per_source))
                else:
                    addr = info["ours" if kind == "single" else "ours_serve_verify"]
                    res = fetch_state([tuple(addr)], 0, secret, JOB, into=into)
                    assert res.layout.nbytes == n and res.data is into
                if rep:
                    times[kind].append(time.perf_counter() - t0)
        for p in pipes:
            p.send("stop")
    finally:
        for proc in procs:
            proc.join(30)
            if proc.is_alive():
                proc.kill()
    gbps = {k: n / statistics.median(v) / 1e9 for k, v in times.items()}
    ratios = {k: round(v / gbps["raw"], 3) for k, v in gbps.items() if k != "raw"}
    best = max(("single", *used), key=lambda k: gbps[k])
    summary = {"bench": "transfer", "throughput_ratio": ratios[best], "best_mode": best,
               "throughput_ratio_single": ratios["single"],
               "throughput_ratio_striped": max(ratios[k] for k in used),
               # how many sources delivered stripes in each pull (fewest, most)
               "striped_sources_used": {k: [min(v), max(v)] for k, v in used.items()},
               "throughput_ratio_serve_verify": ratios["serve_verify"],
               "gbps": {k: round(v, 3) for k, v in gbps.items()}, "nbytes": n,
               "hash_workers": hash_workers(), "cores": _cores()}
    write_result(out_dir, "transfer", {**summary, "quick": quick, "smoke": smoke, "reps": reps,
                                       "ratios": ratios, "seconds": times,
                                       "notes": "single = HMAC-SHA256 header carrying the sealed "
                                                "BLAKE3 tree digest, every byte hashed by the "
                                                "receiver; serve_verify also re-hashes on serve; "
                                                "stripedK = K holder processes at once, each "
                                                "stripe checked against the manifest"})
    plot_bars(Path(out_dir) / "transfer.png",
              ["raw sendall", "single source", "single + serve re-hash", "striped, 2 sources",
               "striped, 3 sources"][:len(modes)], [gbps[m] for m in modes], "GB/s",
              f"Peer transfer of {n / 2**20:.0f} MiB, loopback")
    return summary


def _cores() -> int:
    import os
    return len(os.sched_getaffinity(0))
