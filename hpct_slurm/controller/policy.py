"""Pure decisions of the controller: who holds which position, what replaces what, where to
restart. No I/O here, so every rule is tested without a cluster."""
from __future__ import annotations

from dataclasses import dataclass, field

from ..errors import HpctError


@dataclass
class World:
    """Rank layout of one generation: `members[i]` is the node at node-position i; a node's
    local rank j holds global rank i * tasks_per_node + j. Positions never move, so a spare
    that takes over position i inherits exactly the lost node's ranks."""

    members: list[str]
    spares: list[str]
    tasks_per_node: int
    generation: int = 0
    lost: list[str] = field(default_factory=list)

    @property
    def world_size(self) -> int:
        return len(self.members) * self.tasks_per_node

    def rank_of(self, node: str, local_rank: int) -> int:
        return self.members.index(node) * self.tasks_per_node + local_rank

    def ranks_of(self, node: str) -> list[int]:
        base = self.members.index(node) * self.tasks_per_node
        return list(range(base, base + self.tasks_per_node))


@dataclass(frozen=True)
class Replacement:
    generation: int
    members: list[str]
    spares: list[str]
    taken: dict[str, str]  # lost node -> spare node that takes its position


def split_allocation(nodes: list[str], batch_host: str, spares: int,
                     active: int | None = None) -> tuple[list[str], list[str]]:
    """Active and spare nodes. The batch host is always active: its loss kills the job in
    Slurm anyway, so keeping it as a spare would waste a node.

    With `active` set, the world size is fixed and every other node is a spare: a job
    submitted with `--nodes=A-(A+S)` keeps training at the same world size when it is
    requeued onto fewer nodes after losing some (same world size = bit-identical results)."""
    if active is not None:
        if active < 1:
            raise HpctError(f"--active {active} must be at least 1")
        if active > len(nodes):
            raise HpctError(f"--active {active} but the allocation has only {len(nodes)} "
                            f"node(s): {','.join(nodes)}")
        spares = len(nodes) - active
    if spares < 0:
        raise HpctError(f"--spares {spares} must not be negative")
    if len(nodes) - spares < 1:
        raise HpctError(f"the allocation has {len(nodes)} node(s): cannot keep {spares} "
                        f"spare(s) and still train")
    if batch_host not in nodes:
        raise HpctError(f"batch host {batch_host!r} is not in the job's nodes {nodes}")
    others = [n for n in nodes if n != batch_host]
    active_n = len(nodes) - spares
    active = [batch_host] + others[:active_n - 1]
    return active, others[active_n - 1:]


def replace(world: World, lost: list[str], ready_spares: list[str]) -> Replacement:
    """Give each lost member's position to a ready spare, in order. Raises when too few."""
    lost_members = [n for n in world.members if n in lost]
    if len(ready_spares) < len(lost_members):
        raise HpctError(f"{len(lost_members)} node(s) lost ({', '.join(lost_members)}) but "
                        f"only {len(ready_spares)} warm spare(s) ready")
    taken = dict(zip(lost_members, ready_spares))
    members = [taken.get(n, n) for n in world.members]
    spares = [s for s in world.spares if s not in taken.values() and s not in lost]
    return Replacement(world.generation + 1, members, spares, taken)


def restore_step(ready_steps: dict[int, int]) -> int:
    """The step every survivor can roll back to: the oldest of their newest snapshots. Ranks
    move in lockstep through collectives, so these differ by at most one step, and every
    survivor still holds the older one in its second snapshot slot."""
    if not ready_steps:
        raise HpctError("no survivor reported a snapshot: nothing to restore from memory")
    return min(ready_steps.values())


def initial_shards(members: list[str]) -> dict[str, list[int]]:
    """Data shards by node: node position i computes shard i (its ranks' data)."""
    return {n: [i] for i, n in enumerate(members)}


def shrink(world: World, lost: list[str], shards: dict[str, list[int]]
           ) -> tuple[Replacement, dict[str, list[int]]]:
    """Elastic shrink when no spare is left: the survivors keep their positions' order and
    take over the lost nodes' data shards round-robin, so every step still consumes the same
    global batch (the survivors accumulate gradients over their extra shards)."""
    survivors = [n for n in world.members if n not in lost]
    if not survivors:
        raise HpctError("every active node is lost: nothing to shrink onto")
    new = {n: list(shards[n]) for n in survivors}
    orphaned = sorted(p for n in world.members if n in lost for p in shards[n])
    for i, pos in enumerate(orphaned):
        new[survivors[i % len(survivors)]].append(pos)
    spares = [s for s in world.spares if s not in lost]
    return Replacement(world.generation + 1, survivors, spares, {}), new


def data_ranks(node_shards: list[int], local_rank: int, tasks_per_node: int) -> list[int]:
    return [pos * tasks_per_node + local_rank for pos in node_shards]
