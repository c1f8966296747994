"""The layouts' rules (pure): in a job's DeviceMesh, which dimension is a replica and which a
shard, what that makes of each rank's state, and the recovery mode a layout gets. Every rule
about how a data-, tensor- or fully-sharded-parallel layout maps to who holds what is here;
the rest of the code asks this module (pipeline stages, FSDP2's strided shards over tensor
parallelism: their rules are here too).

A job trained on a DeviceMesh (FSDP2 `fully_shard`, HSDP, tensor parallelism) splits its model
and optimizer state over some mesh dimensions and replicates it over others. A rank's *shard
key* is its coordinate on the dimensions that are not replicated: ranks with the same shard key
hold bit-identical state (their replicas are kept equal by the all-reduce over the replicate
dimension), so each is the other's source when one is lost. Plain data parallelism is the case
of one shard key; a 1-D FSDP job has one rank per shard key, so its state must be copied to a
peer in steady state (the ring replica) or come from disk.

`init_device_mesh(device, shape)` lays ranks out row-major (`arange(world).view(shape)`), so a
rank's coordinate is `unravel(rank, shape)` on every rank and on the controller alike.

The rules, in order below: the mesh (`MeshSpec`, `resolve_shape`), its pipeline-stage
dimensions said by the script (`stages`); which dimensions are replicated, read from the
parameters' placements (`infer_replicate`, `model_mesh`), and what is wrong where ranks that
should be replicas hold state of different structures (`disagreeing`); which
placements a snapshot records, and from which coordinates a shard may be restored
(`placement_code`, `placement`, `wrong_coordinates`); the recovery mode (`choose_mode`,
`first_mode`, `sharded_mode`): jit where every rank's state is held by another rank too,
replicated (a ring copy in steady state) where not. Nothing here needs torch at import time
(the controller may read these rules too).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Iterable, Literal, Protocol

from ..errors import HpctError

MAX_MESH_DIMS = 8
Mode = Literal["jit", "replicated"]  # the recovery modes (choose_mode)


@dataclass(frozen=True)
class MeshSpec:
    """The shape of the job's DeviceMesh, its dimension names, and which are replicated."""

    shape: tuple[int, ...]
    names: tuple[str, ...]
    replicate: tuple[str, ...] = ()
    # Pipeline-stage dimensions: each coordinate holds other layers, never a replica. Said by
    # the script (Job(stages=...)): a stage module's parameters live on a sub-mesh without
    # them, which would read as "replicated" to infer_replicate. A name the mesh lacks is no
    # error: torchtitan-style scripts make a dimension only where its degree is above 1 (a
    # mistyped name is caught by the structure check before the first step).
    stages: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if not 1 <= len(self.shape) <= MAX_MESH_DIMS:
            raise HpctError(f"mesh shape {self.shape} must have 1 to {MAX_MESH_DIMS} dimensions")
        if any(not isinstance(s, int) or isinstance(s, bool) or s < 1 for s in self.shape):
            raise HpctError(f"mesh shape {self.shape} must be positive integers")
        if len(self.names) != len(self.shape):
            raise HpctError(f"mesh dimension names {self.names} do not match shape {self.shape}")
        if len(set(self.names)) != len(self.names) or not all(
                isinstance(n, str) and n for n in self.names):
            raise HpctError(f"mesh dimension names {self.names} must be distinct non-empty strings")
        unknown = [r for r in self.replicate if r not in self.names]
        if unknown:
            raise HpctError(f"replicate dimension(s) {unknown} are not mesh dimensions "
                            f"{list(self.names)}")
        if any(not isinstance(s, str) or not s for s in self.stages):
            raise HpctError(f"stage dimension names {self.stages} must be non-empty strings")
        both = [s for s in self.stages if s in self.replicate]
        if both:
            raise HpctError(f"mesh dimension(s) {both} are given both as pipeline stages and "
                            f"as replicated: a stage holds its own layers")

    @property
    def world_size(self) -> int:
        n = 1
        for s in self.shape:
            n *= s
        return n

    def coordinate(self, rank: int) -> tuple[int, ...]:
        if not 0 <= rank < self.world_size:
            raise HpctError(f"rank {rank} is outside the {self.shape} mesh "
                            f"(0..{self.world_size - 1})")
        coord = []
        for size in reversed(self.shape):
            rank, c = divmod(rank, size)
            coord.append(c)
        return tuple(reversed(coord))

    def shard_key(self, rank: int) -> int:
        """The row-major index of `rank`'s coordinate on the non-replicated dimensions."""
        key = 0
        for name, size, c in zip(self.names, self.shape, self.coordinate(rank)):
            if name not in self.replicate:
                key = key * size + c
        return key

    def shard_keys(self) -> list[int]:
        """Every rank's shard key, by rank."""
        return [self.shard_key(r) for r in range(self.world_size)]

    @property
    def replicas(self) -> int:
        """How many ranks hold each shard key."""
        n = 1
        for name, size in zip(self.names, self.shape):
            if name in self.replicate:
                n *= size
        return n


def infer_replicate(names: tuple[str, ...], params: Iterable[Any],
                    stages: tuple[str, ...] = ()) -> tuple[str, ...]:
    """The mesh dimensions over which every DTensor parameter is replicated: a dimension is
    replicated for the rank's whole state only if no parameter is sharded (or partial) on it.
    A dimension a parameter's mesh does not include is replicated for that parameter (e.g.
    data parallelism over a 2-D mesh whose parameters live on the `tp` sub-mesh only), except
    a pipeline-stage dimension (`stages`), whose coordinates hold different layers. A stage
    dimension nobody said is caught before the first step (`disagreeing`)."""
    from torch.distributed.tensor import DTensor, Replicate

    sharded: set[str] = set()
    for p in params:
        if not isinstance(p, DTensor):
            continue
        dims = p.device_mesh.mesh_dim_names
        if dims is None:
            raise HpctError("a DTensor parameter's mesh has no dimension names: pass "
                            "replicate=... to Job explicitly")
        for name, placement in zip(dims, p.placements):
            if not isinstance(placement, Replicate):
                sharded.add(name)
    return tuple(n for n in names if n not in sharded and n not in stages)


def disagreeing(spec: MeshSpec, digests: list[tuple[str, str]]) -> str | None:
    """What is wrong when ranks of one shard key (which must hold the same state) hold state
    of different structures: `digests[rank]` is (a digest of the rank's parameters' names,
    shapes, dtypes and placements; its first parameter, for the message). None when all agree.

    The usual cause is a pipeline-stage dimension read as a replica: a stage's parameters
    live on a sub-mesh without it. Said before the first step, never found at a fault."""
    first: dict[int, int] = {}
    for rank, (digest, _) in enumerate(digests):
        other = first.setdefault(spec.shard_key(rank), rank)
        if digests[other][0] == digest:
            continue
        a, b = spec.coordinate(other), spec.coordinate(rank)
        dims = [n for n, x, y in zip(spec.names, a, b) if x != y]
        return (f"ranks {other} and {rank} differ only on mesh dimension(s) {dims}, which "
                f"were taken as replicas ({list(spec.replicate)}), but hold different state "
                f"(rank {other}: {digests[other][1]}; rank {rank}: {digests[rank][1]}). "
                f"A pipeline-stage dimension must be said: Job(..., stages=({dims[0]!r},))")
    return None


def resolve_shape(shape: tuple[int, ...], world_size: int | None) -> tuple[int, ...]:
    """A mesh shape with one -1 ("the rest"): the job's world size (the controller exports it
    to every process, warm spares included) divided by the other dimensions. A script then
    needs no group, and no hard-coded world, to say its mesh: (2, -1) is HSDP's 2 replicas."""
    if -1 not in shape:
        return shape
    if shape.count(-1) > 1:
        raise HpctError(f"mesh_shape {shape}: -1 (the rest of the world) may stand once")
    if world_size is None:
        raise HpctError(f"mesh_shape {shape} needs the job's world size for its -1, and "
                        f"$HPCT_WORLD_SIZE is not set (`hpct-slurm controller` sets it)")
    rest = math.prod(s for s in shape if s != -1)
    if rest < 1 or world_size % rest:
        raise HpctError(f"mesh_shape {shape}: the world size {world_size} is not a multiple "
                        f"of {rest}")
    return tuple(world_size // rest if s == -1 else s for s in shape)


def model_mesh(model: Any) -> Any:
    """The DeviceMesh a model's DTensor parameters live on (its root mesh), None if none."""
    for p in model.parameters():
        mesh = getattr(p, "device_mesh", None)
        if mesh is not None:
            root = getattr(mesh, "_get_root_mesh", None)
            return root() if root is not None else mesh
    return None


# --- placements in a snapshot ---------------------------------------------------------------

def placement_code(p: Any, path: str) -> str:
    """How a snapshot records a DTensor's placement on one mesh dimension: "R" replicated,
    "S<dim>" sharded on a tensor dimension, "S<dim>/<split>" the strided shard FSDP2 leaves on
    a tensor-parallel parameter (`fully_shard` over a `parallelize_module`d model: each rank
    holds `split` interleaved row blocks). A restore puts the local shard back at the same
    coordinate, so the code only names the placement again; it need not say which global rows
    the shard holds. Any other placement is refused, naming `path`."""
    from torch.distributed.tensor import Replicate, Shard

    if isinstance(p, Replicate):
        return "R"
    if type(p) is Shard:
        return f"S{p.dim}"
    if type(p).__name__ == "_StridedShard":  # not a Shard subclass in torch 2.13
        return f"S{p.dim}/{p.split_factor}"
    raise HpctError(f"cannot snapshot {path}: placement {p!r} is not supported "
                    f"(Replicate, Shard(dim) and FSDP2's strided Shard over tensor "
                    f"parallelism are)")


def placement(code: str, path: str) -> Any:
    """The placement a snapshot's code stands for (placement_code's inverse)."""
    from torch.distributed.tensor import Replicate, Shard

    if isinstance(code, str) and code == "R":
        return Replicate()
    if isinstance(code, str) and code[:1] == "S":
        dim, _, split = code[1:].partition("/")
        if _small_int(dim) and not split:
            return Shard(int(dim))
        if _small_int(dim) and _small_int(split) and int(split) >= 1:
            from torch.distributed.tensor.placement_types import _StridedShard
            return _StridedShard(int(dim), split_factor=int(split))
    raise HpctError(f"snapshot layout gives {path} an unknown placement {code!r}")


def _small_int(text: str) -> bool:
    """A placement's number as a layout may give it: ASCII digits, at most 4."""
    return text.isascii() and text.isdigit() and len(text) <= 4


def wrong_coordinates(names: Iterable[str], taken: Iterable[int], here: Iterable[int],
                      replicate: Iterable[str]) -> list[str]:
    """The mesh dimensions on which a shard taken at coordinate `taken` is not this rank's
    (`here`): it may come from another coordinate only along a replicated dimension."""
    rep = set(replicate)
    return [n for n, a, b in zip(names, taken, here) if n not in rep and a != b]


# --- the recovery mode a layout gets --------------------------------------------------------

class Registered(Protocol):
    """What the mode is chosen from: the registered state (TrainState), by name."""

    def get(self, name: str) -> Any: ...


def choose_mode(state: Registered, force: Mode | None = None,
                data_parallel: bool = False) -> Mode:
    """`jit` when every rank holds the whole model+optimizer state (plain DDP); else `replicated`.

    `data_parallel`: the caller (`Job`) itself keeps every rank's copy of the model identical
    (it reduces gradients over the whole group), so a plain module counts as DDP.

    In `jit` mode nothing big is copied in steady state: a replacement takes the `shared` state
    from any survivor at fault time, and only the small `rank` scope (RNG, sampler) is replicated.
    Sharded setups (FSDP, ZeRO, DTensor parameters) hold state no peer has, so they replicate.
    """
    from torch.nn.parallel import DistributedDataParallel

    if force is not None:
        if force not in ("jit", "replicated"):
            raise HpctError(f"recovery mode {force!r} is not 'jit' or 'replicated'")
        return force
    model, optimizer = state.get("model"), state.get("optimizer")
    if model is None or optimizer is None:
        return "replicated"
    if not data_parallel and not isinstance(model, DistributedDataParallel):
        return "replicated"
    if type(optimizer).__name__ == "ZeroRedundancyOptimizer":
        return "replicated"
    if any(type(p).__name__ == "DTensor" for p in model.parameters()):
        return "replicated"
    return "jit"


def first_mode(state: Registered, given: str | None, mesh_spec: MeshSpec | None) -> str:
    """The recovery mode a Job starts in: `given` ("jit", "replicated"), else chosen from the
    registered state (plain data parallelism) or from the mesh (a sharded job)."""
    if mesh_spec is None:
        return choose_mode(state, given, data_parallel=True)  # type: ignore[arg-type]
    # Each shard key held by two replicas or more: a lost rank's state is on a
    # survivor (jit). One holder per key (1-D FSDP): a ring copy in steady state.
    return sharded_mode(state, given, mesh_spec)


def sharded_mode(state: Registered, given: str | None, spec: MeshSpec) -> str:
    """A sharded job's mode: `given`, else jit where every shard key has two holders or more
    (HSDP), replicated where one (1-D FSDP)."""
    if given is not None:
        return choose_mode(state, given)  # type: ignore[arg-type]
    return "jit" if spec.replicas >= 2 else "replicated"
