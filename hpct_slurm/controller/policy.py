"""Pure decisions of the controller: who holds which position, what replaces what, where to
restart. No I/O here, so every rule is tested without a cluster."""
from __future__ import annotations

from dataclasses import dataclass, field

from ..errors import HpctError
from .formation import broken_from_outside


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

    def first_ranks(self) -> dict[str, int]:
        """Member -> its first rank, for a loop that places every rank (rank_of scans the
        member list: O(world x nodes) over a whole generation; cProfile found it in every
        relayed round at 8,192 ranks)."""
        return {n: i * self.tasks_per_node for i, n in enumerate(self.members)}

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


# ---- where to restore from ------------------------------------------------------------------

CREATION = -1  # the state a script had when its Job was built, before step 0


@dataclass(frozen=True)
class Held:
    """What one process can restore from (its `Holdings` report): `own` steps of its own
    snapshot (the shared state in jit mode, the whole state in replicated mode), `rank_own`
    steps of its own per-rank state, `replicas` rank -> steps of other ranks' state."""

    own: frozenset[int] = frozenset()
    rank_own: frozenset[int] = frozenset()
    replicas: dict[int, frozenset[int]] = field(default_factory=dict)


def keys_of(shard_keys: list[int] | None, rank: int) -> int:
    """A rank's shard key in the list the ranks report (empty: plain data parallelism, where
    every rank holds the same state: one key)."""
    if not shard_keys:
        return 0
    if not 0 <= rank < len(shard_keys):
        raise HpctError(f"rank {rank} has no shard key in a list of {len(shard_keys)}")
    return shard_keys[rank]


@dataclass(frozen=True)
class RestorePlan:
    step: int
    # rank -> where its state comes from: own, peer (a survivor with its shard key), ring (its
    # ring copy, replicated mode), disk, creation
    sources: dict[int, str]

    @property
    def from_disk(self) -> list[int]:
        return sorted(r for r, s in self.sources.items() if s == "disk")


def plan_restore(needs: dict[int, int], held: dict[int, Held], *, mode: str, rank_state: bool,
                 disk_shared: set[int] | frozenset[int] | dict[int, set[int]] = frozenset(),
                 disk_rank: dict[int, set[int]] | None = None,
                 shard_keys: list[int] | None = None,
                 leaving: dict[int, Held] | None = None) -> RestorePlan:
    """The newest step every rank of the next generation can reach, and from where.

    `needs`: new rank -> the rank whose state it must take (its own for a survivor: positions
    never move). `held`: new rank -> what the process at that rank holds, for processes that
    hold state of their own (survivors; a newcomer holds nothing until its restore succeeded).
    `disk_shared` / `disk_rank`: steps persisted for the shared state (shard key -> steps; a
    plain set is shard key 0's) and for each rank's own. `shard_keys`: rank -> shard key of a
    sharded job (layout_rules.MeshSpec; empty or None: plain data parallelism, one key). The
    "shared" state is then shared only among the ranks of one shard key: a lost rank takes it
    from a survivor with its key, else from that key's file on disk. `leaving`: rank -> what
    the live process leaving that position in a planned move holds; it serves its own copies
    to its successor like a ring holder (a holder's Holdings may predate the leaving rank's
    last push: counting only the holder would lose that step).

    A rank reaches step s from its own snapshot, from a peer (any process's own snapshot for
    the shared state in jit mode; a ring replica of its rank otherwise), or from disk (its
    shard key's file, and its own state's file where it has per-rank state), in either mode. A newcomer (a process that never trained)
    stands at the state at creation (step -1) by itself: its script built the same model from
    the same seed, and nothing has moved its per-rank state yet. Raises when no step is
    reachable by every rank: the job must escalate (never train on from mixed state)."""
    disk_rank = disk_rank or {}
    disk_by_key = (disk_shared if isinstance(disk_shared, dict)
                   else {0: set(disk_shared)})

    def key(rank: int) -> int:
        return keys_of(shard_keys, rank)

    # shard key -> steps some process of that key holds in memory
    shared_by_key: dict[int, set[int]] = {}
    for r, h in held.items():
        shared_by_key.setdefault(key(needs[r]), set()).update(h.own)
    replicas: dict[int, set[int]] = {}
    for h in held.values():
        for r, steps in h.replicas.items():
            replicas.setdefault(r, set()).update(steps)
    for r, h in (leaving or {}).items():
        replicas.setdefault(r, set()).update(h.own if mode == "replicated" else h.rank_own)

    def source(rank: int, step: int) -> str | None:
        old = needs[rank]
        mine = held.get(rank)
        if mine is not None and not (mine.own or mine.rank_own):
            mine = None  # nothing of its own yet: a newcomer whose restore never finished
        if mode == "replicated":
            if mine is not None and step in mine.own:
                return "own"
            if step in replicas.get(old, ()):
                return "ring"  # its ring copy: no other process holds this rank's state
            if step == CREATION and mine is None:
                return "creation"
            # Its own and its ring copy both lost (a rank and its ring holder together): the
            # key's file on disk (the rank's own state beside it, where it has any), as in
            # jit mode, rather than a requeue that would restore the very same files.
            if step in disk_by_key.get(key(old), ()) and \
                    (not rank_state or step in disk_rank.get(old, ())):
                return "disk"
            return None
        if mine is not None and step in mine.own:
            shared = "own"
        elif step == CREATION and mine is None:
            shared = "creation"
        elif step in shared_by_key.get(key(old), ()):
            shared = "peer"
        elif step in disk_by_key.get(key(old), ()):
            shared = "disk"
        else:
            return None
        if not rank_state:
            return shared
        if mine is not None and step in mine.rank_own:
            own = "own"
        elif step in replicas.get(old, ()):
            own = "peer"
        elif step in disk_rank.get(old, ()):
            own = "disk"
        elif step == CREATION and mine is None:
            own = "creation"
        else:
            return None
        # report the costliest of the two copies
        order = ["own", "creation", "peer", "disk"]
        return max(shared, own, key=order.index)

    # CREATION is reachable only where every rank is a newcomer or still holds it (a fault
    # before or during step 0): never a restart from scratch in the middle of a run.
    candidates: set[int] = {CREATION}.union(*shared_by_key.values(), *disk_by_key.values())
    for h in held.values():
        candidates |= h.rank_own
    for steps in [*replicas.values(), *disk_rank.values()]:
        candidates |= set(steps)
    for step in sorted(candidates, reverse=True):
        sources = {r: source(r, step) for r in needs}
        if all(s is not None for s in sources.values()):
            return RestorePlan(step, {r: s for r, s in sources.items() if s is not None})
    newest = max(candidates)
    lacking = sorted(r for r in needs if source(r, newest) is None)
    raise HpctError(f"no step is held for every rank: at step {newest} (the newest held) "
                    f"rank(s) {lacking} have no copy in memory or on disk")


# ---- one recovery round ---------------------------------------------------------------------

class Action:
    """What a recovery round does (the values are plain strings, as in the events)."""

    REPLACE = "replace"    # warm spares take the lost positions (none lost: restart in place)
    SHRINK = "shrink"      # no spare left, --on-no-spare shrink: survivors take the lost shards
    REQUEUE = "requeue"    # escalate, infrastructure: requeue (--on-no-spare requeue)
    FAIL = "fail"          # escalate and end: the script's own error, or --on-no-spare fail


@dataclass(frozen=True)
class SurvivorReport:
    """What a surviving process reported after the STOP (its Holdings): where it sits and what
    it can restore from. `live`: its connection still stands."""

    node: str
    local_rank: int
    held: Held
    held_rank: int
    mode: str = "jit"
    rank_state: bool = False
    shard_keys: tuple[int, ...] = ()
    error: str = ""
    live: bool = True


@dataclass(frozen=True)
class RecoveryDecision:
    """The plan of one recovery round (decide_recovery): the controller only carries it out.

    `lost`: the lost active members, in the order they were detected. `replacement`: the next
    generation's layout (None when no layout could be made). `shards`: data shards by node of
    the next generation. `spares`: the next generation's warm spares. `plan`: the restore step
    and each rank's source. `action` and `reason`: what happens and why; an escalation
    (REQUEUE, FAIL) carries in `reason` the error the job ends with, and `script` says whether
    it is the training script's own (never requeued). `shrunk`: the layout is a shrink (also
    when the round then escalates: no step to restore)."""

    action: str
    reason: str
    lost: list[str]
    replacement: Replacement | None = None
    shards: dict[str, list[int]] = field(default_factory=dict)
    spares: list[str] = field(default_factory=list)
    plan: RestorePlan | None = None
    stalled_restarts: int = 0
    script: bool = False
    shrunk: bool = False
    # a restart in place whose errors are all the transport's (formation.py): what broke
    # the generation was not a member and not the script; those errors
    outside: tuple[str, ...] = ()

    @property
    def escalates(self) -> bool:
        return self.action in (Action.REQUEUE, Action.FAIL)

    @property
    def taken(self) -> dict[str, str]:
        return self.replacement.taken if self.replacement else {}

    @property
    def restore_step(self) -> int | None:
        return self.plan.step if self.plan else None


def restore_inputs(members: list[str], tasks_per_node: int, reports: list[SurvivorReport]
                   ) -> tuple[dict[int, int], dict[int, Held], str, bool, list[int]]:
    """plan_restore's `needs` and `held` for the next generation's `members`, and the mode,
    rank_state and shard keys the survivors reported. A survivor restores its own rank's state
    (`held_rank`: positions never move on a replacement, a shrink renumbers the survivors);
    every other process (a spare, a survivor whose connection dropped) holds nothing."""
    by_proc = {(r.node, r.local_rank): r for r in reports}
    needs: dict[int, int] = {}
    held: dict[int, Held] = {}
    for i, node in enumerate(members):
        for local in range(tasks_per_node):
            rank = i * tasks_per_node + local
            r = by_proc.get((node, local))
            survivor = r is not None and r.live
            needs[rank] = r.held_rank if survivor and r.held_rank >= 0 else rank
            if survivor and r.held_rank >= 0:
                held[rank] = r.held
    mode = reports[0].mode if reports else "jit"
    rank_state = any(r.rank_state for r in reports)
    keys = next((list(r.shard_keys) for r in reports if r.shard_keys), [])
    if keys and len(keys) != len(needs):
        raise HpctError(f"the ranks report shard keys for {len(keys)} ranks, the next "
                        f"generation has {len(needs)}: a sharded job cannot change size")
    return needs, held, mode, rank_state, keys


def decide_recovery(world: World, lost: list[str], ready_spares: list[str],
                    shards: dict[str, list[int]], reports: list[SurvivorReport], *,
                    on_no_spare: str = "requeue",
                    disk_shared: dict[int, set[int]] | None = None,
                    disk_rank: dict[int, set[int]] | None = None,
                    previous_restore: int | None = None, stalled_restarts: int = 0,
                    max_stalled_restarts: int = 3,
                    unusable: set[str] | frozenset[str] = frozenset(),
                    leaving: set[str] | frozenset[str] = frozenset()) -> RecoveryDecision:
    """Who replaces whom, from which step, or why the job must escalate: one round's decision.

    `world`: the current generation (its spares as they stand now, a node fenced alive and
    back as a fresh spare step included). `lost`: the lost members (a restart in place: none).
    `ready_spares`: spares whose every process is registered, in order. `reports`: what the
    survivors hold (after the STOP). `disk_shared` / `disk_rank`: the persisted steps
    (plan_restore). `previous_restore`: the restore step of the recovery still in progress
    (None: none is), for counting restarts in place that make no progress. `unusable`: nodes
    never to be kept as spares (fenced dead, or spares lost in this round). `leaving`: lost
    nodes whose processes live on and serve their own state (a planned move).

    The rules: a lost position goes to a ready spare; with too few, --on-no-spare shrink
    spreads the lost nodes' data shards over the survivors, anything else escalates. The
    restore step is the newest every rank of the next generation reaches (plan_restore), else
    the job escalates. `max_stalled_restarts` restarts in place in a row at the same step are
    the script's own error: the job fails, never requeued (it would only fail again)."""
    disk_shared = disk_shared or {}
    lost = [n for n in lost if n in world.members]
    escalate = Action.REQUEUE if on_no_spare == "requeue" else Action.FAIL

    def escalation(why: str, **kw) -> RecoveryDecision:
        return RecoveryDecision(escalate, why, lost, **kw)

    shrinking = len(ready_spares) < len(lost) and on_no_spare == "shrink"
    try:
        if shrinking:
            rep, new_shards = shrink(world, lost, shards)
        else:
            rep = replace(world, lost, ready_spares)
            new_shards = dict(shards)
            for lost_node, spare in rep.taken.items():
                new_shards[spare] = new_shards.pop(lost_node)
    except HpctError as exc:
        return escalation(exc.message)
    action = Action.SHRINK if shrinking else Action.REPLACE
    try:
        needs, held, mode, rank_state, keys = restore_inputs(rep.members, world.tasks_per_node,
                                                             reports)
        moving = {r.held_rank: r.held for r in reports
                  if r.node in leaving and r.live and r.held_rank >= 0}
        plan = plan_restore(needs, held, mode=mode, rank_state=rank_state,
                            disk_shared=disk_shared, disk_rank=disk_rank, shard_keys=keys,
                            leaving=moving)
    except HpctError as exc:
        return escalation(exc.message, replacement=rep, shards=new_shards, shrunk=shrinking)
    stalled = stalled_restarts + 1 if not lost and previous_restore == plan.step else 0
    outside = () if lost else broken_from_outside(r.error for r in reports)
    if stalled >= max_stalled_restarts:
        errors = sorted({r.error for r in reports if r.error})
        stuck = (f"{stalled} restarts in place made no progress past step {plan.step}"
                 + (f": {'; '.join(errors)}" if errors else ""))
        if outside:  # the transport broke it every time, not the script: never charged to it
            return escalation(f"formation broken by something other than a member: {stuck}",
                              replacement=rep, shards=new_shards, plan=plan,
                              stalled_restarts=stalled, shrunk=shrinking, outside=outside)
        return RecoveryDecision(Action.FAIL, stuck, lost, rep, new_shards, plan=plan,
                                stalled_restarts=stalled, script=True, shrunk=shrinking)
    # A node fenced alive in this round may already be back as a fresh spare step: it is a
    # spare now, not a lost member.
    back = [n for n in world.spares if n not in rep.spares and n not in rep.members
            and n not in unusable]
    if shrinking:
        reason = (f"{len(lost)} node(s) lost ({', '.join(lost)}), {len(ready_spares)} warm "
                  f"spare(s) ready: the survivors take over the lost data shards")
    elif lost:
        reason = ", ".join(f"{s} takes {n}'s place" for n, s in rep.taken.items())
    else:
        reason = "every rank restarts in place"
    return RecoveryDecision(action, reason, lost, rep, new_shards, rep.spares + back, plan,
                            stalled, shrunk=shrinking, outside=outside)


# ---- what a recovery cost -------------------------------------------------------------------

# The phases of a recovery, in the order they happen: the keys of recovery.done's `phases`.
PHASES = ("detect_to_stop", "fence", "survivors_ready", "reform_restore_first_step")


@dataclass
class RecoveryRecord:
    """One recovery round, from the fault's detection to the first step every rank of the new
    generation completed: what it decided and when each phase ended (unix times)."""

    t_detect: float
    t_stop: float = 0.0       # STOP sent to every survivor
    t_fenced: float = 0.0     # every lost node fenced
    t_ready: float = 0.0      # every survivor ready (or lost as well)
    t_assigned: float = 0.0   # the new generation assigned
    generation: int = -1
    restore_step: int = -1
    lost: list[str] = field(default_factory=list)
    taken: dict[str, str] = field(default_factory=dict)
    reasons: dict[str, str] = field(default_factory=dict)
    # "recovery" (a fault), "move" (a planned move) or "grow" (back to the full world): which
    # event ends it (controller/lifecycle.py)
    kind: str = "recovery"
    # the newest step any rank had completed when the round began: restore_step below it is
    # the steps lost
    newest_done: int = -1

    @property
    def first_step(self) -> int:
        """The step whose completion by every rank ends the recovery."""
        return self.restore_step + 1

    def phases(self, now: float) -> dict[str, float]:
        durations = (self.t_stop - self.t_detect, self.t_fenced - self.t_stop,
                     self.t_ready - self.t_fenced, now - self.t_assigned)
        return dict(zip(PHASES, durations))

    def done_fields(self, now: float) -> dict:
        """The fields of its recovery.done event, once every rank completed the first step."""
        return {"generation": self.generation, "restore_step": self.restore_step,
                "lost": self.lost, "taken": self.taken, "reasons": self.reasons,
                "recovery_s": now - self.t_detect, "phases": self.phases(now),
                "lost_steps": max(0, self.newest_done - self.restore_step)}


# ---- growing back after a shrink ------------------------------------------------------------

def grow(world: World, shards: dict[str, list[int]], ready_spares: list[str]
         ) -> tuple[Replacement, dict[str, list[int]]] | None:
    """Undo a shrink (as far as ready spares allow): each spare takes back one data shard a
    survivor took over, and the members are ordered by their shard, so that a layout of one
    shard per node is again the layout the job started with (same ranks, same data, same
    reduction order: bit-identical to a run that never shrank). None: nothing to grow."""
    extra = sorted(p for n in world.members for p in shards[n][1:])
    if not extra or not ready_spares:
        return None
    new = {n: list(shards[n]) for n in world.members}
    for spare, pos in zip(ready_spares, extra):
        owner = next(n for n in world.members if pos in new[n])
        new[owner].remove(pos)
        new[spare] = [pos]
    members = sorted(new, key=lambda n: min(new[n]))
    spares = [s for s in world.spares if s not in new]
    return Replacement(world.generation + 1, members, spares, {}), new


def decide_grow(world: World, shards: dict[str, list[int]], ready_spares: list[str],
                reports: list[SurvivorReport], *,
                disk_shared: dict[int, set[int]] | None = None,
                disk_rank: dict[int, set[int]] | None = None) -> RecoveryDecision | None:
    """The grow-back round's plan: the layout (grow) and the restore step every rank of the
    bigger generation reaches (the members' own newest common snapshot: nothing is lost).
    None when there is nothing to grow or no common step (the job then stays as it is)."""
    grown = grow(world, shards, ready_spares)
    if grown is None:
        return None
    rep, new_shards = grown
    try:
        needs, held, mode, rank_state, keys = restore_inputs(rep.members, world.tasks_per_node,
                                                             reports)
        if rank_state or keys:
            return None  # per-rank or sharded state does not follow a shard to another node
        plan = plan_restore(needs, held, mode=mode, rank_state=False,
                            disk_shared=disk_shared or {}, disk_rank=disk_rank, shard_keys=keys)
    except HpctError:
        return None
    added = [n for n in rep.members if n not in world.members]
    return RecoveryDecision("grow", f"{', '.join(added)} take(s) back data shard(s) "
                            f"{[new_shards[n][0] for n in added]}", [], rep, new_shards,
                            rep.spares, plan)
