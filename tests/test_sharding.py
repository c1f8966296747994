"""Shard keys of a DeviceMesh, the restore plan of a sharded job, and sharded snapshots that
refuse a shard from the wrong coordinate (real torch.distributed, gloo, 4 processes)."""
from __future__ import annotations

import json
import multiprocessing as mp
import tempfile
from pathlib import Path

import pytest

from hpct_slurm.controller.policy import Held, plan_restore
from hpct_slurm.errors import HpctError
from hpct_slurm.recovery.layout_rules import MeshSpec


def test_hsdp_shard_keys_pair_the_replicas():
    spec = MeshSpec((2, 2), ("replicate", "shard"), ("replicate",))
    assert [spec.coordinate(r) for r in range(4)] == [(0, 0), (0, 1), (1, 0), (1, 1)]
    assert spec.shard_keys() == [0, 1, 0, 1] and spec.replicas == 2
    major = MeshSpec((2, 2), ("shard", "replicate"), ("replicate",))
    assert major.shard_keys() == [0, 0, 1, 1]
    fsdp = MeshSpec((4,), ("shard",))
    assert fsdp.shard_keys() == [0, 1, 2, 3] and fsdp.replicas == 1
    tp = MeshSpec((2, 2, 2), ("dp", "fsdp", "tp"), ("dp",))
    assert tp.shard_keys() == [0, 1, 2, 3, 0, 1, 2, 3]


@pytest.mark.parametrize("shape,names,rep,match", [
    ((2, 0), ("a", "b"), (), "positive"), ((2,), ("a", "b"), (), "do not match"),
    ((2, 2), ("a", "a"), (), "distinct"), ((2,), ("a",), ("b",), "not mesh dimensions")])
def test_bad_mesh_specs_are_refused(shape, names, rep, match):
    with pytest.raises(HpctError, match=match):
        MeshSpec(shape, names, rep)


def _held(*steps: int) -> Held:
    return Held(own=frozenset(steps))


def test_a_lost_rank_takes_its_shard_from_the_survivor_with_its_key():
    keys = [0, 1, 0, 1]
    needs = {r: r for r in range(4)}
    held = {0: _held(8, 9), 1: _held(8, 9), 3: _held(8, 9)}  # rank 2 lost
    plan = plan_restore(needs, held, mode="jit", rank_state=False, shard_keys=keys)
    assert plan.step == 9 and plan.sources == {0: "own", 1: "own", 2: "peer", 3: "own"}


def test_both_holders_of_a_key_lost_means_disk_and_never_another_keys_state():
    keys = [0, 0, 1, 1]
    needs = {r: r for r in range(4)}
    held = {0: _held(8, 9), 1: _held(8, 9)}  # ranks 2, 3 (key 1) lost
    plan = plan_restore(needs, held, mode="jit", rank_state=False, shard_keys=keys,
                        disk_shared={0: {4, 8}, 1: {4, 8}})
    assert plan.step == 8 and plan.from_disk == [2, 3]
    # without that key on disk there is no consistent state: escalate, never mix shards
    with pytest.raises(HpctError, match=r"rank\(s\) \[2, 3\]"):
        plan_restore(needs, held, mode="jit", rank_state=False, shard_keys=keys,
                     disk_shared={0: {4, 8}})


# --- sharded snapshots on a real 2 x 2 HSDP mesh ------------------------------------------------

def _worker(rank: int, tmp: str, q) -> None:
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from hpct_slurm.recovery.encoding import Layout
    from hpct_slurm.recovery.state import TrainState

    try:
        torch.set_num_threads(1)
        dist.init_process_group("gloo", init_method=f"file://{tmp}/store", rank=rank,
                                world_size=4)
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))

        def build():
            torch.manual_seed(0)
            m = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Linear(16, 2))
            fully_shard(m, mesh=mesh)
            return m, torch.optim.AdamW(m.parameters(), lr=0.1)

        model, opt = build()
        torch.manual_seed(rank)
        model(torch.randn(4, 8)).sum().backward()
        opt.step()
        state = TrainState(model=model, optimizer=opt)
        state.mesh, state.replicate = mesh, ("replicate",)
        layout, buf = state.capture_into(None, ("shared",))
        Path(tmp, f"snap{rank}.bin").write_bytes(bytes(buf.numpy()[:layout.nbytes]))
        Path(tmp, f"snap{rank}.json").write_bytes(layout.to_json())
        dist.barrier()

        def restore(src: int, edit=None) -> str:
            fresh, fresh_opt = build()
            st = TrainState(model=fresh, optimizer=fresh_opt)
            st.mesh, st.replicate = mesh, ("replicate",)
            raw = Path(tmp, f"snap{src}.json").read_bytes()
            if edit:
                raw = edit(raw)
            try:
                st.restore_from(Layout.from_json(raw), bytearray(Path(tmp, f"snap{src}.bin")
                                                                  .read_bytes()),
                                scopes=("shared",))
            except Exception as exc:  # noqa: BLE001 - reported to the parent
                return f"refused: {exc}"
            same = all(torch.equal(a.to_local(), b.to_local())
                       for a, b in zip(model.parameters(), fresh.parameters()))
            same &= all(torch.equal(opt.state[a]["exp_avg"].to_local(),
                                    fresh_opt.state[b]["exp_avg"].to_local())
                        for a, b in zip(model.parameters(), fresh.parameters()))
            return f"equal={same}"

        other_replica = (rank + 2) % 4   # same shard key
        other_shard = rank ^ 1           # same replica, the other shard

        def bigger(raw: bytes) -> bytes:  # a tampered global shape
            obj = json.loads(raw)
            obj["tree"] = json.loads(json.dumps(obj["tree"]).replace('"shape": [16, 8]',
                                                                     '"shape": [18, 8]')
                                     .replace('"shape":[16,8]', '"shape":[18,8]'))
            return json.dumps(obj).encode()

        q.put((rank, restore(other_replica), restore(other_shard), restore(rank, bigger)))
        dist.barrier()
        dist.destroy_process_group()
    except BaseException as exc:  # noqa: BLE001
        q.put((rank, f"crashed: {exc!r}", "", ""))


def test_a_shard_restores_from_its_other_replica_and_is_refused_at_the_wrong_coordinate():
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    with tempfile.TemporaryDirectory() as tmp:
        procs = [ctx.Process(target=_worker, args=(r, tmp, q)) for r in range(4)]
        for p in procs:
            p.start()
        got = {}
        for _ in range(4):
            rank, *res = q.get(timeout=120)
            got[rank] = res
        for p in procs:
            p.join(30)
    for rank, (same_key, other_key, tampered) in sorted(got.items()):
        assert same_key == "equal=True", (rank, same_key)
        assert other_key.startswith("refused: ") and "wrong coordinate" in other_key, \
            (rank, other_key)
        assert "shard=" in other_key and "this rank is at" in other_key
        assert "refused model.0.weight" in tampered and "(18, 8)" in tampered, (rank, tampered)
