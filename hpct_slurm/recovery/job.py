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

This file holds the public API and the loop that drives the rest. `Job`'s own methods come in
three pieces: rank_round.py (this rank's side of a recovery round: a fault, then the next
assignment), stepping.py (what surrounds each training step) and inline.py (the inline form,
`Job.main`). The rooms it holds do the rest: generation.py forms and tears down each
generation's group (mesh, DDP), snapshot_policy.py decides how each step's snapshot is held and
where its copies go, restore.py chooses where a restore comes from, controller_loss.py requeues
the job when the controller's node died.
"""
from __future__ import annotations

import dataclasses
import gc
import os
import socket
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator, TypeVar

import torch

from .. import config as C
from .. import protocol as P
from ..config import JobSettings
from ..errors import HpctError, UsageError
from ..events import Ev, EventLog
from ..fdlimit import nofile_fields, raise_nofile
from ..relay.node import NodeRelay, publish, published, relay_file
from ..rendezvous import derive as rdv
from ..slurm.env import SlurmEnv
from .background import Background
from .client import ControllerAddress, CoordinationClient
from .controller_loss import ControllerLoss
from .generation import Generation, _TeardownHung, sharded_spec
from .inject import TakerFault
from .inline import LOOP_NAME, SHARED_NAMES, InlineForm
from .integrity import Integrity
from .layout_rules import MeshSpec, first_mode
from .loop import StepLoop
from .persist import DiskPersister
from .rank_round import _FAULTS, LOST, SCRIPT_ERRORS, RankRound, _describe, _where
from .restore import Restorer
from .seeds import seed_everything, step_seed  # re-exported: scripts import them from here
from .snapshot_policy import SnapshotPolicy
from .state import TrainState
from .stepping import Stepping
from .striped import Prefetch
from .transfer import TransferServer

__all__ = ["Job", "seed_everything", "step_seed"]

T = TypeVar("T")


class Job(InlineForm, RankRound, Stepping):
    """One rank (or warm spare) of an hpct-slurm job: registers the training state, forms the
    process group of every generation and restarts the training in place after a fault.

    What a script reads, set once this process holds a rank (inside `run`) and kept after it:
    `rank` (-1 while it never held one), `world_size`, `generation` (0 at the first start, one
    more after every recovery), `losses` (step -> the loss recorded for it on this rank, the
    steps before a takeover included),
    `state` (the registered `TrainState`; `state.extras` takes small values of this rank's
    own), `run_dir` (the job's run directory, $HPCT_RUN_DIR), `model`, `optimizer` and
    `lr_scheduler` (those given, or for a sharded job those `build(mesh)` returned for this
    generation: use them in the step, not ones kept from an earlier generation) and `mesh`
    (a sharded job's DeviceMesh of this generation).

    The inline form (a script whose loop sits in `main()` itself): `Job.main(main)` runs the
    script's `main`; a `Job(...)` made inside it takes its rank at once (warm spares wait
    there), and after a fault `main` runs again from its top. Its `Job(...)` is then this same
    object, the state just built registered in place of the last run's and restored, so the
    loop's `job.epochs`/`job.steps` continue right after the restored step (see `main`).
    """

    def __init__(self, model: torch.nn.Module | None = None,
                 optimizer: torch.optim.Optimizer | None = None,
                 lr_scheduler: Any = None, *, seed: int = 0, persist_every: int = 0,
                 recovery_mode: str | None = None, environ: dict[str, str] | None = None,
                 build: Callable[[Any], Any] | None = None,
                 mesh_shape: tuple[int, ...] | None = None,
                 mesh_dim_names: tuple[str, ...] | None = None,
                 replicate: tuple[str, ...] | None = None,
                 stages: tuple[str, ...] = (), device_type: str = "cpu",
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
        other's source after a fault (recovery/layout_rules.py). `stages`: the mesh dimensions
        that are pipeline stages (`("pp",)`): each coordinate holds other layers. A layout
        that cannot be recovered is refused before the first step (layout_check.py).

        Configuration, collaborators and side effects are apart: `settings` (default: read
        from `environ`, i.e. what the controller put in the step's environment) and `slurm`
        (this task's SLURM_*) are the configuration; `transfer`, `client`, `persister` and
        `relay` build the transfer server, the controller connection, the disk persisters
        and a node's relay (the real classes unless a test passes fakes); nothing binds a
        socket or talks to the controller before `run` (`_start`)."""
        if self.__dict__.get("_rerun"):
            self._rebind(model, optimizer, lr_scheduler, extra_state, seed, build)
            self._enter_inline()
            return
        env = os.environ if environ is None else environ
        self.settings = s = settings if settings is not None else JobSettings.from_environ(env)
        self.slurm = slurm if slurm is not None else SlurmEnv.from_environ(env)
        # A spare borrowed from the cluster pool runs in a companion job but serves the main
        # job: its ports, messages and secret are the main job's.
        if s.served_job_id is not None:
            self.slurm = dataclasses.replace(self.slurm, job_id=s.served_job_id)
        self._make_transfer, self._make_client, self._make_relay = transfer, client, relay
        self.seed = seed
        self.role = s.role
        self.run_dir = Path(s.run_dir)
        self.store_kind = s.store
        self.collective_timeout_s = s.collective_timeout_s
        # Bounded so a member lost between assignment and formation costs at most this long;
        # warm spares make a normal formation take well under a second.
        self.init_timeout_s = s.init_timeout_s
        mesh_spec = sharded_spec(model, optimizer, lr_scheduler, build, mesh_shape,
                                 mesh_dim_names, replicate, late=Job._in_main,
                                 world_size=C.read(env, C.WORLD_SIZE), stages=tuple(stages))
        self.state = TrainState(**extra_state)
        if model is not None:
            self.state.register(model=model, optimizer=optimizer)
        if lr_scheduler is not None:
            self.state.register(lr_scheduler=lr_scheduler)
        # The position of a loop the script writes itself (job.epochs / job.steps): the same
        # on every rank, so shared state, restored with the model.
        self.loop = StepLoop(self._seed_step, self._check_stop, self._end_step,
                             self._shard, lambda seconds: self.client.own.fetched(seconds))
        self.state.register(scope="shared", **{LOOP_NAME: self.loop.position})
        # Plain data parallelism: every rank holds the whole model and optimizer, so the
        # just-in-time path applies: no steady-state copies of the big state to a peer, a
        # replacement pulls the shared state from any survivor; RNGs are rederived from
        # (seed, rank, step). `replicated` (forced, or a sharded optimizer) keeps this rank's
        # whole snapshot on its ring neighbour instead.
        mode = recovery_mode or s.recovery_mode
        mode_given = None if mode == "auto" else mode
        first = first_mode(self.state, mode_given, mesh_spec)
        self.secret = P.load_secret(s.secret_file)
        self.job_id = str(self.slurm.job_id)
        self.node = self.slurm.node_name or socket.gethostname()
        self.events = EventLog(
            self.run_dir / "events" / f"{self.node}-{self.slurm.localid}.jsonl",
            source=f"{self.node}/{self.slurm.localid}")
        # The rooms: how this rank's snapshots are held (its `snapshots`, `rank_snaps` and the
        # `replicas` it keeps for others), this generation's group and what is bound to it,
        # and where a restore comes from. Each reads where this process stands off the Job
        # (the policy's `on_gpu` asks the group, made just below).
        self._policy = SnapshotPolicy(
            self.state, s, first, mode_given, persist_every=persist_every or s.persist_every,
            events=self.events, secret=self.secret, job_id=self.job_id, run_dir=self.run_dir,
            standing=self, on_gpu=lambda: self._group.on_gpu(), persister=persister)
        self._group = Generation(
            s, self.slurm, self.secret, self.events, self.state, self._policy, self,
            model=model, optimizer=optimizer, lr_scheduler=lr_scheduler, build=build,
            mesh_spec=mesh_spec, replicate=replicate, device_type=device_type, seed=seed,
            stages=tuple(stages),
            shutdown=self._shutdown,
            late=Job._in_main and model is None and build is None)
        if optimizer is not None:
            self._policy.watch_optimizer(optimizer)
        # The proof of every restore, late registrations, the replicas' cross-check
        self._integrity = Integrity(self.state, self._policy, self, self.events,
                                    self._group.key, self.run_dir, self.node,
                                    flip=(s.flip_rank, s.flip_step))
        self._restorer = Restorer(self.state, self._policy, self._group, self,
                                  secret=self.secret, job_id=self.job_id, events=self.events,
                                  run_dir=self.run_dir, timeout=self.collective_timeout_s)
        self.snapshots, self.rank_snaps, self.replicas = (
            self._policy.snapshots, self._policy.rank_snaps, self._policy.replicas)
        # Test fault injection: the ranks whose served copies rot in memory.
        self._corrupt_serve = s.corrupt_serve
        # Test fault injection: a taker that dies in a named phase of its adoption (inject.py)
        self._fault = TakerFault(s.taker_dies_at, self.run_dir, self.events)
        self.rank = -1
        self.world_size = 0
        self.generation = -1
        self._losses: dict[int, float] = {}
        self._backfill: Background | None = None  # a newcomer reading back its rank's losses
        self.data_ranks: list[int] = []
        self.data_world = 0
        self._controller_addr = ControllerAddress.parse(s.controller)  # a bad one fails here
        self._controller_loss = ControllerLoss(s.controller, self.slurm, self.events, self,
                                               grace_s=s.collective_timeout_s + 5.0)
        # Set by _start, on the first run: the transfer server's socket, the controller
        # connection and the registration are side effects, not configuration.
        self.host_addr = ""
        self.transfer: TransferServer = None  # type: ignore[assignment]
        self.client: CoordinationClient = None  # type: ignore[assignment]
        self.relay: NodeRelay | None = None  # the node's relay, in its first local rank
        self._started = False
        self._trained = False
        # The inline form (Job.main): the rank is taken here, not in run()
        self._inline = Job._in_main
        self._rerun = False                      # main() is to run again (a fault, a recovery)
        self._next: P.Assign | None = None       # an assignment received before that run
        # what the script registers (each run of main() registers the same names anew)
        self._own_names = (*SHARED_NAMES, *extra_state)
        self._registered = {n: self.state.get(n) is not None for n in self._own_names}
        self._formed: tuple | None = None  # a formation whose restore waits for register()
        self._registered_once = False  # job.register was called in an earlier run of main()
        if self._inline:
            self._take_main()

    def _start(self) -> None:
        """Bind the transfer server, connect to the controller and register with it: from
        here on the controller counts this process as a rank or a warm spare."""
        if self._started:
            return
        self._started = True
        self._nofile = raise_nofile()  # before any socket: gloo's listener aborts at the limit
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
        self._group.arm_abort(self.client)
        self.client.on_lost = self._on_controller_lost
        self.client.register(self.node, self.slurm.localid or 0, self.role, self.host_addr,
                             self.transfer.address[1])
        # the settings this rank runs with, whoever set them (the controller; a task prolog
        # must not override them): tests compare them with and without the SPANK plugin
        # A sharded job's mode follows from its replicated dimensions, which are read from
        # its first model unless given: until then it is not known (an HSDP job once
        # registered as "replicated" here, then ran "jit").
        undecided = self._group.late or (self.mesh_spec is not None and
                                         self._group.replicate_given is None)
        self.events.emit(Ev.RANK_REGISTERED, role=self.role, pid=os.getpid(),
                         mode="undecided" if undecided else self.mode,
                         rank_state=self.rank_snaps is not None,
                         settings={"collective_timeout_s": self.collective_timeout_s,
                                   "init_timeout_s": self.init_timeout_s,
                                   "store": self.store_kind}, **nofile_fields(self._nofile))

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

    # ---- what the rooms hold, reached through the Job -----------------------------------
    @property
    def model(self) -> Any:
        """The model given, or a sharded job's model `build(mesh)` returned for this
        generation (generation.py)."""
        return self._group.model

    @model.setter
    def model(self, value: Any) -> None:
        self._group.model = value

    @property
    def optimizer(self) -> Any:
        """The optimizer given, or a sharded job's of this generation."""
        return self._group.optimizer

    @optimizer.setter
    def optimizer(self, value: Any) -> None:
        self._group.optimizer = value

    @property
    def lr_scheduler(self) -> Any:
        """The scheduler given (None if none), or a sharded job's of this generation."""
        return self._group.lr_scheduler

    @lr_scheduler.setter
    def lr_scheduler(self, value: Any) -> None:
        self._group.lr_scheduler = value

    @property
    def mesh(self) -> Any:
        """A sharded job's DeviceMesh of this generation (None otherwise)."""
        return self._group.mesh

    @property
    def mesh_spec(self) -> MeshSpec | None:
        """A sharded job's mesh layout, its replicate dimensions once known (else None)."""
        return self._group.mesh_spec

    @property
    def mode(self) -> str:
        """The recovery mode, "jit" or "replicated" (snapshot_policy.py)."""
        return self._policy.mode

    @property
    def lazy(self) -> bool:
        """Whether steps between full commits may be held lazily ($HPCT_SNAPSHOT_LAZY)."""
        return self._policy.lazy

    @property
    def persist_every(self) -> int:
        """Steps between snapshots saved to disk (0: none)."""
        return self._policy.persist_every

    # ---- what the training step calls --------------------------------------------------
    @property
    def ddp(self) -> "torch.nn.parallel.DistributedDataParallel":
        """The model wrapped in DistributedDataParallel for the current generation.

        Re-created after every re-formation (a DDP module is bound to its process group), with
        a comm hook that reduces each parameter's gradient on its own: DDP rebuilds its buckets
        after the first iteration, and summing a bucket flat would make the result depend on
        when DDP was created, so a recovered run would drift from an uninterrupted one."""
        return self._group.ddp()

    def allreduce_gradients(self) -> None:
        """Average gradients over the group in a fixed per-parameter order (bit-reproducible
        across re-formed groups, unlike DDP's rebuilt buckets)."""
        self._group.allreduce_gradients()

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
        if self._inline:
            raise HpctError("Job.run is not for a Job made inside Job.main: there the script's "
                            "own loop runs (job.epochs, job.steps)")
        self._start()
        while True:
            msg = self.client.next_assignment()
            if isinstance(msg, P.Goodbye):
                self._goodbye(msg)
                return self._trained and msg.reason == "done"
            self._trained = True
            failure = None
            try:
                self._adopt(msg)
                last = train(msg.restore_step + 1)
                self._policy.check_last(last)
            except UsageError as exc:
                self._script_failed(exc)
                raise  # the script's mistake: running it again would make it again
            except _FAULTS as exc:
                failure, where = _describe(exc), _where(exc)
            except SCRIPT_ERRORS as exc:
                self._script_failed(exc)
                raise
            if failure is None:
                self._done(last)
                continue  # the controller says goodbye once every rank is done
            # Outside the except block from here on: the failed group can now really close.
            self._recover(failure, where)

    # ---- the end: done, goodbye, shutdown ----------------------------------------------
    def _on_controller_lost(self) -> None:
        if self._trained:  # as in _goodbye
            self._controller_loss.watch()

    def _goodbye(self, msg: P.Goodbye) -> None:
        # A spare that never trained holds nothing the job needs: it just leaves.
        if msg.reason == LOST and self._trained:
            self._controller_loss.settle()
        self._shutdown(msg.reason)

    def _done(self, last: int) -> None:
        """This rank trained to the end: its last snapshot settled, the controller told."""
        self.snapshots.drop_pending()
        self._policy.settle(follow_ups=True)
        self.events.emit(Ev.RANK_FINISHED, rank=self.rank, step=last)
        self.client.state = "done"  # report first: tearing down is local work
        self.client.heartbeat_now()
        try:
            self._group.teardown()
        except _TeardownHung as exc:  # training is done: only worth a record
            self.events.emit(Ev.RANK_TEARDOWN_HUNG, rank=self.rank, error=str(exc))

    def _shutdown(self, reason: str) -> None:
        self.events.emit(Ev.RANK_EXIT, rank=self.rank, reason=reason)
        self._policy.close()
        self.transfer.close()
        self.client.close(reason)
        if self.relay is not None:
            self.relay.close()  # once the node's other ranks heard their Goodbyes too

    # ---- the rooms' internals, for the tests that reach them through the Job -------------
    @property
    def _updating(self) -> bool:
        return self._policy.updating

    @_updating.setter
    def _updating(self, value: bool) -> None:
        self._policy.updating = value

    @property
    def _teardown_bg(self) -> Any:
        return self._group.teardown_bg

    def _await_teardown(self) -> None:
        self._group.await_teardown()

    def _prefetch(self, a: P.Assign, survivor: bool) -> Prefetch | None:
        return self._restorer.prefetch(a, survivor)

    def _hook_model(self) -> None:
        self._group.hook_model()

    def _before_update(self) -> None:
        self._policy.before_update()


