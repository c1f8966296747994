"""The layouts of the largest jobs, on real gloo groups of 4 processes (issue 46): FSDP2 over a
tensor-parallel model leaves strided shards, which a snapshot now holds and restores in place;
a layout that cannot be recovered is refused before the first step, naming what is wrong: a
placement a snapshot cannot hold, and a pipeline-stage dimension nobody declared (its stages'
state would read as replicas of each other). Their path through a node crash on the real
cluster is tests/test_layouts_cluster.py."""
from __future__ import annotations

import multiprocessing as mp
import tempfile

import pytest

from hpct_slurm.errors import HpctError
from hpct_slurm.recovery.layout_rules import MeshSpec, disagreeing


def _worker(rank: int, tmp: str, q) -> None:
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor, Partial
    from torch.distributed.tensor.parallel import (ColwiseParallel, RowwiseParallel,
                                                   parallelize_module)

    from hpct_slurm.errors import UsageError
    from hpct_slurm.examples.model_3d import TokenMLP
    from hpct_slurm.recovery.layout_check import check_placements, check_replicas_agree
    from hpct_slurm.recovery.layout_rules import infer_replicate
    from hpct_slurm.recovery.state import TrainState

    out: dict = {}
    try:
        torch.set_num_threads(1)
        dist.init_process_group("gloo", init_method=f"file://{tmp}/store", rank=rank,
                                world_size=4)
        # FSDP2 + TP: strided shards survive a snapshot and come back in place
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp_shard", "tp"))

        def build():
            torch.manual_seed(0)
            m = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.GELU(),
                                    torch.nn.Linear(16, 8))
            parallelize_module(m, mesh["tp"], {"0": ColwiseParallel(), "2": RowwiseParallel()})
            fully_shard(m, mesh=mesh["dp_shard"])
            return m, torch.optim.AdamW(m.parameters(), lr=0.1)

        model, opt = build()
        torch.manual_seed(7)
        model(torch.randn(4, 8)).sum().backward()
        opt.step()
        out["placements"] = [str(p.placements) for p in model.parameters()]
        state = TrainState(model=model, optimizer=opt)
        state.mesh, state.replicate = mesh, ()
        layout, buf = state.capture_into(None, ("shared",))
        fresh, fresh_opt = build()
        again = TrainState(model=fresh, optimizer=fresh_opt)
        again.mesh, again.replicate = mesh, ()
        again.restore_from(layout, bytearray(bytes(buf.numpy()[:layout.nbytes])),
                           scopes=("shared",))
        out["restored"] = all(
            torch.equal(a.to_local(), b.to_local()) and a.placements == b.placements
            for a, b in zip(model.parameters(), fresh.parameters())) and all(
            torch.equal(opt.state[a]["exp_avg"].to_local(),
                        fresh_opt.state[b]["exp_avg"].to_local())
            for a, b in zip(model.parameters(), fresh.parameters()))
        check_placements(model)  # no error: every placement is held

        # a placement a snapshot cannot hold: named before the first step
        odd = torch.nn.Linear(2, 2)
        odd.weight = torch.nn.Parameter(DTensor.from_local(torch.zeros(2, 2), mesh["tp"],
                                                           [Partial()]))
        try:
            check_placements(odd)
            out["partial"] = "accepted"
        except UsageError as exc:
            out["partial"] = str(exc)

        # pipeline stages: (pp, dp_shard), each stage's blocks on the dp_shard sub-mesh
        pmesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("pp", "dp_shard"))
        torch.manual_seed(1234)
        stage = TokenMLP().stage(pmesh["pp"].get_local_rank(), 2)
        fully_shard(stage, mesh=pmesh["dp_shard"])
        names = ("pp", "dp_shard")
        for stages in ((), ("pp",)):
            replicate = infer_replicate(names, stage.parameters(), stages)
            spec = MeshSpec((2, 2), names, replicate, stages)
            try:
                check_replicas_agree(spec, stage)
                out[f"stages={stages}"] = f"agreed, replicate={replicate}"
            except UsageError as exc:
                out[f"stages={stages}"] = str(exc)
        dist.barrier()
        dist.destroy_process_group()
    except BaseException as exc:  # noqa: BLE001 - reported to the parent
        out["crashed"] = repr(exc)
    q.put((rank, out))


@pytest.fixture(scope="module")
def ranks() -> dict[int, dict]:
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    with tempfile.TemporaryDirectory() as tmp:
        procs = [ctx.Process(target=_worker, args=(r, tmp, q)) for r in range(4)]
        for p in procs:
            p.start()
        got = dict(q.get(timeout=180) for _ in range(4))
        for p in procs:
            p.join(30)
    assert not [o["crashed"] for o in got.values() if "crashed" in o], got
    return got


def test_fsdp_over_tensor_parallel_strided_shards_snapshot_and_restore_in_place(ranks):
    for out in ranks.values():
        assert any("_StridedShard" in p for p in out["placements"]), out["placements"]
        assert out["restored"] is True


def test_a_placement_no_snapshot_holds_is_refused_before_the_first_step_naming_it(ranks):
    for out in ranks.values():
        assert "cannot be recovered" in out["partial"] and "model.weight" in out["partial"]
        assert "Partial" in out["partial"] and "Shard(dim)" in out["partial"]


def test_an_undeclared_pipeline_stage_is_refused_on_every_rank_and_a_declared_one_agrees(ranks):
    for out in ranks.values():
        refused = out["stages=()"]
        assert "cannot be recovered" in refused and "['pp']" in refused, refused
        assert "Job(..., stages=('pp',))" in refused
        # each stage's first parameter named: other layers, not replicas
        assert "embed.weight" in refused and "blocks.2.up.weight" in refused
        assert out["stages=('pp',)"] == "agreed, replicate=()"


def test_disagreeing_is_pure_and_names_the_ranks_and_dimension():
    spec = MeshSpec((2, 2), ("pp", "dp"), replicate=("pp",))
    same = [("a", "x"), ("b", "y"), ("a", "x"), ("b", "y")]
    assert disagreeing(spec, same) is None
    wrong = disagreeing(spec, [("a", "x"), ("b", "y"), ("c", "z"), ("b", "y")])
    assert wrong is not None and "ranks 0 and 2" in wrong and "['pp']" in wrong
    with pytest.raises(HpctError, match="both as pipeline stages and as replicated"):
        MeshSpec((2, 2), ("pp", "dp"), replicate=("pp",), stages=("pp",))
    # a stage name the mesh lacks is no error (torchtitan makes a dimension only where its
    # degree is above 1); the structure check catches a mistyped one
    assert MeshSpec((4,), ("dp",), stages=("pp",)).shard_keys() == [0, 1, 2, 3]
