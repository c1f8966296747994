"""Fail-slow (issue 47) for a sharded job: FSDP2's own collectives run inside hpct-slurm's
collective marker (recovery/fsdp_waits.py), so a rank's waits in them are not its own time
and a slow rank stands out, on real gloo ranks; the training itself is unchanged."""
from __future__ import annotations

import datetime
import time

import torch
import torch.distributed as dist

from _ranks import gloo_processes

DELAY_S = 0.06  # rank 1's extra compute inside its forward, every step
STEPS = 8


class _Client:
    """What the marker (generation._collective) uses of a rank's CoordinationClient."""

    def __init__(self):
        from hpct_slurm.recovery.own_time import OwnTime
        self.states: list[str] = []  # every state the marker set, in order
        self.state, self.own = "running", OwnTime(50)

    @property
    def state(self) -> str:
        return self._state

    @state.setter
    def state(self, value: str) -> None:
        self._state = value
        self.states.append(value)


def _train(rank: int, timed: bool) -> tuple[tuple[float, int], int, list[bytes], list[str]]:
    from torch.distributed.fsdp import fully_shard

    from hpct_slurm.recovery.fsdp_waits import time_fsdp_waits
    from hpct_slurm.recovery.generation import _collective

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 1))
    if rank == 1:  # a slow GPU: its compute between FSDP's collectives takes longer
        model[1].register_forward_hook(lambda *_: time.sleep(DELAY_S))
    for layer in (model[0], model[2]):
        fully_shard(layer)
    fully_shard(model)
    client = _Client()
    installed = time_fsdp_waits(model, lambda: _collective(client)) if timed else 0
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    client.own.step_ends(0, time.monotonic())
    for step in range(STEPS):
        g = torch.Generator().manual_seed(100 * step + rank)
        x = torch.randn(8, 16, generator=g)
        loss = model(x).pow(2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        client.own.step_ends(0, time.monotonic())
    params = [p.full_tensor().detach().numpy().tobytes() for p in model.parameters()]
    # what a heartbeat would say while the rank waits in FSDP: every state the marker set
    return client.own.figure, installed, params, sorted(set(client.states))


def _worker(rank: int, port: int, q) -> None:
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=2, timeout=datetime.timedelta(seconds=60))
    torch.set_num_threads(1)
    q.put((rank, _train(rank, timed=True), _train(rank, timed=False)))
    dist.destroy_process_group()


def test_fsdp_waits_are_not_own_time_and_a_slow_rank_stands_out():
    (r0, t0, u0), (r1, t1, u1) = gloo_processes(2, _worker, timeout_s=60)
    assert (r0, r1) == (0, 1)
    (own0, n0), installed, params0, states0 = t0
    (own1, n1), _, params1, _ = t1
    assert installed == 2 and n0 == n1 == STEPS  # the two layers (the root holds none)
    # timed: rank 0 waited for rank 1 inside FSDP's collectives, and that is not its own
    assert own1 - own0 > DELAY_S / 2, (own0, own1)
    assert "collective" in states0 and u0[3] == ["running"]  # set by the timed comms only
    # untimed (as before): both ranks' own time is their whole, common step
    (uown0, _), (uown1, _) = u0[0], u1[0]
    assert abs(uown1 - uown0) < DELAY_S / 2, (uown0, uown1)
    # the training is the same with the timed collectives as with FSDP's own
    assert params0 == u0[2] and params1 == u1[2] and params0 == params1
