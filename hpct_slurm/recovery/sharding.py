"""Which ranks hold the same state in a sharded or hybrid-parallel job (pure).

A job trained on a DeviceMesh (FSDP2 `fully_shard`, HSDP, tensor parallelism) splits its model
and optimizer state over some mesh dimensions and replicates it over others. A rank's *shard
key* is its coordinate on the dimensions that are not replicated: ranks with the same shard key
hold bit-identical state (their replicas are kept equal by the all-reduce over the replicate
dimension), so each is the other's source when one is lost. Plain data parallelism is the case
of one shard key; a 1-D FSDP job has one rank per shard key, so its state must be copied to a
peer in steady state (the ring replica) or come from disk.

`init_device_mesh(device, shape)` lays ranks out row-major (`arange(world).view(shape)`), so a
rank's coordinate is `unravel(rank, shape)` on every rank and on the controller alike.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterable

from ..errors import HpctError

MAX_MESH_DIMS = 8


@dataclass(frozen=True)
class MeshSpec:
    """The shape of the job's DeviceMesh, its dimension names, and which are replicated."""

    shape: tuple[int, ...]
    names: tuple[str, ...]
    replicate: tuple[str, ...] = ()
    # Pipeline-stage dimensions: each coordinate holds other layers, never a replica. Said by
    # the script (Job(stages=...)): a stage module's parameters live on a sub-mesh without
    # them, which would read as "replicated" to the inference below. A name the mesh lacks
    # is no error: torchtitan-style scripts make a dimension only where its degree is > 1
    # (a mistyped name is caught by the structure check before the first step).
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
    dimension nobody declared is caught before the first step (`disagreeing`)."""
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
    of different structures: `digests[rank]` is (digest of the rank's state's names, shapes,
    dtypes and placements; the first such entry, for the message). None when all agree.

    The usual cause is a pipeline-stage dimension read as a replica: a stage's parameters
    live on a sub-mesh without it. Said before the first step, never found at a fault."""
    first: dict[int, int] = {}
    for rank, (digest, _) in enumerate(digests):
        key = spec.shard_key(rank)
        other = first.setdefault(key, rank)
        if digests[other][0] == digest:
            continue
        a, b = spec.coordinate(other), spec.coordinate(rank)
        dims = [n for n, x, y in zip(spec.names, a, b) if x != y]
        return (f"ranks {other} and {rank} differ only on mesh dimension(s) {dims}, which "
                f"were taken as replicas ({list(spec.replicate)}), but hold different state "
                f"(rank {other}: {digests[other][1]}; rank {rank}: {digests[rank][1]}). "
                f"A pipeline-stage dimension must be said: Job(..., stages=({dims[0]!r},))")
    return None

