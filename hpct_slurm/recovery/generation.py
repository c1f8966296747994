"""One generation's process group on this rank, and what is bound to it: forming the group
(layout, store, backend), a sharded job's mesh and model built on it, the DDP module around the
model, the hooks that abandon a step a STOP dooms, and tearing it all down after a fault.

`Job` (job.py) forms a group at every adoption (`Generation.form`); at a fault it releases what
is bound to the group and tears the group down in the background (`teardown_in_background`),
and the next formation first waits for that teardown (`await_teardown`)."""
from __future__ import annotations

import dataclasses
import datetime
import faulthandler
import gc
import os
import threading
import time
from typing import TYPE_CHECKING, Any, Callable

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
from .client import CoordinationClient
from .fsdp_waits import time_fsdp_waits
from .gradients import average_gradients, parameter_gradients, share_buffers
from .layout_check import check_placements, check_replicas_agree
from .layout_rules import MeshSpec, infer_replicate, model_mesh, resolve_shape
from .own_time import DeviceOwnTime
from .seeds import seed_everything
from .state import TrainState

if TYPE_CHECKING:
    from .carry import Carry
    from .inject import TakerFault
    from .snapshot_policy import SnapshotPolicy
    from .standing import Standing

TEARDOWN_TIMEOUT_S = 20.0
TEARDOWN_DIAG_S = 15  # dump every thread's stack to the step log just before giving up


class _Stopped(Exception):
    """The controller asked this rank to stop the current generation."""


class _TeardownHung(Exception):
    """The broken group could not be destroyed: this process cannot form another one."""


def sharded_spec(model: Any, optimizer: Any, lr_scheduler: Any, build: Callable | None,
                 mesh_shape: tuple[int, ...] | None, mesh_dim_names: tuple[str, ...] | None,
                 replicate: tuple[str, ...] | None, late: bool = False,
                 world_size: int | None = None,
                 stages: tuple[str, ...] = ()) -> MeshSpec | None:
    """A sharded job's mesh (`build=...`), None for plain data parallelism; the arguments of
    `Job` checked: one or the other, each complete. `late`: the inline form (Job.main),
    where a sharded job gives only the mesh, and registers its model later (job.register)."""
    if late and model is None and build is None:
        if mesh_shape is not None or optimizer is not None or lr_scheduler is not None:
            raise HpctError("a Job made inside Job.main without a model takes no mesh_shape, "
                            "optimizer or scheduler: the script makes its mesh after Job(...) "
                            "and registers what it built with job.register(model, optimizer, "
                            "lr_scheduler)")
        return None  # read from the model job.register(...) is given (adopt_built)
    if build is not None:
        if model is not None or optimizer is not None or lr_scheduler is not None:
            raise HpctError("Job takes either build=... (a sharded job) or model and "
                            "optimizer, not both")
        if mesh_shape is None or mesh_dim_names is None:
            raise HpctError("a sharded Job (build=...) needs mesh_shape and mesh_dim_names")
        return MeshSpec(resolve_shape(tuple(mesh_shape), world_size), tuple(mesh_dim_names),
                        tuple(replicate or ()), tuple(stages))
    if model is None or optimizer is None:
        raise HpctError("Job needs model and optimizer (or build=... for a sharded job)")
    return None


class Generation:
    """This process's part of the current generation: its process group, and for a sharded
    job (`build=...`) the mesh, model, optimizer and scheduler built on it (`model`,
    `optimizer`, `lr_scheduler`, `mesh`: Job's properties of those names read them here).

    `policy` watches every optimizer this builds and chooses the mode once a mesh's replicate
    dimensions are known; `shutdown` ends the process's connections when a teardown failed."""

    def __init__(self, settings: JobSettings, slurm: SlurmEnv, secret: bytes, events: EventLog,
                 state: TrainState, policy: SnapshotPolicy, standing: Standing, *,
                 model: torch.nn.Module | None, optimizer: torch.optim.Optimizer | None,
                 lr_scheduler: Any, build: Callable[[Any], Any] | None,
                 mesh_spec: MeshSpec | None, replicate: tuple[str, ...] | None,
                 device_type: str, seed: int, shutdown: Callable[[str], None],
                 late: bool = False, stages: tuple[str, ...] = ()):
        self.settings, self.slurm, self.secret, self.events = settings, slurm, secret, events
        self.state, self.policy, self.standing = state, policy, standing
        self.model, self.optimizer, self.lr_scheduler = model, optimizer, lr_scheduler
        self.mesh: Any = None
        self.mesh_spec = mesh_spec
        self._build = build
        # The inline form with its state registered after the group forms (job.register):
        # a sharded model built on a mesh the script makes
        self.late = late
        self.replicate_given = replicate  # None: read from the first model's placements
        self.stages = tuple(stages)  # pipeline-stage dimensions, never replicas
        self._said: tuple | None = None  # what rank.mesh_inferred said last
        self.device_type = device_type
        self.seed = seed
        self._shutdown = shutdown
        self._ddp: torch.nn.parallel.DistributedDataParallel | None = None
        self._want_ddp = False
        self._ddp_options: dict[str, Any] = {}
        # DDPs of other registered models (a GAN's discriminator), by the module's id: made
        # at their first forward in each generation, like the main one's
        self._other_ddps: dict[int, tuple[torch.nn.Module, Any]] = {}
        self.teardown_bg: Background | None = None  # the broken group's, since the fault
        # The model whose parameters carry the hooks that abandon a doomed step (_abandon)
        self._hooked: torch.nn.Module | None = None
        self._first_step = False  # its collectives wait longer (_open_first_step)

    def key(self, rank: int) -> int:
        """`rank`'s shard key: ranks with the same key hold the same shared state (every rank
        does under plain data parallelism)."""
        return self.mesh_spec.shard_key(rank) if self.mesh_spec is not None else 0

    def shard_keys(self) -> list[int]:
        """Every rank's shard key (none listed under plain data parallelism)."""
        return self.mesh_spec.shard_keys() if self.mesh_spec is not None else []

    def arm_abort(self, client: CoordinationClient) -> None:
        # A STOP naming lost nodes aborts this generation's NCCL communicators at once, from
        # the client's receiving thread (a no-op for gloo, whose reads the STOP's cut ends).
        client.abort_comms = pg.abort_generation
        client.abort_timeout_s = self.settings.abort_timeout_s

    # ---- forming --------------------------------------------------------------------------
    def form(self, a: P.Assign, fault: "TakerFault | None" = None) -> None:
        """This generation's group, once the last one's teardown is done; then a sharded job's
        mesh and model, and the hooks that abandon a step the next STOP dooms. `fault`: test
        fault injection (inject.py), told each phase it reaches."""
        s, client = self.settings, self.standing.client
        self.await_teardown()
        info = rdv.derive(self.slurm, a.generation, members=a.member_nodes(),
                          tasks_per_node=a.tasks_per_node,
                          collective_timeout_s=s.collective_timeout_s,
                          init_timeout_s=s.init_timeout_s,
                          allowed_nodes=a.member_nodes())  # the controller vouches for its members
        if info.rank != a.rank:
            raise HpctError(f"controller assigned rank {a.rank} but the derived layout puts "
                            f"{self.slurm.node_name}/{self.slurm.localid} at rank {info.rank}")
        shard = None
        if s.store == "rootless" and info.local_rank == 0:
            shard = serve_shard(info, self.secret, events=self.events)
        store = make_store(s.store, info, self.secret)
        if fault is not None:
            fault.at("store", a.rank)
        # A STOP while the group forms (a member lost meanwhile) must interrupt the formation,
        # as it interrupts a collective: the rootless store aborts its pending requests, and
        # gloo's pairs still waiting in native code for a peer to connect are woken
        # (pg.wake_connecting). (Stock TCPStore cannot be interrupted: such a rank waits out
        # the init timeout.)
        abort_store = getattr(store, "abort", None)

        def interrupt() -> None:
            if abort_store is not None:
                abort_store()
            woken, reset = pg.wake_connecting()
            if woken or reset:
                self.events.emit(Ev.RANK_PAIRS_WOKEN, rank=a.rank, generation=a.generation,
                                 pairs=woken, connects_reset=reset)

        client.on_stop = interrupt
        try:
            if client.stop_event.is_set():
                interrupt()  # the STOP arrived before the hook was in place
            backend, device_id = self.backend()
            if backend == "nccl" and not isinstance(client.own, DeviceOwnTime):
                client.own = DeviceOwnTime(client.own.window)  # time on the GPU (own_time.py)
            pg.init(info, store, backend, shard=shard, device_id=device_id,
                    init_timeout=datetime.timedelta(seconds=info.init_timeout_s),
                    collective_timeout=datetime.timedelta(seconds=s.collective_timeout_s),
                    on_exchanged=(lambda: fault.at("connect", a.rank)) if fault else None)
        finally:
            client.on_stop = None
        if client.stop_event.is_set() and client.stop_generation >= a.generation:
            # formed after all (the wake let the last pairs "connect" to closed sockets): the
            # generation is stopped, so leave it as from a formation the STOP failed
            raise _Stopped(client.stop_reason)
        if self._build is not None:
            self.build()
        elif self.late:
            # The script makes its mesh's sub-groups itself after Job(...): they must take
            # the collective timeout too, not torch's default (30 min for gloo).
            dist.distributed_c10d.default_pg_timeout = datetime.timedelta(
                seconds=self.settings.collective_timeout_s)
        self.hook_model()
        self._open_first_step()

    # ---- the first step after a formation ------------------------------------------------
    def _open_first_step(self) -> None:
        """The first step after a formation does more than the others, on some ranks only: a
        compile on a cold cache (torch.compile: 51 s for a small LM on this project's CPU), a
        spare's first forward, lazy allocations. Its peers wait for it in their first
        collective, and a wait past the collective timeout would read as a fault (a job
        restarted in place from creation, a spare's compile cost two extra rounds). So the
        world group's collectives wait in the first step as long as the controller lets a
        rank run without a step (HPCT_PROGRESS_TIMEOUT_S), the bound it already holds a
        compiling rank to; a peer lost meanwhile is cut by the STOP, never waited for.

        Only once every rank has formed: a barrier under the collective timeout first. A rank
        whose formation cannot complete (a gloo pair the network cuts, every member alive)
        leaves the ranks that did form waiting for it; they must give up after the collective
        timeout as before, so that their fault's STOP wakes it, not after the allowance."""
        s = self.settings
        self._first_step = s.progress_timeout_s > s.collective_timeout_s
        if self._first_step:
            dist.barrier()  # still forming: no step's time, nobody blamed for it
            pg.set_collective_timeout(s.progress_timeout_s)

    def first_step_done(self) -> None:
        """After the first step of a generation: its collectives' usual timeout again."""
        if self._first_step:
            self._first_step = False
            pg.set_collective_timeout(self.settings.collective_timeout_s)

    def on_gpu(self) -> bool:
        """Whether this rank trains on a GPU: a sharded job built on "cuda", or a model whose
        parameters are on one."""
        if self._build is not None or self.late:
            return self.device_type == "cuda"
        model = self.model
        return model is not None and any(p.is_cuda for p in model.parameters())

    def backend(self) -> tuple[str, "torch.device | None"]:
        """The process group's backend ($HPCT_BACKEND; auto: NCCL on a GPU, gloo on CPU) and,
        for NCCL, the device its communicators bind to: the model's, else the current one."""
        backend = self.settings.backend
        if backend == "auto":
            backend = "nccl" if self.on_gpu() else "gloo"
        if backend != "nccl":
            return backend, None
        model = self.model
        device = next((p.device for p in model.parameters() if p.is_cuda), None) \
            if model is not None else None
        return backend, device or torch.device("cuda", torch.cuda.current_device())

    def build(self) -> None:
        """A sharded job's mesh, model, optimizer and scheduler for this generation's group,
        built the same way on every rank (the restore then overwrites their state)."""
        assert self._build is not None
        self.make_mesh()
        seed_everything(self.seed)  # the same initial weights on every rank
        built = self._build(self.mesh)
        if not isinstance(built, tuple) or len(built) not in (2, 3):
            raise HpctError("build(mesh) must return (model, optimizer) or "
                            "(model, optimizer, lr_scheduler)")
        self.adopt_built(built[0], built[1], built[2] if len(built) == 3 else None)

    def make_mesh(self) -> None:
        """This generation's DeviceMesh, its sub-groups with the collective timeout."""
        from torch.distributed.device_mesh import init_device_mesh

        assert self.mesh_spec is not None
        spec = self.mesh_spec
        if spec.world_size != self.standing.world_size:
            raise HpctError(f"the mesh {spec.shape} needs {spec.world_size} ranks, the job "
                            f"has {self.standing.world_size}: a sharded job runs on all its "
                            f"positions")
        # The mesh's sub-groups take torch's default timeout (30 min for gloo), not the
        # world group's: a collective on one whose peer is gone must fail as fast as one on
        # the world group.
        c10d = dist.distributed_c10d
        default = c10d.default_pg_timeout
        c10d.default_pg_timeout = datetime.timedelta(seconds=self.settings.collective_timeout_s)
        try:
            self.mesh = init_device_mesh(self.device_type, spec.shape,
                                         mesh_dim_names=spec.names)
        finally:
            c10d.default_pg_timeout = default

    def adopt_built(self, model: Any, optimizer: Any, lr_scheduler: Any) -> None:
        """A sharded model built on this generation's mesh, its optimizer and scheduler:
        registered, watched, and its replicate dimensions inferred where not given. In the
        inline form (`late`) the mesh is the one its DTensor parameters live on; a model
        without any is plain data parallelism."""
        self.bind(model, optimizer, lr_scheduler)
        client = self.standing.client
        if client is not None:  # its waits in FSDP's collectives are not its own time
            time_fsdp_waits(model, lambda: _collective(client))
        if self.late:
            # the mesh of this run of main(), read afresh: the last run's is gone (a mesh
            # made here as well would advance torch's group numbering past the names a
            # fresh replacement uses for the script's own: measured, one more round)
            self.mesh = model_mesh(model)
            if self.mesh is None:  # plain data parallelism, registered late
                self.policy.set_mode(self.policy.data_parallel_mode())
                self.hook_model(force=True)
                self._say_mode(None)
                return
            self.mesh_spec = MeshSpec(tuple(self.mesh.shape),
                                      tuple(self.mesh.mesh_dim_names or ()),
                                      tuple(self.replicate_given or ()), self.stages)
            self.policy.set_mode(self.policy.sharded_mode(self.mesh_spec))
        spec = self.mesh_spec
        assert spec is not None
        if self.replicate_given is None:
            inferred = infer_replicate(spec.names, self.model.parameters(), spec.stages)
            if inferred != spec.replicate:
                self.mesh_spec = spec = dataclasses.replace(spec, replicate=inferred)
                self.policy.set_mode(self.policy.sharded_mode(spec))
        if self.late or self.replicate_given is None:
            self._say_mode(spec.replicate)
        self.state.mesh, self.state.replicate = self.mesh, spec.replicate
        if client is not None and any(
                spec.shape[i] > 1 for i, n in enumerate(spec.names) if n in spec.stages):
            # pipeline stages differ in work by design and their sends are not seen: such a
            # job is not judged for fail-slow (own_time.py)
            client.own.off = True
        # Refused before the first step, not at the first snapshot or fault. Once: every later
        # build (a recovery's, on its path) lays out the same model the same way.
        if self.standing.generation == 0:  # every rank of the first formation: one collective
            check_placements(self.model)
            check_replicas_agree(spec, self.model)

    def _say_mode(self, replicate: tuple[str, ...] | None) -> None:
        """rank.registered said `undecided` (job.py): the first model decides, said once, and
        again only if a later build decides otherwise. Also when nothing is replicated (1-D
        FSDP: `replicate` empty, which once went unsaid) and for plain data parallelism
        registered late (`replicate` None: no mesh)."""
        said = (replicate, self.policy.mode)
        if said != self._said:
            self._said = said
            self.events.emit(Ev.RANK_MESH_INFERRED, rank=self.standing.rank,
                             replicate=replicate, mode=self.policy.mode)

    def release(self) -> None:
        """Drop this generation's sharded model and mesh: they hold the broken group, which
        must go before a new one forms; the restore comes from the snapshots' bytes."""
        if self._build is None and not self.late:
            return
        self.state.unregister("model", "optimizer", "lr_scheduler")
        self.model = self.optimizer = self.lr_scheduler = self.mesh = None
        self.state.mesh = None

    def bind(self, model: Any, optimizer: Any, lr_scheduler: Any) -> None:
        """Hold these as this generation's model, optimizer and scheduler (a sharded build's,
        or what a run of the inline form's main() made): registered as shared state, the
        optimizer watched (SnapshotPolicy.watch_optimizer)."""
        self.model, self.optimizer, self.lr_scheduler = model, optimizer, lr_scheduler
        if model is not None:
            self.state.register(model=model, optimizer=optimizer)
            self.policy.watch_optimizer(optimizer)
        if lr_scheduler is not None:
            self.state.register(lr_scheduler=lr_scheduler)

    def forget_model(self) -> None:
        """Drop the model, optimizer and scheduler given (the inline form's main() builds
        new ones when it runs again), and what is bound to them (DDP, the abandon hooks)."""
        self.release()
        self.model = self.optimizer = self.lr_scheduler = None
        self._ddp = self._hooked = None
        self._other_ddps.clear()

    def rebuild_with(self, build: Callable[[Any], Any]) -> None:
        """The build function of main()'s new run (it may close over that run's objects)."""
        if self._build is None:
            raise HpctError("main() passed build= to Job only when it ran again")
        self._build = build

    # ---- DDP and gradients ----------------------------------------------------------------
    def ddp(self, wrapping: torch.nn.Module | None = None,
            **options: Any) -> "torch.nn.parallel.DistributedDataParallel":
        """The model in DDP for this generation (job.ddp), made at the first call; from then
        on made again at every formation (`renew_ddp`). `options`: torch DDP's keyword
        arguments (device_ids, find_unused_parameters, ...), given by the drop-in
        `DistributedDataParallel` (ddp.py); `wrapping`: the module it wraps, the registered
        model or torch.compile's module of it (state.same_model).

        The DDP is made for the registered model, then runs `wrapping`'s forward: both hold
        the very same parameters and buffers, so DDP's hooks and the reduction are the same,
        and no DDP is made again for it. Making one is collective: a rank that made one more
        than its peers (the inline form's main() compiles the model anew after a fault) would
        wait for them forever."""
        self._want_ddp = True
        if options:
            self._ddp_options = options
        if self._ddp is None:
            if not dist.is_initialized():
                raise HpctError("job.ddp is only available inside job.run(...)")
            self._ddp = _fixed_order_ddp(self.model, self.standing.client, self._ddp_options,
                                         lambda: self.policy.carry)
        if wrapping is not None and wrapping is not self._ddp.module:
            self._ddp.module = wrapping
        return self._ddp

    def ddp_for(self, module: torch.nn.Module, options: dict[str, Any]
                ) -> "torch.nn.parallel.DistributedDataParallel":
        """A registered model other than the main one in DDP for this generation, with the
        same fixed-order reduction (no carried rank state: that rides on the main model's)."""
        held = self._other_ddps.get(id(module))
        if held is not None and held[0] is module:
            return held[1]
        if not dist.is_initialized():
            raise HpctError("DistributedDataParallel runs inside Job.main(main) or job.run")
        ddp = _fixed_order_ddp(module, self.standing.client, options)
        self._other_ddps[id(module)] = (module, ddp)
        return ddp

    def renew_ddp(self) -> None:
        """After a formation and its restore: a script that uses job.ddp gets a DDP module
        bound to the new group (one is bound to its process group); other models' DDPs are
        made again at their next forward."""
        self._other_ddps.clear()
        if self._want_ddp and self.model is not None:
            self._ddp = _fixed_order_ddp(self.model, self.standing.client, self._ddp_options,
                                         lambda: self.policy.carry)

    def allreduce_gradients(self) -> None:
        with _collective(self.standing.client):
            average_gradients(parameter_gradients(self.model), self.standing.data_world,
                              self.policy.carry)
            share_buffers(self.model)

    # ---- abandoning a doomed step ---------------------------------------------------------
    def _abandon(self) -> None:
        """From a module's forward and a parameter's gradient (hooks): leave a step that can
        never complete as soon as the STOP says so, not once it reaches its allreduce. A
        survivor still computing when a peer died otherwise finishes its forward and backward
        first (measured with the 100 MB benchmark model: the last survivors reported ready
        ~0.1 s after the STOP, all of it compute). Only before the step's optimizer update:
        the live state is then still the last step's, exactly what the fault captures."""
        c = self.standing.client
        if c is not None and c.stop_doomed and c.stop_event.is_set() and \
                not self.policy.updating and c.state in ("running", "collective") and \
                c.stop_generation >= self.standing.generation:
            raise _Stopped(c.stop_reason)

    def hook_model(self, force: bool = False) -> None:
        """Where _abandon is checked: before each module's forward, and as each trainable
        parameter's gradient is computed (a module backward hook would wrap the outputs and
        break in-place ops after them). Once per model; not for a model built per generation
        (a sharded job's modules carry FSDP's own hooks: left as they are, such a survivor
        leaves the step at its collective as before)."""
        model = self.model
        if model is None or model is self._hooked or self._build is not None or \
                (self.late and not force):
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

    # ---- tearing down ---------------------------------------------------------------------
    def teardown(self) -> None:
        self._other_ddps.clear()
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

    def teardown_in_background(self) -> None:
        """The broken group's teardown, started now on its own thread (Job._recover)."""
        self.teardown_bg = Background("hpct-teardown-bg", self.teardown)

    def await_teardown(self) -> None:
        """Before a new group forms: the old one's teardown, started at the fault, is done. One
        that hangs or fails leaves a process that cannot form another group: it says so and
        exits; the controller sees a member lost before the formation and replaces it."""
        bg, self.teardown_bg = self.teardown_bg, None
        if bg is None:
            return
        error = bg.wait(TEARDOWN_TIMEOUT_S + 5)
        if error is None:
            return
        self.events.emit(Ev.RANK_TEARDOWN_HUNG, rank=self.standing.rank, error=str(error))
        self._shutdown(f"process group teardown failed: {error}")
        os._exit(3)  # a stuck gloo thread would hold up a normal interpreter exit


class _collective:
    """Marks the rank's heartbeat state "collective" while it waits on its peers: a rank stuck
    there is waiting for someone else, so the controller's no-progress check blames only
    ranks stuck in their own computation ("running")."""

    def __init__(self, client: CoordinationClient):
        self.client = client

    def __enter__(self) -> None:
        self.client.own.wait_begins(time.monotonic())  # not its own time (own_time.py)
        if self.client.state == "running":
            self.client.state = "collective"

    def __exit__(self, *exc: Any) -> None:
        self.client.own.wait_ends(time.monotonic())
        if self.client.state == "collective":
            self.client.state = "running"


class _CanonicalReduce:
    """The state of the fixed-order DDP's comm hook: every bucket's gradients are reduced
    together, once the step's last bucket is ready, in the layout of `average_gradients`
    (parameter order, fixed chunks), so the sums never depend on DDP's buckets, which differ
    between a fresh DDP's first step and its later ones (rebuilt from the order gradients
    became ready). The other buckets' futures wait until then; DDP waits on all of them at
    the end of the backward pass anyway."""

    def __init__(self, client: CoordinationClient, model: torch.nn.Module,
                 carry: Callable[[], Carry | None] = lambda: None):
        self.client, self.carry, self.model = client, carry, model
        self.index = {id(p): i for i, p in enumerate(model.parameters())}
        self.waiting: list[tuple[Any, torch.futures.Future]] = []

    def __call__(self, bucket: Any) -> "torch.futures.Future[torch.Tensor]":
        fut: torch.futures.Future[torch.Tensor] = torch.futures.Future()
        if bucket.index() == 0:
            self.waiting = []  # a backward pass left before its last bucket (a fault) is over
        self.waiting.append((bucket, fut))
        if not bucket.is_last():
            return fut
        waiting, self.waiting = self.waiting, []
        pairs = []
        for b, _ in waiting:
            for p, g in zip(b.parameters(), b.gradients()):
                i = self.index.get(id(p))
                if i is None:
                    raise HpctError(f"DDP bucket holds a parameter of shape {tuple(p.shape)} "
                                    f"that is not the model's: cannot place it in the fixed "
                                    f"reduction order")
                pairs.append((i, g))
        pairs.sort(key=lambda ig: ig[0])
        with _collective(self.client):
            average_gradients([g for _, g in pairs], dist.get_world_size(), self.carry())
            share_buffers(self.model)
        for b, f in waiting:
            f.set_result(b.buffer())
        return fut


def _canonical_allreduce(state, bucket):  # DDP checks hook annotations: leave them off
    return state(bucket)


def _fixed_order_ddp(model: torch.nn.Module, client: CoordinationClient,
                     options: dict[str, Any] | None = None,
                     carry: Callable[[], Carry | None] = lambda: None
                     ) -> "torch.nn.parallel.DistributedDataParallel":
    ddp = torch.nn.parallel.DistributedDataParallel(model, **(options or {}))
    ddp.register_comm_hook(_CanonicalReduce(client, model, carry), _canonical_allreduce)
    return ddp
