"""The in-process restart wrapper a training script uses.

    job = Job(model=model, optimizer=opt, seed=0)      # registers the training state
    def train_step(step):                              # one optimizer step, plain PyTorch
        loss = loss_fn(model(x_for(step, job.rank)), y)
        opt.zero_grad(); loss.backward(); job.allreduce_gradients(); opt.step()
        return loss.item()
    job.run(train_step, total_steps)                   # registers; a spare waits warm here

or, keeping the script's own loop (one optimizer step per batch; see loop.py):

    def train():                                       # called again after every restore
        for epoch in job.epochs(n_epochs):             # from the restored epoch
            sampler.set_epoch(epoch)                   # hpct_slurm.recovery.DistributedSampler
            for x, y in job.steps(loader):             # from the restored batch
                ...
    job.run(train)

On a fault the wrapper leaves the failed step's `except` block (the traceback would keep the
broken group's sockets open), tears the group down, runs health checks, tells the controller it
is ready with the steps it holds, waits for the next generation, re-forms the group, restores
the common step and re-enters the loop right after it. Survivors never exit.

Determinism: the wrapper reseeds python/numpy/torch RNGs from (seed, rank, step) before every
step, and gradients are reduced parameter by parameter in a fixed order, so a run that recovers
from a fault is bit-identical to one that never saw it.
"""
from __future__ import annotations

import contextlib
import dataclasses
import datetime
import faulthandler
import gc
import hashlib
import os
import random
import socket
import threading
import time
import traceback
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator, TypeVar

import numpy as np
import torch
import torch.distributed as dist

from .. import protocol as P
from ..config import JobSettings
from ..errors import HpctError
from ..events import Ev, EventLog
from ..rendezvous import derive as rdv
from ..rendezvous import pg
from ..rendezvous.store import make_store, serve_shard
from ..slurm.env import SlurmEnv
from .background import Background
from .client import ControllerAddress, CoordinationClient
from .gradients import average_gradients, parameter_gradients
from .health import health_check
from .loop import StepLoop
from .persist import DiskPersister
from ..relay.node import NodeRelay, publish, published, relay_file
from .sharding import MeshSpec, infer_replicate
from .snapshot import (DEFAULT_SNAPSHOT_EVERY, ReplicaStore, Snapshot, SnapshotStore,
                       choose_mode, replica_peer_rank)
from .state import TrainState
from .striped import Prefetch
from .transfer import ReplicaPusher, TransferServer, fetch_state

STEP_SEED_DOMAIN = b"hpct-step-seed"
T = TypeVar("T")
LOST = "controller connection lost"
TEARDOWN_TIMEOUT_S = 20.0
LAZY_FULL_EVERY = 16
TEARDOWN_DIAG_S = 15  # dump every thread's stack to the step log just before giving up  # the client's Goodbye reason when the socket died


class _Stopped(Exception):
    """The controller asked this rank to stop the current generation."""


class _TeardownHung(Exception):
    """The broken group could not be destroyed: this process cannot form another one."""


def step_seed(seed: int, rank: int, step: int) -> int:
    """A 63-bit seed that depends only on (seed, rank, step): data order and dropout of any
    step can be reproduced by any process that takes over the rank."""
    h = hashlib.blake2b(f"{seed}:{rank}:{step}".encode(), digest_size=8, key=STEP_SEED_DOMAIN)
    return int.from_bytes(h.digest(), "big") >> 1


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % (2**32))
    torch.manual_seed(seed)


class Job:
    """One rank (or warm spare) of an hpct-slurm job: registers the training state, forms the
    process group of every generation and restarts the training in place after a fault.

    What a script reads, set once this process holds a rank (inside `run`) and kept after it:
    `rank` (-1 while it never held one), `world_size`, `generation` (0 at the first start, one
    more after every recovery), `losses` (step -> the loss this process recorded for it),
    `state` (the registered `TrainState`; `state.extras` takes small values of this rank's
    own), `run_dir` (the job's run directory, $HPCT_RUN_DIR), `model`, `optimizer` and
    `lr_scheduler` (those given, or for a sharded job those `build(mesh)` returned for this
    generation: use them in the step, not ones kept from an earlier generation) and `mesh`
    (a sharded job's DeviceMesh of this generation).
    """

    def __init__(self, model: torch.nn.Module | None = None,
                 optimizer: torch.optim.Optimizer | None = None,
                 lr_scheduler: Any = None, *, seed: int = 0, persist_every: int = 0,
                 recovery_mode: str | None = None, environ: dict[str, str] | None = None,
                 build: Callable[[Any], Any] | None = None,
                 mesh_shape: tuple[int, ...] | None = None,
                 mesh_dim_names: tuple[str, ...] | None = None,
                 replicate: tuple[str, ...] | None = None, device_type: str = "cpu",
                 settings: JobSettings | None = None, slurm: SlurmEnv | None = None,
                 transfer: Callable[..., TransferServer] = TransferServer,
                 client: Callable[..., CoordinationClient] = CoordinationClient,
                 persister: Callable[..., DiskPersister] = DiskPersister,
                 relay: Callable[..., NodeRelay] = NodeRelay,
                 **extra_state: Any):
        """`extra_state`: more objects with state_dict/load_state_dict; `sampler=` (and any
        name not known as shared) is this rank's own state, kept on the ring neighbour.
        `recovery_mode`: "jit", "replicated", or None/"auto" (also $HPCT_RECOVERY_MODE).

        A sharded or hybrid-parallel job (FSDP2, HSDP, tensor parallelism) passes, instead of
        `model` and `optimizer`, `build(mesh) -> (model, optimizer[, lr_scheduler])` and its
        DeviceMesh's `mesh_shape` and `mesh_dim_names`: the wrapper creates the mesh
        (`init_device_mesh(device_type, ...)`) and calls `build` after every formation of
        the group, since a sharded model is bound to its group; the step function then uses
        `job.model`, `job.optimizer`, `job.lr_scheduler`. `replicate`: the names of the mesh
        dimensions the state is replicated over (HSDP's replicate dimension; none for 1-D
        FSDP); left out, they are inferred from the parameters' placements after the first
        build. Ranks that differ only on those dimensions hold the same state, and are each
        other's source after a fault (recovery/sharding.py).

        Configuration, collaborators and side effects are apart: `settings` (default: read
        from `environ`, i.e. what the controller put in the step's environment) and `slurm`
        (this task's SLURM_*) are the configuration; `transfer`, `client`, `persister` and
        `relay` build the transfer server, the controller connection, the disk persisters
        and a node's relay (the real classes unless a test passes fakes); nothing binds a
        socket or talks to the controller before `run` (`_start`)."""
        env = os.environ if environ is None else environ
        self.settings = s = settings if settings is not None else JobSettings.from_environ(env)
        self.slurm = slurm if slurm is not None else SlurmEnv.from_environ(env)
        # A spare borrowed from the cluster pool runs in a companion job but serves the main
        # job: its ports, messages and secret are the main job's.
        if s.served_job_id is not None:
            self.slurm = dataclasses.replace(self.slurm, job_id=s.served_job_id)
        self._make_transfer, self._make_client, self._make_persister, self._make_relay = (
            transfer, client, persister, relay)
        self.seed = seed
        self.role = s.role
        self.run_dir = Path(s.run_dir)
        self.store_kind = s.store
        self.collective_timeout_s = s.collective_timeout_s
        # Bounded so a member lost between assignment and formation costs at most this long;
        # warm spares make a normal formation take well under a second.
        self.init_timeout_s = s.init_timeout_s
        self._build = build
        self.mesh: Any = None
        self.mesh_spec: MeshSpec | None = None
        self._replicate_given = replicate
        if build is not None:
            if model is not None or optimizer is not None or lr_scheduler is not None:
                raise HpctError("Job takes either build=... (a sharded job) or model and "
                                "optimizer, not both")
            if mesh_shape is None or mesh_dim_names is None:
                raise HpctError("a sharded Job (build=...) needs mesh_shape and mesh_dim_names")
            self.mesh_spec = MeshSpec(tuple(mesh_shape), tuple(mesh_dim_names),
                                      tuple(replicate or ()))
            self.device_type = device_type
        elif model is None or optimizer is None:
            raise HpctError("Job needs model and optimizer (or build=... for a sharded job)")
        self.model, self.optimizer, self.lr_scheduler = model, optimizer, lr_scheduler
        self.state = TrainState(**extra_state)
        if model is not None:
            self.state.register(model=model, optimizer=optimizer)
        if lr_scheduler is not None:
            self.state.register(lr_scheduler=lr_scheduler)
        # The position of a loop the script writes itself (job.epochs / job.steps): the same
        # on every rank, so shared state, restored with the model.
        self.loop = StepLoop(self._seed_step, self._check_stop, self._end_step,
                             self._shard)
        self.state.register(scope="shared", hpct_loop=self.loop.position)
        # Plain data parallelism: every rank holds the whole model and optimizer, so the
        # just-in-time path applies: no steady-state copies of the big state to a peer, a
        # replacement pulls the shared state from any survivor; RNGs are rederived from
        # (seed, rank, step). `replicated` (forced, or a sharded optimizer) keeps this rank's
        # whole snapshot on its ring neighbour instead.
        mode = recovery_mode or s.recovery_mode
        self._mode_given = None if mode == "auto" else mode
        if self.mesh_spec is None:
            self.mode = choose_mode(self.state, self._mode_given,  # type: ignore[arg-type]
                                    data_parallel=True)
        else:
            # Each shard key held by two replicas or more: a lost rank's state is on a
            # survivor (jit). One holder per key (1-D FSDP): a ring copy in steady state.
            self.mode = self._sharded_mode(self.mesh_spec)
        self._every_given = s.snapshot_every
        every = self._every_given or DEFAULT_SNAPSHOT_EVERY
        self.snapshots = SnapshotStore(self.state, scopes=("shared",), every=every)
        # This rank's own small state (a sampler position, extras): its own snapshot, pushed
        # to the ring neighbour after every commit and persisted with the shared state.
        self.rank_snaps = (SnapshotStore(self.state, scopes=("rank",), every=every)
                           if self.state.has_rank_state() else None)
        self._pushed: SnapshotStore | None = None
        # Copy the parameters and optimizer state of step s while step s+1 computes (off the
        # critical path), or before step s returns. Default: overlap where the state lives on
        # a GPU (host cores idle during the step); not for CPU training, whose step already
        # uses every core: there the copy thread measured slower than the copy itself
        # (`hpct-slurm bench replication`, jit_k1 vs jit_k1_sync).
        self._overlap_given = (None if s.snapshot_overlap == "auto"
                               else s.snapshot_overlap == "1")
        # Between full commits, hold each step's shared state where it lies and copy it only
        # at a fault (see _lazy); 0 makes every step a full commit.
        self.lazy = s.snapshot_lazy
        self._set_mode(self.mode)
        if optimizer is not None:
            self._watch_optimizer(optimizer)
        self.replicas = ReplicaStore()
        self.pusher: ReplicaPusher | None = None
        self.rank_persister: DiskPersister | None = None
        self._peers: dict[int, tuple[str, int]] = {}
        self.secret = P.load_secret(s.secret_file)
        self.job_id = str(self.slurm.job_id)
        self.node = self.slurm.node_name or socket.gethostname()
        self.events = EventLog(
            self.run_dir / "events" / f"{self.node}-{self.slurm.localid}.jsonl",
            source=f"{self.node}/{self.slurm.localid}")
        self.persist_every = persist_every or s.persist_every
        self.persister: DiskPersister | None = None
        # Test fault injection: the ranks whose served copies rot in memory.
        self._corrupt_serve = s.corrupt_serve
        self.rank = -1
        self.world_size = 0
        self.generation = -1
        self.losses: dict[int, float] = {}
        self._ddp: torch.nn.parallel.DistributedDataParallel | None = None
        self.data_ranks: list[int] = []
        self.data_world = 0
        self._want_ddp = False
        self._controller_text = s.controller
        self._controller_addr = ControllerAddress.parse(s.controller)  # a bad one fails here
        # Set by _start, on the first run: the transfer server's socket, the controller
        # connection and the registration are side effects, not configuration.
        self.host_addr = ""
        self.transfer: TransferServer = None  # type: ignore[assignment]
        self.client: CoordinationClient = None  # type: ignore[assignment]
        self.relay: NodeRelay | None = None  # the node's relay, in its first local rank
        self._started = False
        self._teardown_bg: Background | None = None  # the broken group's, since the fault
        # Whether the step in progress reached its optimizer update, and the model whose
        # parameters carry the hooks that abandon a doomed step (_abandon)
        self._updating = False
        self._hooked: torch.nn.Module | None = None

    def _start(self) -> None:
        """Bind the transfer server, connect to the controller and register with it: from
        here on the controller counts this process as a rank or a warm spare."""
        if self._started:
            return
        self._started = True
        # Everything alive now (torch's modules, the script's model and data) lives as long as
        # the process: out of the collector's sight, the gc.collect() that frees the broken
        # group at a fault scans only what the training made since. Measured with the 100 MB
        # benchmark model: 0.25-0.58 s per full collection, ~0 frozen, of a survivor's
        # 0.9 s from fault to ready. (The cost: a cycle among these objects that becomes
        # garbage later is never collected.)
        gc.freeze()
        self.host_addr = rdv.resolve_host(self.node)
        self.transfer = self._make_transfer(self.secret, self.job_id, rank=-1,
                                            own=self.snapshots, replicas=self.replicas,
                                            rank_own=self.rank_snaps, host=self.host_addr,
                                            events=self.events)
        address = self._relay_address() if self.settings.relay else self._controller_addr
        self.client = self._make_client(address, self.secret, self.job_id, self.events)
        if self.relay is not None:
            self.client.keep_fds.add(self.relay.upstream_fd)
        # A STOP naming lost nodes aborts this generation's NCCL communicators at once, from
        # the client's receiving thread (a no-op for gloo, whose reads the STOP's cut ends).
        self.client.abort_comms = pg.abort_generation
        self.client.abort_timeout_s = self.settings.abort_timeout_s
        self.client.register(self.node, self.slurm.localid or 0, self.role, self.host_addr,
                             self.transfer.address[1])
        # the settings this rank runs with, whoever set them (the controller; a task prolog
        # must not override them): tests compare them with and without the SPANK plugin
        self.events.emit(Ev.RANK_REGISTERED, role=self.role, pid=os.getpid(), mode=self.mode,
                         rank_state=self.rank_snaps is not None,
                         settings={"collective_timeout_s": self.collective_timeout_s,
                                   "init_timeout_s": self.init_timeout_s,
                                   "store": self.store_kind})

    def _relay_address(self) -> ControllerAddress:
        """Where this rank's controller connection goes when its node's ranks share a relay
        (relay.py): the first local rank starts it and publishes its port, the others read it."""
        path = relay_file(self.run_dir, self.job_id, self.slurm.restart_count,
                          self.slurm.step_id, self.node)
        local = self.slurm.localid or 0
        if local != 0:
            return published(path, timeout=60.0)
        self.relay = self._make_relay(self._controller_addr, self.secret, self.job_id,
                                      self.node, self.role, local, self.events)
        publish(path, self.relay.address)
        return ControllerAddress(*self.relay.address)

    def _sharded_mode(self, spec: MeshSpec) -> str:
        if self._mode_given is not None:
            return choose_mode(self.state, self._mode_given)  # type: ignore[arg-type]
        return "jit" if spec.replicas >= 2 else "replicated"

    def _set_mode(self, mode: str) -> None:
        self.mode = mode
        self.snapshots.scopes = ("shared",) if mode == "jit" else ("shared", "rank")
        # What goes to the ring neighbour after each commit, synchronously: the neighbour then
        # always holds the step this rank last committed (and the one before).
        self._pushed = self.snapshots if mode == "replicated" else self.rank_snaps
        # Full commits every step, unless the steps between can be held lazily: then every
        # LAZY_FULL_EVERY steps (what a fault inside an optimizer step rolls back to at most)
        if self._every_given is None:
            self.snapshots.every = LAZY_FULL_EVERY if self._lazy() else DEFAULT_SNAPSHOT_EVERY

    def _key(self, rank: int) -> int:
        """`rank`'s shard key: ranks with the same key hold the same shared state (every rank
        does under plain data parallelism)."""
        return self.mesh_spec.shard_key(rank) if self.mesh_spec is not None else 0

    def _build_generation(self) -> None:
        """A sharded job's mesh, model, optimizer and scheduler for this generation's group,
        built the same way on every rank (the restore then overwrites their state)."""
        from torch.distributed.device_mesh import init_device_mesh

        assert self.mesh_spec is not None and self._build is not None
        spec = self.mesh_spec
        if spec.world_size != self.world_size:
            raise HpctError(f"the mesh {spec.shape} needs {spec.world_size} ranks, the job "
                            f"has {self.world_size}: a sharded job runs on all its positions")
        # The mesh's sub-groups take torch's default timeout (30 min for gloo), not the
        # world group's: a collective on one whose peer is gone must fail as fast as one on
        # the world group.
        c10d = dist.distributed_c10d
        default = c10d.default_pg_timeout
        c10d.default_pg_timeout = datetime.timedelta(seconds=self.collective_timeout_s)
        try:
            self.mesh = init_device_mesh(self.device_type, spec.shape,
                                         mesh_dim_names=spec.names)
        finally:
            c10d.default_pg_timeout = default
        seed_everything(self.seed)  # the same initial weights on every rank
        built = self._build(self.mesh)
        if not isinstance(built, tuple) or len(built) not in (2, 3):
            raise HpctError("build(mesh) must return (model, optimizer) or "
                            "(model, optimizer, lr_scheduler)")
        self.model, self.optimizer = built[0], built[1]
        self.lr_scheduler = built[2] if len(built) == 3 else None
        self.state.register(model=self.model, optimizer=self.optimizer)
        self._watch_optimizer(self.optimizer)
        if self.lr_scheduler is not None:
            self.state.register(lr_scheduler=self.lr_scheduler)
        if self._replicate_given is None:
            inferred = infer_replicate(spec.names, self.model.parameters())
            if inferred != spec.replicate:
                self.mesh_spec = spec = dataclasses.replace(spec, replicate=inferred)
                self._set_mode(self._sharded_mode(spec))
                self.events.emit(Ev.RANK_MESH_INFERRED, rank=self.rank, replicate=inferred,
                                 mode=self.mode)
        self.state.mesh, self.state.replicate = self.mesh, spec.replicate

    def _release_generation(self) -> None:
        """Drop this generation's sharded model and mesh: they hold the broken group, which
        must go before a new one forms; the restore comes from the snapshots' bytes."""
        if self._build is None:
            return
        self.state.unregister("model", "optimizer", "lr_scheduler")
        self.model = self.optimizer = self.lr_scheduler = self.mesh = None
        self.state.mesh = None

    # ---- what the training step calls --------------------------------------------------
    @property
    def ddp(self) -> "torch.nn.parallel.DistributedDataParallel":
        """The model wrapped in DistributedDataParallel for the current generation.

        Re-created after every re-formation (a DDP module is bound to its process group), with
        a comm hook that reduces each parameter's gradient on its own: DDP rebuilds its buckets
        after the first iteration, and summing a bucket flat would make the result depend on
        when DDP was created, so a recovered run would drift from an uninterrupted one."""
        self._want_ddp = True
        if self._ddp is None:
            if not dist.is_initialized():
                raise HpctError("job.ddp is only available inside job.run(...)")
            self._ddp = _fixed_order_ddp(self.model, self.client)
        return self._ddp

    def allreduce_gradients(self) -> None:
        """Average gradients over the group in a fixed per-parameter order (bit-reproducible
        across re-formed groups, unlike DDP's rebuilt buckets)."""
        with _collective(self.client):
            average_gradients(parameter_gradients(self.model), self.data_world)

    @property
    def step(self) -> int:
        """The index of the optimizer step in progress (counting from 0 over the whole run,
        the same on every rank): `job.losses[job.step] = loss.item()` records a loss."""
        return self.loop.step

    def epochs(self, n: int) -> Iterator[int]:
        """For a loop function given to `job.run(train)`: the epochs of `n` still to run,
        from the one the restored step is in (0 on a fresh start)."""
        return self.loop.epochs(n)

    def steps(self, loader: Iterable[T]) -> Iterator[T]:
        """For a loop function given to `job.run(train)`: this epoch's batches of `loader`
        still to run, from the restored one; each is one optimizer step. A step ends when the
        loop asks for the next batch, or, for an epoch's last, for the next epoch (the code
        after the batches belongs to that step): then it is snapshotted and reported, and a
        stop from the controller is honoured. Its randomness is seeded from (seed, rank, step)
        before its batch is fetched. A `hpct_slurm.recovery.DistributedSampler` as the
        loader's `sampler` is given this rank's shard and started at the restored sample; any
        other loader is fast-forwarded by fetching and dropping the batches already done."""
        return self.loop.steps(loader)

    # ---- the loop -----------------------------------------------------------------------
    def run(self, train_step: Callable[..., Any] | None, total_steps: int | None = None, *,
            micro_step: Callable[[int], Any] | None = None) -> bool:
        """Train to the end. True when this process trained to the end; False when it stayed a
        spare that was never needed, or left before the end (fenced, the job escalated or was
        terminated): then its state is not the final one.

        Three forms; in each, a step's randomness is seeded from (seed, rank, step) first:
        * `job.run(train)`: `train()` is the script's own loop, over `job.epochs(n)` and
          `job.steps(loader)` (one optimizer step per batch). It is called once, and again
          after every restore, when those two continue right after the restored step; the
          training ends when it returns.
        * `job.run(train_step, total_steps)`: `train_step(step)` is one whole optimizer step,
          called for each step up to `total_steps - 1`; what it returns, if a number, is
          recorded in `job.losses[step]`.
        * `job.run(None, total_steps, micro_step=micro_step)`, for jobs that may shrink when no
          spare is left: `micro_step(step)` is forward and backward of this rank's batch
          only; the wrapper then zeroes gradients, runs it once per data shard it owns
          (reseeded per shard), averages over the original world and steps the optimizer."""
        if total_steps is None:
            if train_step is None or micro_step is not None:
                raise HpctError("Job.run(train) takes the loop function alone; train_step "
                                "and micro_step need total_steps")
            loop_fn = train_step

            def train(start: int) -> int:
                return self._run_loop(loop_fn, start)
        else:
            if (train_step is None) == (micro_step is None):
                raise HpctError("Job.run needs exactly one of train_step or micro_step")
            step_fn = (self._accumulating_step(micro_step) if micro_step is not None
                       else self._single_shard_step(train_step))  # type: ignore[arg-type]
            total: int = total_steps

            def train(start: int) -> int:
                self._train(step_fn, start, total)
                return total - 1
        self._start()
        trained = False
        while True:
            msg = self.client.next_assignment()
            if isinstance(msg, P.Goodbye):
                # A spare that never trained holds nothing the job needs: it just leaves.
                if msg.reason == LOST and trained and self._controller_gone():
                    self._requeue_without_controller()
                self._shutdown(msg.reason)
                return trained and msg.reason == "done"
            trained = True
            failure = None
            try:
                self._adopt(msg)
                last = train(msg.restore_step + 1)
            except (RuntimeError, _Stopped, HpctError, dist.DistStoreError) as exc:
                failure = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
                where = _where(exc)
            if failure is None:
                self.snapshots.drop_pending()
                self._settle_snapshots(follow_ups=True)
                self.events.emit(Ev.RANK_FINISHED, rank=self.rank, step=last)
                self.client.state = "done"  # report first: tearing down is local work
                self.client.heartbeat_now()
                try:
                    self._teardown()
                except _TeardownHung as exc:  # training is done: only worth a record
                    self.events.emit(Ev.RANK_TEARDOWN_HUNG, rank=self.rank, error=str(exc))
                continue  # the controller says goodbye once every rank is done
            # Outside the except block from here on: the failed group can now really close.
            self._recover(failure, where)

    def _run_loop(self, train: Callable[[], Any], start: int) -> int:
        """The script's loop function, continuing at step `start`; the last step it ran."""
        self.loop.enter(start - 1)
        self.client.state = "running"
        train()
        self.loop.finish()  # the last step, if the loop left without asking for more
        return self.loop.step - 1

    def _train(self, step_fn: Callable[[int], Any], start: int, total: int) -> None:
        self.client.state = "running"
        for step in range(start, total):
            self._check_stop()
            self.loop.step = step
            self._end_step(step, step_fn(step))

    def _check_stop(self) -> None:
        """Leave at this step boundary if the controller asked, or is gone."""
        if self.client.stop_event.is_set():
            raise _Stopped(self.client.stop_reason)
        if self.client.closed.is_set():
            raise _Stopped(LOST)

    def _abandon(self) -> None:
        """From a module's forward and a parameter's gradient (hooks): leave a step that can
        never complete as soon as the STOP says so, not once it reaches its allreduce. A
        survivor still computing when a peer died otherwise finishes its forward and backward
        first (measured with the 100 MB benchmark model: the last survivors reported ready
        ~0.1 s after the STOP, all of it compute). Only before the step's optimizer update:
        the live state is then still the last step's, exactly what the fault captures."""
        c = self.client
        if c is not None and c.stop_doomed and c.stop_event.is_set() and not self._updating \
                and c.state in ("running", "collective") and c.stop_generation >= self.generation:
            raise _Stopped(c.stop_reason)

    def _hook_model(self) -> None:
        """Where _abandon is checked: before each module's forward, and as each trainable
        parameter's gradient is computed (a module backward hook would wrap the outputs and
        break in-place ops after them). Once per model; not for a model built per generation
        (a sharded job's modules carry FSDP's own hooks: left as they are, such a survivor
        leaves the step at its collective as before)."""
        model = self.model
        if model is None or model is self._hooked or self._build is not None:
            return
        for m in model.modules():
            m.register_forward_pre_hook(self._abandon_in_forward)
        for p in model.parameters():
            if p.requires_grad:
                p.register_hook(self._abandon_in_backward)
        self._hooked = model

    def _abandon_in_forward(self, *_: Any) -> None:
        # Under torch.compile the check is left out of the graph (dynamo reads is_compiling()
        # as a constant), so a compiled graph never depends on the client's thread state; a
        # compiled forward runs to its end, as before, and its backward is still checked.
        if not torch.compiler.is_compiling():
            self._abandon()

    def _abandon_in_backward(self, grad: torch.Tensor) -> None:
        if not torch.compiler.is_compiling():
            self._abandon()

    def _seed_step(self, step: int) -> None:
        seed_everything(step_seed(self.seed, self._shard()[0], step))

    def _end_step(self, step: int, out: Any = None) -> None:
        """After a step: its snapshot when one is due, the report to the controller."""
        self._updating = False  # the next step's forward and backward may be abandoned again
        if isinstance(out, (int, float)):
            self.losses[step] = float(out)
        # the same rule on every rank: the commit steps line up
        persist_due = bool(self.persist_every) and step % self.persist_every == 0
        if self.snapshots.due(step) or persist_due:
            self._commit_rank_state(step)
            if self._overlap():
                self.snapshots.commit_async(step, then=self._after_shared_commit)
            else:
                self._after_shared_commit(self.snapshots.commit(step))
        elif self._lazy():
            self.snapshots.prepare_lazy(step)
        self.client.step_done(step)
        self.events.emit(Ev.RANK_STEP, rank=self.rank, generation=self.generation,
                         step=step, loss=self.losses.get(step), data_ranks=self.data_ranks)

    def _shard(self) -> tuple[int, int]:
        """This rank's data shard and the number of shards, for scripts that train one."""
        if len(self.data_ranks) != 1:
            raise HpctError("the group shrank but this script trains one data shard per rank: "
                            "pass micro_step to Job.run to allow shrinking")
        return self.data_ranks[0], self.data_world

    def _overlap(self) -> bool:
        if self._overlap_given is not None:
            return self._overlap_given
        return self._on_gpu()

    def _on_gpu(self) -> bool:
        """Whether this rank trains on a GPU: a sharded job built on "cuda", or a model whose
        parameters are on one."""
        if self._build is not None:
            return self.device_type == "cuda"
        model = self.model
        return model is not None and any(p.is_cuda for p in model.parameters())

    def _backend(self) -> tuple[str, "torch.device | None"]:
        """The process group's backend ($HPCT_BACKEND; auto: NCCL on a GPU, gloo on CPU) and,
        for NCCL, the device its communicators bind to: the model's, else the current one."""
        backend = self.settings.backend
        if backend == "auto":
            backend = "nccl" if self._on_gpu() else "gloo"
        if backend != "nccl":
            return backend, None
        model = self.model
        device = next((p.device for p in model.parameters() if p.is_cuda), None) \
            if model is not None else None
        return backend, device or torch.device("cuda", torch.cuda.current_device())

    def _lazy(self) -> bool:
        """Whether the shared state of a step between full commits is held without a copy
        (SnapshotStore.prepare_lazy). Only where every survivor's live state at a fault is
        a state the group can restore: jit mode (a replicated ring push needs the bytes) and
        no per-rank state (a lost rank's position may exist only at the step before, which
        live state no longer is)."""
        return self.lazy and self.mode == "jit" and self.rank_snaps is None

    def _commit_rank_state(self, step: int) -> None:
        """This rank's own small state, now: the next step moves it (a sampler position).
        In jit mode it is all that goes to the ring holder, synchronously: the holder then
        always holds the step this rank last committed (and the one before)."""
        if self.rank_snaps is not None:
            self.rank_snaps.commit(step)
            if self.rank_persister:
                self.rank_persister.after_commit(step)
        if self.pusher is not None and self._pushed is self.rank_snaps:
            self.pusher.after_commit(step)
            self.pusher.flush()  # bounded by the pusher's timeout; a failure is an event

    def _after_shared_commit(self, snap: Snapshot) -> None:
        """After the shared state of a step is copied (on the snapshot thread when the copy
        overlaps the next step): its save to disk, and in replicated mode its ring push."""
        try:
            if self.persister:
                self.persister.after_commit(snap.step)
            if self.pusher is not None and self._pushed is self.snapshots:
                self.pusher.after_commit(snap.step)
                self.pusher.flush()
        except Exception as exc:  # noqa: BLE001 - a lost copy is an event, not a fault
            self.events.emit(Ev.SNAPSHOT_FOLLOW_UP_FAILED, rank=self.rank, step=snap.step,
                             error=f"{type(exc).__name__}: {exc}")

    def _settle_snapshots(self, follow_ups: bool = False) -> None:
        """Wait for the background copy of the last commit (and, with `follow_ups`, its save
        and push): what this process reports holding must be complete."""
        try:
            self.snapshots.wait() if follow_ups else self.snapshots.wait_copied()
        except Exception as exc:  # noqa: BLE001 - that snapshot is simply not held
            self.events.emit(Ev.SNAPSHOT_COPY_FAILED, rank=self.rank,
                             error=f"{type(exc).__name__}: {exc}")

    def _capture_pending(self) -> None:
        """A fault between two optimizer steps: the live parameters and optimizer state are
        exactly the last step's, so they become its snapshot now (SnapshotStore.prepare_lazy)."""
        try:
            snap = self.snapshots.finish_pending()
        except Exception as exc:  # noqa: BLE001 - that step is simply not held
            self.events.emit(Ev.SNAPSHOT_COPY_FAILED, rank=self.rank, error=f"{exc}")
            return
        if snap is not None:
            self.events.emit(Ev.SNAPSHOT_CAPTURED_AT_FAULT, rank=self.rank, step=snap.step,
                             nbytes=snap.layout.nbytes)

    def _watch_optimizer(self, optimizer: Any) -> None:
        """Before each optimizer step: drop a lazily held step (the live state stops being
        it) and wait for the background copy of the last commit (it reads what that step is
        about to change)."""
        optimizer.register_step_pre_hook(lambda *_: self._before_update())

    def _before_update(self) -> None:
        self._updating = True
        self.snapshots.before_optimizer_step()

    def _single_shard_step(self, train_step: Callable[[int], Any]) -> Callable[[int], Any]:
        def step_fn(step: int) -> Any:
            self._seed_step(step)
            return train_step(step)
        return step_fn

    def _accumulating_step(self, micro_step: Callable[[int], Any]) -> Callable[[int], Any]:
        def step_fn(step: int) -> Any:
            self.optimizer.zero_grad()
            outs = []
            for shard in self.data_ranks:
                seed_everything(step_seed(self.seed, shard, step))
                outs.append(micro_step(step))
            # sum over every shard of the original world, then average by that world: the
            # same global batch and the same update size however many ranks remain
            self.allreduce_gradients()
            self.optimizer.step()
            return outs[0]
        return step_fn

    def _recover(self, failure: str, where: str = "") -> None:
        t0 = time.time()
        self.events.emit(Ev.RANK_FAULT, rank=self.rank, generation=self.generation,
                         error=failure, where=where, stop_reason=self.client.stop_reason)
        self._settle_snapshots()
        self._capture_pending()
        self._release_generation()
        # Ready does not wait for the broken group's teardown (gc, gloo's destructor): the
        # state is safe once captured, so the teardown runs on its own thread while the
        # controller decides and the replacement pulls its state; the next formation waits
        # for it (_await_teardown), and a teardown that hangs ends this process there.
        self._await_teardown()  # one still running from a fault before (a STOP mid-adoption)
        self._teardown_bg = Background("hpct-teardown-bg", self._teardown)
        healthy, detail = health_check()
        latest = self.snapshots.latest()
        self.client.step = latest.step if latest else -1
        # Holdings first: the controller chooses the restore step once every survivor is ready.
        self.client.report_holdings(self._holdings(failure))
        self.client.state = "ready" if healthy else "unhealthy"
        self.client.heartbeat_now()
        self.events.emit(Ev.RANK_READY, rank=self.rank, healthy=healthy, detail=detail,
                         latest_step=self.client.step, teardown_s=time.time() - t0)
        if not healthy:
            self._shutdown(f"health check failed: {detail}")
            os._exit(3)  # a stuck gloo thread would hold up a normal interpreter exit

    # ---- generations --------------------------------------------------------------------
    def _adopt(self, a: P.Assign) -> None:
        t0 = time.time()
        self._settle_snapshots(follow_ups=True)  # its push uses the pusher replaced below
        # Own snapshots exist only once this process trained or restored for its position
        # (see _hold_restored): then it restores from itself first.
        held_state = bool(self.snapshots.slots.steps())
        # The rank and generation first: whatever happens next, this process reports (ready,
        # holdings) as the rank it was assigned, which is what the controller waits for.
        self.rank, self.world_size, self.generation = a.rank, a.world_size, a.generation
        self.data_ranks = list(a.data_ranks) or [a.rank]
        self.data_world = a.data_world or a.world_size
        self.client.rank, self.client.generation = a.rank, a.generation
        # A STOP for the generation being adopted can overtake the adoption (a second fault
        # right after the assignment): it must survive, or this rank would wait for the dead
        # peer in init. Only older STOPs are done with.
        if self.client.stop_generation < a.generation:
            self.client.stop_event.clear()
            self.client.stop_reason = ""
        elif self.client.stop_event.is_set():
            raise _Stopped(self.client.stop_reason)
        self.client.state = "forming"
        self.transfer.rank = a.rank
        self.transfer.corrupt_on_serve = a.rank in self._corrupt_serve
        # A newcomer pulls its state from every source at once while the group forms.
        prefetch = self._prefetch(a, held_state)
        self._await_teardown()
        info = rdv.derive(self.slurm, a.generation, members=a.member_nodes(),
                          tasks_per_node=a.tasks_per_node,
                          collective_timeout_s=self.collective_timeout_s,
                          init_timeout_s=self.init_timeout_s,
                          allowed_nodes=a.member_nodes())  # the controller vouches for its members
        if info.rank != a.rank:
            raise HpctError(f"controller assigned rank {a.rank} but the derived layout puts "
                            f"{self.slurm.node_name}/{self.slurm.localid} at rank {info.rank}")
        shard = None
        if self.store_kind == "rootless" and info.local_rank == 0:
            shard = serve_shard(info, self.secret, events=self.events)
        store = make_store(self.store_kind, info, self.secret)
        # A STOP while the group forms (a member lost meanwhile) must interrupt the formation,
        # as it interrupts a collective: the rootless store aborts its pending requests. (Stock
        # TCPStore cannot be interrupted: such a rank waits out the init timeout.)
        self.client.on_stop = getattr(store, "abort", None)
        try:
            if self.client.stop_event.is_set() and self.client.on_stop is not None:
                self.client.on_stop()  # the STOP arrived before the hook was in place
            backend, device_id = self._backend()
            pg.init(info, store, backend, shard=shard, device_id=device_id,
                    init_timeout=datetime.timedelta(seconds=info.init_timeout_s),
                    collective_timeout=datetime.timedelta(seconds=self.collective_timeout_s))
        finally:
            self.client.on_stop = None
        if self._build is not None:
            self._build_generation()
        self._hook_model()
        self._updating = False
        t_formed = time.time()
        source = "creation"
        if a.restore_step >= 0 or a.generation > 0:
            # Every recovery restores, a fault during step 0 included (to the state at
            # creation, step -1): survivors may have moved their own state (a sampler position)
            # before it failed. A survivor holds the restore step itself, whatever its new
            # rank (shared state is the same on every rank); a newcomer pulls it from a peer.
            source = self._restore(a, survivor=held_state, prefetch=prefetch)
        self._hold_restored(a.restore_step)
        dropped = self.replicas.forget_after(a.restore_step)
        if dropped:
            self.events.emit(Ev.REPLICA_ROLLED_BACK, ranks=dropped, step=a.restore_step)
        if self._want_ddp:
            self._ddp = _fixed_order_ddp(self.model, self.client)
        # One copy on disk per shard key is enough (one for plain data parallelism): the
        # lowest rank of each key writes it.
        key = self._key(self.rank)
        first = min(r for r in range(self.world_size) if self._key(r) == key)
        if self.persist_every and self.persister is None and self.rank == first:
            self.persister = self._make_persister(self.snapshots, self.run_dir / "persist",
                                                  key, self.persist_every, self.events,
                                                  key=self.secret)
        if self.persist_every and self.rank_snaps is not None and \
                (self.rank_persister is None or self.rank_persister.rank != self.rank):
            if self.rank_persister:
                self.rank_persister.close()
            self.rank_persister = self._make_persister(
                self.rank_snaps, self.run_dir / "persist-rank", self.rank, self.persist_every,
                self.events, key=self.secret)
        self._ring(a)
        self.events.emit(Ev.RANK_ADOPTED, rank=a.rank, generation=a.generation,
                         restore_step=a.restore_step, source=source,
                         reform_s=t_formed - t0, restore_s=time.time() - t_formed)

    def _hold_restored(self, step: int) -> None:
        """Make this process's own snapshots hold the step it now stands at (the state at
        creation, step -1, on a first start): a newcomer that pulled its state from peers or
        disk is then a source itself if the next fault comes before its first commit, and a
        fault during step 0 has a state at creation to roll back to."""
        for store in (self.snapshots, self.rank_snaps):
            if store is None:
                continue
            # After a rollback (a restore from disk) newer snapshots belong to a history that
            # no longer happens: offering them in the next fault would mix two histories.
            for newer in [s for s in store.slots.steps() if s > step]:
                with store.lease(newer) as snap:
                    if snap is not None:
                        store.slots.discard(snap)
            if step not in store.slots.steps():
                store.commit(step)

    def _holdings(self, error: str) -> P.Holdings:
        """What this process can restore from, for the controller's choice of restore step.
        Its snapshots always belong to the position it holds (a newcomer has none until its
        restore succeeded), so every step listed here is one it can really serve."""
        rank_steps = self.rank_snaps.slots.steps() if self.rank_snaps is not None else []
        return P.Holdings(self.rank, self.generation, self.mode, self.rank_snaps is not None,
                          self.snapshots.slots.steps(), rank_steps,
                          {r: self.replicas.steps(r) for r in self.replicas.ranks()}, error,
                          self.mesh_spec.shard_keys() if self.mesh_spec is not None else [])

    def _ring(self, a: P.Assign) -> None:
        """Point the replica pusher at this generation's ring holder (the same local rank on
        the node half the ring away: snapshot.replica_peer)."""
        self._peers = {int(r): (str(h), int(p)) for r, (h, p) in a.peers.items()}
        if self.mesh_spec is not None:
            self.client.group_addrs = {h for h, _ in self._peers.values()} - {self.host_addr}
        n = len(a.member_nodes())
        if self.pusher is not None:
            self.pusher.close()
            self.pusher = None
        if self._pushed is None or n < 2 or not self.data_ranks == [self.rank]:
            return  # no ring of one node; after a shrink positions move: disk is the copy
        peer = replica_peer_rank(self.rank, n, a.tasks_per_node)
        if peer not in self._peers:
            raise HpctError(f"the assignment names no transfer address for rank {peer}, "
                            f"rank {self.rank}'s replica holder")
        self.pusher = ReplicaPusher(self._pushed, self.rank, self._peers[peer], self.secret,
                                    self.job_id, self.events, timeout=self.collective_timeout_s)

    @staticmethod
    def _leaving(a: P.Assign) -> list[tuple[str, int]]:
        """The live process that held this rank's position before a planned move (the
        controller lists it as the source of that rank; a fault's sources are survivors
        only, none of them at a newcomer's position)."""
        return [(str(h), int(p)) for r, addrs in a.sources.items() if int(r) == a.rank
                for h, p in addrs[:1]]

    def _holder(self, a: P.Assign) -> list[tuple[str, int]]:
        """Where this rank's ring replica lives: the neighbour in the (unchanged) ring."""
        if len(a.member_nodes()) < 2:
            return []
        peer = replica_peer_rank(a.rank, len(a.member_nodes()), a.tasks_per_node)
        return [(str(h), int(p)) for r, (h, p) in a.peers.items() if int(r) == peer]

    def _prefetch(self, a: P.Assign, survivor: bool) -> Prefetch | None:
        """The striped pull of the shared state this process restores from its peers (a
        newcomer, or a survivor that does not hold the restore step: one that faulted a step
        behind the others), started now: it needs no process group. None where it restores
        otherwise (own copy, ring replica, creation) or no other source shares its key."""
        if a.restore_step < 0 or self.mode != "jit" or \
                (survivor and a.restore_step in self.snapshots.slots.steps()):
            return None
        key = self._key(a.rank)
        sources = [(int(r), (str(h), int(p))) for r, addrs in sorted(a.sources.items())
                   if int(r) != a.rank and self._key(int(r)) == key for h, p in addrs[:1]]
        if not sources:
            return None
        return Prefetch(sources, a.rank, self.secret, self.job_id, a.restore_step,
                        events=self.events, timeout=self.collective_timeout_s)

    def _restore(self, a: P.Assign, survivor: bool, prefetch: Prefetch | None = None) -> str:
        step = a.restore_step
        striped = prefetch.result() if prefetch is not None else None
        if striped is not None:
            self.state.restore_from(striped.layout, striped.data, scopes=("shared",))
            self._restore_rank_state(a, own=survivor)
            # The pulled bytes, checked on arrival, are the step this process now holds: its
            # snapshot as they are (_hold_restored then copies nothing).
            self.snapshots.adopt(step, striped.layout, striped.data, striped.leaves)
            return striped.source
        if step == -1 and not survivor:
            # Never trained: this process stands at the state at creation (its script built
            # the same model from the same seed; nothing moved its per-rank state yet).
            return "creation"
        if survivor:
            with self.snapshots.lease(step) as snap:
                if snap is not None and snap.verify():
                    self.state.restore_from(snap.layout, snap.data)
                    self._restore_rank_state(a, own=True)
                    return "own"
        if self.mode == "replicated":
            # exactly this rank's state, from the ring neighbour that holds its replica
            try:
                got = fetch_state(self._leaving(a) + self._holder(a), a.rank, self.secret,
                                  self.job_id, step=step, events=self.events)
            except HpctError as exc:
                self.events.emit(Ev.RESTORE_REPLICA_MISSING, rank=a.rank, step=step,
                                 error=exc.message)
            else:
                self.state.restore_from(got.layout, got.data)
                return got.source
        # Shared state is the same on every rank of a shard key (every rank under plain data
        # parallelism): try each such survivor in the controller's order, then the last
        # persisted snapshot of the key.
        key = self._key(a.rank)
        for src_rank, addrs in a.sources.items():
            if self._key(int(src_rank)) != key:
                continue
            try:
                got = fetch_state(addrs, int(src_rank), self.secret, self.job_id,
                                  step=step, events=self.events)
            except HpctError:
                continue
            self.state.restore_from(got.layout, got.data, scopes=("shared",))
            self._restore_rank_state(a, own=survivor)
            return got.source
        got = fetch_state([], key, self.secret, self.job_id, step=step,
                          disk_dir=str(self.run_dir / "persist"), events=self.events)
        if got.step != step:
            raise HpctError(f"disk holds step {got.step}, the group restores step "
                            f"{step}: the job must restart from disk")
        self.state.restore_from(got.layout, got.data, scopes=("shared",))
        self._restore_rank_state(a, own=survivor, disk=True)
        return got.source

    def _restore_rank_state(self, a: P.Assign, own: bool, disk: bool = False) -> None:
        """This rank's own small state at the restore step: from its own memory, else from the
        ring neighbour, else from disk. Nothing to do when none is registered."""
        if self.rank_snaps is None:
            return
        step = a.restore_step
        if own:
            with self.rank_snaps.lease(step) as snap:
                if snap is not None and snap.verify():
                    self.state.restore_from(snap.layout, snap.data, scopes=("rank",))
                    return
        got = None
        if not disk and (leaving := self._leaving(a)):
            # a planned move: the process leaving this position serves its own state first
            # (the ring holder may lack its last step: policy.plan_restore's `leaving`)
            with contextlib.suppress(HpctError):
                got = fetch_state(leaving, a.rank, self.secret, self.job_id, step=step,
                                  events=self.events, slot="rank")
        if got is None:
            got = fetch_state([] if disk else self._holder(a), a.rank, self.secret,
                              self.job_id, step=step, disk_dir=str(self.run_dir / "persist-rank"),
                              events=self.events)
        if got.step != step:
            raise HpctError(f"rank {a.rank}'s own state (sampler, extras) exists at step "
                            f"{got.step} at best, the group restores step {step}")
        self.state.restore_from(got.layout, got.data, scopes=("rank",))

    def _controller_gone(self, probe_s: float = 3.0) -> bool:
        """Whether the controller's listening socket is really gone (its host died), not just
        this connection (a rejected or broken stream): then, and only then, requeue."""
        addr = ControllerAddress.parse(self._controller_text)
        deadline = time.monotonic() + probe_s
        while time.monotonic() < deadline:
            try:
                with socket.create_connection((addr.host, addr.port), timeout=1.0):
                    self.events.emit(Ev.RANK_CONTROLLER_ALIVE, rank=self.rank)
                    return False
            except OSError:
                time.sleep(0.2)
        return True

    def _requeue_without_controller(self) -> None:
        """The controller is gone: its node (the batch host) died, and with it the job's batch
        script. Slurm keeps such a --no-kill job RUNNING on the other nodes, so the ranks
        requeue it themselves; the restarted job resumes from the last persisted snapshot.
        Lowest rank first; the others find the job already requeued and leave it alone."""
        from ..slurm.client import SlurmClient

        time.sleep(0.5 * max(self.rank, 0))
        slurm = SlurmClient()
        try:
            job = slurm.show_job(self.slurm.job_id)
            if job.state == "RUNNING" and job.restart_count == self.slurm.restart_count:
                slurm.requeue(self.slurm.job_id)
                self.events.emit(Ev.RANK_REQUEUED_JOB, rank=self.rank, job_id=self.job_id,
                                 reason="controller lost")
        except HpctError as exc:
            self.events.emit(Ev.RANK_REQUEUE_FAILED, rank=self.rank, error=exc.message)

    def _teardown(self) -> None:
        self._ddp = None  # its reducer holds the group: it must go before the group can
        # A teardown that takes this long is a bug worth a stack trace in the step's log.
        faulthandler.dump_traceback_later(TEARDOWN_DIAG_S, exit=False)
        try:
            gc.collect()
            # Bounded: gloo's group destructor waits for its worker threads, and one stuck on a
            # pair to a dead peer was seen to wait for minutes. A process whose group will not
            # go away is not healthy; it says so and the controller replaces it.
            done = threading.Event()
            errors: list[BaseException] = []

            def destroy() -> None:
                try:
                    pg.teardown()
                except BaseException as exc:  # reported below, in the caller's thread
                    errors.append(exc)
                finally:
                    done.set()

            threading.Thread(target=destroy, daemon=True, name="hpct-teardown").start()
            if not done.wait(TEARDOWN_TIMEOUT_S):
                raise _TeardownHung(f"process group teardown did not finish within "
                                    f"{TEARDOWN_TIMEOUT_S:.0f} s")
            if errors:
                raise errors[0]
            gc.collect()
        finally:
            faulthandler.cancel_dump_traceback_later()

    def _await_teardown(self) -> None:
        """Before a new group forms: the old one's teardown, started at the fault, is done. One
        that hangs or fails leaves a process that cannot form another group: it says so and
        exits; the controller sees a member lost before the formation and replaces it."""
        bg, self._teardown_bg = self._teardown_bg, None
        if bg is None:
            return
        error = bg.wait(TEARDOWN_TIMEOUT_S + 5)
        if error is None:
            return
        self.events.emit(Ev.RANK_TEARDOWN_HUNG, rank=self.rank, error=str(error))
        self._shutdown(f"process group teardown failed: {error}")
        os._exit(3)  # a stuck gloo thread would hold up a normal interpreter exit

    def _shutdown(self, reason: str) -> None:
        self.events.emit(Ev.RANK_EXIT, rank=self.rank, reason=reason)
        if self.pusher:
            self.pusher.close()
        for persister in (self.persister, self.rank_persister):
            if persister:
                persister.close()
        self.transfer.close()
        self.client.close(reason)
        if self.relay is not None:
            self.relay.close()  # once the node's other ranks heard their Goodbyes too


class _collective:
    """Marks the rank's heartbeat state "collective" while it waits on its peers: a rank stuck
    there is waiting for someone else, so the controller's no-progress check blames only
    ranks stuck in their own computation ("running")."""

    def __init__(self, client: CoordinationClient):
        self.client = client

    def __enter__(self) -> None:
        if self.client.state == "running":
            self.client.state = "collective"

    def __exit__(self, *exc: Any) -> None:
        if self.client.state == "collective":
            self.client.state = "running"


def _per_parameter_allreduce(client, bucket):  # DDP checks hook annotations: leave them off
    """DDP comm hook: average each parameter's gradient with its own allreduce. Each sum then
    depends only on that parameter's tensor, never on how DDP grouped it into buckets."""
    with _collective(client):
        average_gradients(bucket.gradients(), dist.get_world_size(), concurrent=True)
    fut: torch.futures.Future[torch.Tensor] = torch.futures.Future()
    fut.set_result(bucket.buffer())
    return fut


def _fixed_order_ddp(model: torch.nn.Module, client: CoordinationClient
                     ) -> "torch.nn.parallel.DistributedDataParallel":
    ddp = torch.nn.parallel.DistributedDataParallel(model)
    ddp.register_comm_hook(client, _per_parameter_allreduce)
    return ddp


def _where(exc: BaseException, frames: int = 4) -> str:
    """Where a fault was raised: its innermost frames, innermost first (`file:line in fn`),
    so that an error from deep inside torch still names the call of ours that led to it."""
    tb = traceback.extract_tb(exc.__traceback__)[-frames:]
    return " < ".join(f"{Path(f.filename).name}:{f.lineno} in {f.name}" for f in reversed(tb))
