"""The gradient all-reduce's fixed layout (pure) and the fixed-order DDP on a real gloo group:
its sums do not depend on DDP's buckets, so a fresh DDP (every generation makes one) steps bit
for bit as a long-lived one, in one all_reduce per chunk rather than one per gradient."""
from __future__ import annotations

import datetime

import torch

from hpct_slurm.recovery.gradients import chunk_layout
from hpct_slurm.recovery.own_time import OwnTime

from _ranks import gloo_processes

WORLD = 3


def test_layout_groups_consecutive_tensors_of_one_kind_up_to_the_chunk_size():
    f32 = [torch.zeros(10), torch.zeros(5), torch.zeros(20)]
    assert chunk_layout(f32, chunk_bytes=1 << 20) == [[0, 1, 2]]
    assert chunk_layout(f32, chunk_bytes=60) == [[0, 1], [2]]  # 40 + 20 bytes, then 80
    mixed = [torch.zeros(4), torch.zeros(4, dtype=torch.bfloat16), torch.zeros(4),
             torch.zeros(4)]
    assert chunk_layout(mixed) == [[0], [1], [2, 3]]
    sparse = [torch.zeros(3), torch.zeros(3).to_sparse(), torch.zeros(3)]
    assert chunk_layout(sparse) == [[0], [1], [2]]
    assert chunk_layout([]) == []


class _Client:  # what the hook uses of a rank's CoordinationClient
    state = "running"
    own = OwnTime(50)


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    # A second input path makes gradients become ready in another order than the parameters'
    # reverse, so DDP's rebuilt buckets differ from its first ones; tiny buckets make many.
    class Two(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a = torch.nn.Linear(8, 16)
            self.b = torch.nn.Linear(16, 16)
            self.side = torch.nn.Linear(8, 16)
            self.out = torch.nn.Linear(16, 1)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.out(torch.relu(self.b(torch.relu(self.a(x)))) + self.side(x))

    return Two()


def _steps(model, make_ddp, fresh_every_step: bool, rank: int, n: int) -> list[bytes]:
    import torch.distributed as dist

    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    g = torch.Generator().manual_seed(100 + rank)
    ddp = make_ddp(model)
    out = []
    for _ in range(n):
        if fresh_every_step:
            ddp = make_ddp(model)  # a new generation's DDP: its first buckets again
        x = torch.randn(32, 8, generator=g)
        opt.zero_grad()
        ddp(x).pow(2).mean().backward()
        opt.step()
        out.append(b"".join(p.detach().numpy().tobytes() for p in model.parameters()))
    dist.barrier()
    return out


def _worker(rank: int, port: int, q) -> None:
    import torch.distributed as dist

    from hpct_slurm.recovery.generation import _canonical_allreduce, _CanonicalReduce
    from hpct_slurm.recovery.gradients import average_gradients, parameter_gradients

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=WORLD, timeout=datetime.timedelta(seconds=60))
    calls = {"n": 0}
    real = dist.all_reduce

    def counting(*a, **k):
        calls["n"] += 1
        return real(*a, **k)

    dist.all_reduce = counting

    def canonical(model):
        ddp = torch.nn.parallel.DistributedDataParallel(model, bucket_cap_mb=0.0005)
        ddp.register_comm_hook(_CanonicalReduce(_Client(), model), _canonical_allreduce)
        return ddp

    long_lived = _steps(_model(), canonical, False, rank, 4)
    calls_before = calls["n"]
    fresh = _steps(_model(), canonical, True, rank, 4)
    per_step = (calls["n"] - calls_before) // 4

    # by hand, no DDP: the same function over the parameters' gradients
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    g = torch.Generator().manual_seed(100 + rank)
    manual = []
    for _ in range(4):
        x = torch.randn(32, 8, generator=g)
        opt.zero_grad()
        model(x).pow(2).mean().backward()
        average_gradients(parameter_gradients(model), WORLD)
        opt.step()
        manual.append(b"".join(p.detach().numpy().tobytes() for p in model.parameters()))
    dist.all_reduce = real
    dist.destroy_process_group()
    q.put((rank, long_lived == fresh, long_lived == manual, per_step,
           len(list(model.parameters())), long_lived[0] != long_lived[-1]))


def test_a_fresh_ddp_steps_bit_for_bit_as_a_long_lived_one_in_one_all_reduce():
    got = gloo_processes(WORLD, _worker)
    for rank, same_as_fresh, same_as_manual, per_step, n_params, trained in got:
        assert trained, "the parameters never changed: the test compared nothing"
        assert same_as_fresh, f"rank {rank}: a fresh DDP per step diverged from a long-lived one"
        assert same_as_manual, f"rank {rank}: DDP's hook and average_gradients differ"
        # 8 gradients in one chunk: one all_reduce a step, not one per gradient
        assert (n_params, per_step) == (8, 1), (n_params, per_step)
