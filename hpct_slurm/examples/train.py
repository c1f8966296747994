"""The demo training job: a small MLP trained data-parallel under hpct-slurm.

The lines that make it recoverable are marked `# hpct`. Every rank writes its per-step losses
and a hash of its final parameters to the run directory, so runs can be compared bit for bit.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import signal
import threading
import time
from pathlib import Path
from typing import Callable

import torch

from hpct_slurm.examples import slowdown
from hpct_slurm.recovery import Job  # hpct


def build(hidden: int, layers: int = 1) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    """An MLP with `layers` hidden layers of width `hidden`; `layers` > 1 only deepens it
    (benchmarks use that for a large model state), layers=1 is the demo's model."""
    torch.manual_seed(1234)  # every rank starts from the same weights
    mods: list[torch.nn.Module] = [torch.nn.Linear(32, hidden), torch.nn.ReLU(),
                                   torch.nn.Dropout(0.1)]
    for _ in range(layers - 1):
        mods += [torch.nn.Linear(hidden, hidden), torch.nn.ReLU()]
    model = torch.nn.Sequential(*mods, torch.nn.Linear(hidden, 1))
    return model, torch.optim.Adam(model.parameters(), lr=1e-3)


class DataPosition:
    """Where this rank is in its data: the samples it has consumed. Per-rank state that no
    other rank has, so recovery must bring it back from the rank's ring replica (or disk)."""

    def __init__(self) -> None:
        self.consumed = 0

    def advance(self, rank: int, batch: int) -> None:
        self.consumed += batch * (rank + 1)  # rank-dependent on purpose: a wrong copy shows

    def state_dict(self) -> dict:
        return {"consumed": self.consumed}

    def load_state_dict(self, sd: dict) -> None:
        self.consumed = int(sd["consumed"])


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--layers", type=int, default=1, help="hidden layers of width --hidden")
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--step-sleep", type=float, default=0.0,
                    help="pause per step, to stand in for a real model's compute time")
    ap.add_argument("--micro", action="store_true",
                    help="hand the wrapper forward+backward only (allows an elastic shrink)")
    ap.add_argument("--ddp", action="store_true",
                    help="train through torch DistributedDataParallel (job.ddp)")
    # Fault injection for the tests (generation 0 only, so a restarted run goes through):
    ap.add_argument("--fail-at", type=int, default=None, metavar="STEP",
                    help="test: raise a RuntimeError in this step on --fault-rank")
    ap.add_argument("--hang-at", type=int, default=None, metavar="STEP",
                    help="test: block the training thread forever in this step on "
                         "--fault-rank (the process and its heartbeats stay alive)")
    ap.add_argument("--fault-rank", type=int, default=1)
    ap.add_argument("--script-error-at", type=int, default=None, metavar="STEP",
                    help="test: a bug in the script: this step raises on --fault-rank in every "
                         "generation, from inside torch (a layer called with the wrong shape), "
                         "so the job ends as the script's own error")
    ap.add_argument("--later-step-sleep", type=float, default=None, metavar="S",
                    help="--step-sleep from generation 1 on (after the first fault): a test "
                         "that waits for Slurm to notice a fault trains slowly only until then")
    ap.add_argument("--slow-at", type=int, default=None, metavar="STEP",
                    help="test: every rank sleeps --slow-s in this step, after moving its data "
                         "position and before the collective (a window to crash a node in)")
    ap.add_argument("--slow-s", type=float, default=2.0)
    slowdown.add_arguments(ap)
    ap.add_argument("--rank0-eval-s", type=float, default=0.0, metavar="S",
                    help="rank 0 alone spends S more seconds in every step, after its update "
                         "(an evaluation, logging, a checkpoint write): the others wait for it "
                         "at the next step's collective, yet its node is not slow")
    ap.add_argument("--fail-before-start", action="store_true",
                    help="test: raise before building the Job, on every rank (a script error)")
    ap.add_argument("--position", action="store_true",
                    help="register a per-rank data position (rank state kept on the ring "
                         "neighbour); a rank lost after its last collective of a step then "
                         "costs one recomputed step: its position for that step died with it")
    ap.add_argument("--sam", type=float, default=None, metavar="RHO",
                    help="sharpness-aware minimization: each step first moves the weights in "
                         "place by RHO along the gradient (outside optimizer.step()), then "
                         "computes the gradient there and steps from the original weights")
    ap.add_argument("--gan", action="store_true",
                    help="a second model and optimizer (a GAN's discriminator, registered as "
                         "shared state) updated before the main one in every step")
    ap.add_argument("--die-in-step", type=int, default=None, metavar="STEP",
                    help="the fault rank kills its own process (SIGKILL) inside STEP, where "
                         "the weights differ from the last step's outside the main optimizer "
                         "step: after SAM's move (--sam) or the second optimizer's update "
                         "(--gan); generation 0 only")
    args = ap.parse_args()
    torch.set_num_threads(1)
    torch.use_deterministic_algorithms(True)
    if args.fail_before_start:
        raise FileNotFoundError("injected: the dataset cache is missing")
    model, opt = build(args.hidden, args.layers)
    position = DataPosition()
    extra = {"sampler": position} if args.position else {}
    job = Job(model=model, optimizer=opt, seed=7, **extra)  # hpct
    disc, disc_opt = build_discriminator() if args.gan else (None, None)
    if disc is not None:
        job.state.register(scope="shared", disc=disc, disc_opt=disc_opt)  # hpct

    def die_here(step: int) -> None:
        if step == args.die_in_step and job.generation == 0 and job.rank == args.fault_rank:
            os.kill(os.getpid(), signal.SIGKILL)

    def inject(step: int) -> None:
        if step == args.script_error_at and job.rank == args.fault_rank:
            wrong_shape()
        if job.generation != 0 or job.rank != args.fault_rank:
            return
        if step == args.fail_at:
            raise RuntimeError(f"injected failure in step {step}")
        if step == args.hang_at:
            threading.Event().wait()

    def step_sleep() -> float:
        later = args.later_step_sleep
        return args.step_sleep if later is None or job.generation == 0 else later

    def train_step(step: int) -> float:  # hpct: one optimizer step
        loss = update(step)
        if args.rank0_eval_s and job.rank == 0:
            time.sleep(args.rank0_eval_s)
        return loss

    def update(step: int) -> float:
        inject(step)
        slowdown.load_delay(args, job.node, step, step_sleep())
        position.advance(job.rank, args.batch)
        if step == args.slow_at and job.generation == 0:
            time.sleep(args.slow_s)
        if args.ddp:  # plain DDP: the wrapper re-creates it for every generation
            return one_step(job.ddp, opt, args.batch, lambda: None, step_sleep())
        if disc is not None:
            gan_step(disc, disc_opt, args.batch, job.allreduce_gradients, lambda: die_here(step))
        if args.sam is not None:
            return sam_step(model, opt, args.batch, job.allreduce_gradients, args.sam,
                            lambda: die_here(step))
        return one_step(model, opt, args.batch, job.allreduce_gradients, step_sleep())

    def micro_step(step: int) -> float:  # forward + backward only: the job may shrink
        position.advance(job.rank, args.batch)
        return forward_backward(model, args.batch, step_sleep())

    trained = (job.run(None, args.steps, micro_step=micro_step) if args.micro
               else job.run(train_step, args.steps))  # hpct
    if trained:
        write_result(job.run_dir, job.rank, model, job.losses,
                     position.consumed if args.position else None, disc)


def wrong_shape() -> None:
    """The script's bug of --script-error-at: layers fed a batch of the wrong width, which
    torch refuses several frames down (the traceback's innermost frames are torch's)."""
    torch.nn.Sequential(torch.nn.Linear(3, 4))(torch.zeros(2, 5))


def forward_backward(model: torch.nn.Module, batch: int, step_sleep: float = 0.0) -> float:
    # data for (rank, step): the caller seeded the RNG from (seed, rank, step)
    x = torch.randn(batch, 32)
    y = x[:, :4].sum(dim=1, keepdim=True)
    loss = torch.nn.functional.mse_loss(model(x), y)
    loss.backward()
    if step_sleep:
        time.sleep(step_sleep)
    return loss.item()


def one_step(model: torch.nn.Module, opt: torch.optim.Optimizer, batch: int,
             allreduce: Callable[[], None], step_sleep: float = 0.0) -> float:
    opt.zero_grad()
    loss = forward_backward(model, batch, step_sleep)
    allreduce()  # fixed-order reduction
    opt.step()
    return loss


def sam_step(model: torch.nn.Module, opt: torch.optim.Optimizer, batch: int,
             allreduce: Callable[[], None], rho: float, in_window: Callable[[], None]) -> float:
    """One SAM step (Foret et al.): the gradient at w + rho * g/|g|, applied from w."""
    x = torch.randn(batch, 32)
    y = x[:, :4].sum(dim=1, keepdim=True)
    opt.zero_grad()
    loss = torch.nn.functional.mse_loss(model(x), y)
    loss.backward()
    allreduce()
    params = [p for p in model.parameters() if p.grad is not None]
    norm = torch.norm(torch.stack([p.grad.norm() for p in params]))
    moves = []
    with torch.no_grad():
        for p in params:
            e = p.grad * (rho / (norm + 1e-12))
            p.add_(e)  # in place, outside optimizer.step(): the window
            moves.append(e)
    in_window()
    opt.zero_grad()
    torch.nn.functional.mse_loss(model(x), y).backward()
    allreduce()
    with torch.no_grad():
        for p, e in zip(params, moves):
            p.sub_(e)
    opt.step()
    return loss.item()


def build_discriminator() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(4321)
    disc = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.Tanh(), torch.nn.Linear(64, 1))
    return disc, torch.optim.SGD(disc.parameters(), lr=1e-2, momentum=0.9)


def gan_step(disc: torch.nn.Module, opt: torch.optim.Optimizer, batch: int,
             allreduce: Callable[[], None], after_update: Callable[[], None]) -> None:
    """The second optimizer's part of a step: its own update, before the main one's."""
    x = torch.randn(batch, 32)
    opt.zero_grad()
    torch.nn.functional.softplus(disc(x)).mean().backward()
    for p in disc.parameters():  # its own fixed-order reduction
        torch.distributed.all_reduce(p.grad)
        p.grad.div_(torch.distributed.get_world_size())
    opt.step()  # not the optimizer given to Job
    after_update()


def write_result(run_dir: Path, rank: int, model: torch.nn.Module,
                 losses: dict[int, float], consumed: int | None = None,
                 disc: torch.nn.Module | None = None) -> None:
    digest = hashlib.sha256()
    for p in model.parameters():
        digest.update(p.detach().numpy().tobytes())
    for p in disc.parameters() if disc is not None else ():
        digest.update(p.detach().numpy().tobytes())
    out = Path(run_dir) / "results" / f"rank{rank}.json"
    out.parent.mkdir(exist_ok=True)
    out.write_text(json.dumps({"rank": rank, "params_sha256": digest.hexdigest(),
                               "losses": {str(k): v for k, v in sorted(losses.items())},
                               "node": os.environ.get("SLURMD_NODENAME"),
                               "consumed": consumed}))


if __name__ == "__main__":
    main()
