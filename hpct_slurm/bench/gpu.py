"""The GPU path on one GPU: what a snapshot costs a step, what a restore costs against a raw
copy, and what forming, aborting and re-forming an NCCL group takes (issue 26).

Needs a CUDA device (and torch built with NCCL for the last part); `scripts/gpu-check.sh` runs
it with the `gpu` tests on a machine with one GPU, no Slurm and no network.

1. `overlap`: a transformer (bf16 autocast, AdamW, fp32 state) trains in blocks of steps that
   alternate between the variants, each round in a new order, so all see the same device:
   - `off`: no snapshots;
   - `commit`: a synchronous full commit after every step (`SnapshotStore.commit`);
   - `commit_async`: a full commit every step, overlapped (`commit_async`; the next optimizer
     step's kernels wait for the copy on the GPU): `Job`'s default on a GPU with per-rank state;
   - `lazy`: every step held where it lies (`prepare_lazy`), a full overlapped commit every
     LAZY_FULL_EVERY (64) of its own steps, its blocks whole cycles: `Job`'s default without
     per-rank state;
   - `raw_side_stream`: the reference: the same bytes copied on a side stream into pinned
     memory, the next optimizer step waiting on the copy's event, nothing else.
   Each variant's cost is the median over rounds of its block's time per step against the
   `off` block of the same round. Goals: commit every step <= 5 %, lazy <= 1 %.
2. `restore`: that state's snapshot (pinned host memory) restored into the live objects (a
   survivor) and into fresh ones (a newcomer), against a raw pinned host-to-device copy of the
   same bytes; the restored state is checked bit for bit. Goal: >= 0.8 of the raw copy's speed.
3. `nccl`: a 1-rank NCCL group over the rootless store: first formation, a STOP's abort
   (`pg.abort_generation`), teardown, re-formation (a single GPU cannot host two NCCL ranks).
"""
from __future__ import annotations

import datetime
import secrets
import statistics
import time
from pathlib import Path
from typing import Any, Callable

from ..errors import HpctError
from .common import plot_bars, write_result

def _model(torch: Any, d: int, layers: int, ff: int) -> Any:
    blocks = [torch.nn.TransformerEncoderLayer(d, max(1, d // 64), ff, dropout=0.0,
                                               batch_first=True) for _ in range(layers)]
    return torch.nn.Sequential(*blocks, torch.nn.Linear(d, d)).cuda()


def _sizes(quick: bool, smoke: bool) -> dict[str, int]:
    if smoke:
        return {"d": 128, "layers": 2, "ff": 256, "batch": 4, "seq": 64, "block": 4, "rounds": 1,
                "cycles": 0}
    if quick:
        return {"d": 512, "layers": 8, "ff": 2048, "batch": 8, "seq": 256, "block": 8,
                "rounds": 3, "cycles": 1}
    # about 200M parameters: 2.4 GB of fp32 parameters and AdamW state
    return {"d": 1024, "layers": 16, "ff": 4096, "batch": 16, "seq": 512, "block": 16,
            "rounds": 5, "cycles": 1}


def _overlap(torch: Any, sz: dict[str, int]) -> tuple[dict[str, Any], Any, Any]:
    from ..recovery.snapshot import SnapshotStore
    from ..recovery.snapshot_policy import LAZY_FULL_EVERY
    from ..recovery.state import TrainState

    torch.manual_seed(0)
    model = _model(torch, sz["d"], sz["layers"], sz["ff"])
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    x = torch.randn(sz["batch"], sz["seq"], sz["d"], device="cuda")
    state = TrainState(model=model, optimizer=opt)
    store = SnapshotStore(state, scopes=("shared",))
    raw: dict[str, Any] = {"stream": torch.cuda.Stream(), "event": None, "bufs": None}
    before: list[Callable[[], None]] = []
    opt.register_step_pre_hook(lambda *_: [f() for f in before])

    def step() -> None:
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = model(x).float().pow(2).mean()
        opt.zero_grad(set_to_none=False)
        loss.backward()
        opt.step()

    def live() -> list[Any]:
        return [p.detach() for p in model.parameters()] + [
            t for st in opt.state.values() for t in st.values()
            if isinstance(t, torch.Tensor) and t.is_cuda]

    def raw_copy() -> None:
        srcs = live()
        if raw["bufs"] is None:
            raw["bufs"] = [torch.empty(t.shape, dtype=t.dtype, pin_memory=True) for t in srcs]
        s = raw["stream"]
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            for dst, src in zip(raw["bufs"], srcs):
                dst.copy_(src, non_blocking=True)
        raw["event"] = torch.cuda.Event()
        raw["event"].record(s)

    def raw_wait() -> None:
        if raw["event"] is not None:
            torch.cuda.current_stream().wait_event(raw["event"])

    variants: dict[str, tuple[Callable[[int], None], Callable[[], None] | None]] = {
        "off": (lambda i: None, None),
        "commit": (lambda i: store.commit(i), None),
        "commit_async": (lambda i: store.commit_async(i), store.before_optimizer_step),
        "lazy": (lambda i: store.commit_async(i) if i % LAZY_FULL_EVERY == 0
                 else store.prepare_lazy(i), store.before_optimizer_step),
        "raw_side_stream": (lambda i: raw_copy(), raw_wait),
    }
    for i in range(3):  # optimizer state exists, buffers allocated, kernels warm
        step()
        store.commit(i)
        raw_copy()
    torch.cuda.synchronize()
    per_step: dict[str, list[float]] = {name: [] for name in variants}
    counter = 3
    names = list(variants)
    for rnd in range(sz["rounds"]):
        order = names[rnd % len(names):] + names[:rnd % len(names)]
        for name in order:
            after, hook = variants[name]
            before[:] = [hook] if hook else []
            torch.cuda.synchronize()
            # a lazy block is a whole cycle from a full commit (`cycles`: not in the smoke run)
            cycle = name == "lazy" and sz["cycles"]
            steps = LAZY_FULL_EVERY if cycle else sz["block"]
            if cycle:
                counter = -(-counter // steps) * steps  # the cycle starts at its commit
            t0 = time.perf_counter()
            for _ in range(steps):
                step()
                after(counter)
                counter += 1
            store.wait()  # a block pays for what it started
            store.drop_pending()
            torch.cuda.synchronize()
            per_step[name].append((time.perf_counter() - t0) / steps)
    before.clear()
    off = per_step["off"]
    overhead = {name: round(statistics.median(100.0 * (t / o - 1) for t, o in zip(ts, off)), 2)
                for name, ts in per_step.items() if name != "off"}
    nbytes = sum(t.numel() * t.element_size() for t in live())
    return ({"state_bytes": nbytes, "step_s_off": round(statistics.median(off), 5),
             "overhead_pct": overhead,
             "goals_met": {"commit_async_le_5pct": overhead["commit_async"] <= 5.0,
                           "lazy_le_1pct": overhead["lazy"] <= 1.0}}, state, store)


def _restore(torch: Any, sz: dict[str, int], state: Any, store: Any) -> dict[str, Any]:
    from ..recovery.state import TrainState

    snap = store.commit(10**6)
    layout, data = snap.layout, snap.data
    model, opt = state.get("model"), state.get("optimizer")
    expected = [t.detach().cpu().clone() for t in model.state_dict().values()] + [
        t.cpu().clone() for st in opt.state.values() for t in st.values()
        if isinstance(t, torch.Tensor)]

    def timed(fn: Callable[[], None]) -> float:
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        return time.perf_counter() - t0

    def same(m: Any, o: Any) -> bool:
        got = [t.detach().cpu() for t in m.state_dict().values()] + [
            t.cpu() for st in o.state.values() for t in st.values()
            if isinstance(t, torch.Tensor)]
        return len(got) == len(expected) and all(torch.equal(a, b)
                                                 for a, b in zip(got, expected))

    with torch.no_grad():  # the survivor's live state moves on before its restore
        for p in model.parameters():
            p.add_(1.0)
    survivor_s = timed(lambda: state.restore_from(layout, data, scopes=("shared",)))
    survivor_ok = same(model, opt)
    fresh = _model(torch, sz["d"], sz["layers"], sz["ff"])
    fresh_opt = torch.optim.AdamW(fresh.parameters(), lr=1e-4)
    newcomer = TrainState(model=fresh, optimizer=fresh_opt)
    newcomer_s = timed(lambda: newcomer.restore_from(layout, data, scopes=("shared",)))
    newcomer_ok = same(fresh, fresh_opt)
    pinned = torch.empty(layout.nbytes, dtype=torch.uint8, pin_memory=True)
    dev = torch.empty(layout.nbytes, dtype=torch.uint8, device="cuda")
    raw_s = min(timed(lambda: dev.copy_(pinned, non_blocking=True)) for _ in range(3))
    return {"bytes": layout.nbytes, "raw_pinned_h2d_s": round(raw_s, 5),
            "survivor_s": round(survivor_s, 5), "newcomer_s": round(newcomer_s, 5),
            "survivor_speed_of_raw": round(raw_s / survivor_s, 3),
            "newcomer_speed_of_raw": round(raw_s / newcomer_s, 3),
            "bitwise_equal": {"survivor": survivor_ok, "newcomer": newcomer_ok},
            "goal_met": min(raw_s / survivor_s, raw_s / newcomer_s) >= 0.8}


def _nccl(torch: Any) -> dict[str, Any]:
    import torch.distributed as dist

    from ..rendezvous import pg
    from ..rendezvous.derive import derive
    from ..rendezvous.store import make_store, serve_shard
    from ..slurm.env import SlurmEnv

    if not dist.is_nccl_available():
        return {"error": "this torch has no NCCL"}
    env = SlurmEnv.from_environ({
        "SLURM_JOB_ID": "1", "SLURM_JOB_NODELIST": "n0", "SLURMD_NODENAME": "n0",
        "SLURM_STEP_NODELIST": "n0", "SLURM_PROCID": "0", "SLURM_LOCALID": "0",
        "SLURM_NODEID": "0", "SLURM_NTASKS": "1", "SLURM_TASKS_PER_NODE": "1"})
    secret = secrets.token_bytes(32)
    out: dict[str, Any] = {"form_s": [], "abort_s": [], "teardown_s": []}
    for generation in range(3):
        info = derive(env, generation, ["n0"], tasks_per_node=1,
                      resolve=lambda name: "127.0.0.1")
        t0 = time.perf_counter()
        shard = serve_shard(info, secret)
        pg.init(info, make_store("rootless", info, secret), "nccl", shard=shard,
                device_id=torch.device("cuda", 0),
                collective_timeout=datetime.timedelta(seconds=10))
        t = torch.ones(4, device="cuda")
        dist.all_reduce(t)
        torch.cuda.synchronize()
        out["form_s"].append(round(time.perf_counter() - t0, 4))
        t0 = time.perf_counter()
        aborted = pg.abort_generation(generation)
        out["abort_s"].append(round(time.perf_counter() - t0, 4))
        if not aborted:
            raise HpctError(f"generation {generation}'s NCCL group was not aborted")
        t0 = time.perf_counter()
        pg.teardown()
        out["teardown_s"].append(round(time.perf_counter() - t0, 4))
        if dist.is_initialized():
            raise HpctError("teardown left a group formed")
    out["nccl"] = ".".join(map(str, torch.cuda.nccl.version()))
    return out


def run(out_dir: Path, quick: bool = False, smoke: bool = False) -> dict:
    import torch

    if not torch.cuda.is_available():
        raise HpctError("bench gpu needs a CUDA device (none is visible to torch here)")
    sz = _sizes(quick, smoke)
    torch.backends.cuda.matmul.allow_tf32 = True
    overlap, state, store = _overlap(torch, sz)
    restore = _restore(torch, sz, state, store)
    nccl = _nccl(torch)
    data = {"device": torch.cuda.get_device_name(0), "torch": torch.__version__,
            "cuda": torch.version.cuda, "sizes": sz, "overlap": overlap, "restore": restore,
            "nccl": nccl}
    write_result(out_dir, "gpu", data)
    labels = list(overlap["overhead_pct"])
    plot_bars(Path(out_dir) / "gpu_overlap.png", labels,
              [overlap["overhead_pct"][k] for k in labels], "% over no snapshots",
              f"snapshot cost per step, {overlap['state_bytes'] / 1e9:.1f} GB of state")
    return {"bench": "gpu", "device": data["device"], "overhead_pct": overlap["overhead_pct"],
            "restore_speed_of_raw": [restore["survivor_speed_of_raw"],
                                     restore["newcomer_speed_of_raw"]],
            "bitwise_equal": restore["bitwise_equal"], "nccl": nccl}
