"""The recovery round, and every generation's assignment.

A fault (detection.py) wakes `_faults`, which runs one round at a time; faults that arrive
during a round are folded into it or into the next one. A round goes through its phases in
order, each filling in the round's state (`Round`):

1. take the faults: fence the lost spares; a member whose ranks reported a fault of their own
   and are ready restarts in place (not lost);
2. STOP to every survivor, then fence the lost members (fencing.py);
3. wait for the survivors to be ready with their Holdings report; one that is not is lost as
   well (a second fault, fenced in the same round);
4. short of ready spares with one on its way (arrivals.py): wait for it, within
   HPCT_SPARE_WAIT_S;
5. decide (policy.decide_recovery, pure: replace, shrink, requeue or fail, and the restore
   step with each rank's source);
6. carry the decision out: the new generation's layout and the Assign to each of its ranks,
   or an escalation (raised: `_faults` reports it and ends the run, ending.py).

The round then stays open (`recovery`) until every rank completed its first step. Generation
0's assignment (`_maybe_start`) goes through the same `_assign`.
"""
from __future__ import annotations

import asyncio
import gc
import os
import re
import time
from dataclasses import dataclass, field
from pathlib import Path

from .. import protocol as P
from ..errors import HpctError
from ..events import Ev, EventLog, RankState, Role
from .arrivals import arrivals, should_wait
from .connections import Conn
from .detection import IN_PROCESS
from .ending import ScriptError
from .lifecycle import Lifecycle, fold
from .options import Options
from .pacing import AssignView, compact_members
from .policy import (RecoveryDecision, RecoveryRecord, SurvivorReport, World, data_ranks,
                     decide_recovery, replace)

RANK_DIR_RE = re.compile(r"rank[0-9]{1,9}")  # ASCII digits: '²'.isdigit() but int('²') fails


@dataclass
class Round:
    """One recovery round's state, as its phases fill it in."""

    rec: RecoveryRecord  # its timings and outcome (the recovery.* events)
    lost: dict[str, str]  # node -> why, every node the round lost (spares included)
    lost_spares: list[str]
    in_place: list[str]  # members whose ranks restart in place (not lost)
    lost_active: list[str]  # lost members, in the order they were detected
    generation: int = -1  # the generation the fault ended
    survivors: list[Conn] = field(default_factory=list)


class RecoveryRound:
    """The controller's recovery rounds and assignments (a piece of Controller,
    controller.py)."""

    # The controller's state this piece reads and writes (Controller.__init__ sets it up).
    o: Options
    run_dir: Path
    secret: bytes
    events: EventLog
    world: World
    shards: dict[str, list[int]]  # node -> its data shards
    data_world: int  # the global batch never changes
    conns: dict[tuple[str, int], Conn]
    dead_nodes: set[str]
    pending_faults: dict[str, str]
    fault_event: asyncio.Event
    recovering: bool  # a round runs (a recovery here, or a planned one: lifecycle.py)
    recovery: RecoveryRecord | None  # the round whose first step is awaited
    first_step_reports: dict[int, int]  # generation -> its first step's reports
    stalled_restarts: int
    trained: bool
    said_done: set[int]
    gen0_scheduled: bool  # generation 0's assignment is on its way (once)
    initial_restore: int
    lifecycle: Lifecycle
    fencing: dict[str, "asyncio.Future[None]"]  # nodes fenced alive, back as spares later
    borrowed: list[int]  # pool companion jobs submitted
    pool_nodes: set[str]  # pool nodes that joined
    spare_wait_s: float  # HPCT_SPARE_WAIT_S
    # What it uses of the other pieces: _live, _node_ready and _send (connections.py),
    # _fence (fencing.py), _maybe_borrow (spares.py), _escalate (ending.py).

    # ---- the round loop ----------------------------------------------------------------------
    async def _faults(self) -> None:
        while True:
            await self.fault_event.wait()
            self.fault_event.clear()
            if self.pending_faults and not self.recovering:
                self.recovering = True
                try:
                    await self._recover()
                except Exception as exc:  # never let the fault loop die: escalate instead
                    why = exc.message if isinstance(exc, HpctError) else \
                        f"{type(exc).__name__}: {exc}"
                    self.events.emit(Ev.RECOVERY_FAILED, error=why)
                    await self._escalate(why, script=isinstance(exc, ScriptError))
                finally:
                    self.recovering = False
                if self.pending_faults:
                    self.fault_event.set()
                else:
                    self._maybe_start()  # a member replaced before generation 0 started

    async def _recover(self) -> None:
        """One recovery round, phase by phase: the I/O here, the decision in
        policy.decide_recovery."""
        r = await self._take_faults()
        if r is None:
            return
        if self.world.generation == 0 and not self.gen0_scheduled:
            await self._replace_before_start(r)
            return
        await self._stop_and_fence(r)
        await self._survivors_ready(r)
        await self._await_spares(r.lost_active, r.lost_spares)
        d = await self._decide(r.lost_active, r.survivors, r.lost_spares)
        await self._carry_out(r, d)

    # ---- its phases --------------------------------------------------------------------------
    async def _take_faults(self) -> Round | None:
        """The faults pending now become this round's; lost spares are fenced at once. None
        when no member is lost and none restarts in place (only spares were)."""
        rec = RecoveryRecord(t_detect=time.time())
        lost = dict(self.pending_faults)
        self.pending_faults.clear()
        lost_spares = [n for n in lost if n in self.world.spares]
        for node in lost_spares:
            await self._fence(node, lost[node])
            self.world.spares.remove(node)
        # A member whose ranks all reported a fault of their own and are ready stays a member:
        # they restart in place, like every other survivor.
        in_place = [n for n in lost if lost[n] == IN_PROCESS and n in self.world.members
                    and self._node_ready(n)
                    and all(c.state == RankState.READY for c in self._live(n))]
        for node in in_place:
            del lost[node]
        lost_active = [n for n in lost if n in self.world.members]
        if not lost_active and not in_place:
            return None
        if in_place:
            self.events.emit(Ev.FAULT_IN_PROCESS, nodes=in_place,
                             generation=self.world.generation)
        return Round(rec, lost, lost_spares, in_place, lost_active)

    async def _replace_before_start(self, r: Round) -> None:
        """A member lost before generation 0 was assigned (its node died while the ranks
        registered): nobody has formed or trained anything, so there is nothing to stop or
        wait for. Its position goes to a ready spare (the same placement as a round's), and
        generation 0 starts once that spare's ranks are in. Before this, such a fault ran a
        round: the registering survivors never answered a STOP (they hold no generation), so
        they were fenced as "not ready" after the ready timeout and the job requeued."""
        for node in r.lost_active:
            await self._fence(node, r.lost[node])
        await self._await_spares(r.lost_active, r.lost_spares)
        ready = [s for s in self.world.spares if self._node_ready(s)]
        rep = replace(self.world, r.lost_active, ready)  # raises when too few: escalation
        for lost_node, spare in rep.taken.items():
            self.shards[spare] = self.shards.pop(lost_node)
        self.world.members, self.world.spares = rep.members, rep.spares
        self.world.lost += r.lost_active
        self.events.emit(Ev.FAULT_BEFORE_START, lost=r.lost_active, taken=rep.taken,
                         reasons={n: r.lost[n] for n in r.lost_active})
        self._maybe_borrow()  # generation 0 starts once this round is over (_faults)

    async def _stop_and_fence(self, r: Round) -> None:
        """STOP to every survivor (naming the lost addresses, whose connections it cuts), then
        fence the lost members."""
        g = r.generation = self.world.generation
        r.survivors = [c for n in self.world.members if n not in r.lost for c in self._live(n)]
        lost_addrs = sorted({c.host_addr for (n, _), c in self.conns.items()
                             if n in r.lost_active})
        stop = P.Stop(g, f"{', '.join(r.lost_active)}: "
                         f"{'; '.join(r.lost[n] for n in r.lost_active)}",
                      lost_addrs, fault=True)  # the same (immutable) message for everyone
        for c in r.survivors:
            await self._send(c, stop)
        r.rec.t_stop = time.time()
        self.events.emit(Ev.FAULT_STOP_SENT, generation=g, survivors=len(r.survivors))
        for node in r.lost_active:
            await self._fence(node, r.lost[node])
        r.rec.t_fenced = time.time()

    async def _survivors_ready(self, r: Round) -> None:
        """Wait for the survivors; what was lost meanwhile (a survivor that failed its health
        check or never answered, another fault) is fenced and lost in this round too."""
        await self._wait_ready(r.survivors)
        # a survivor that failed its health check or never answered is lost as well
        for c in r.survivors:
            if c.gone or c.state != RankState.READY:
                self.pending_faults.setdefault(c.node, f"not ready after fault ({c.state})")
        for node in [n for n in self.pending_faults if n in r.lost]:
            del self.pending_faults[node]  # the same loss seen twice (e.g. EOF, then step exit)
        if self.pending_faults:
            extra = list(self.pending_faults)
            self.events.emit(Ev.FAULT_SECOND, nodes=extra, during="recovery")
            for node in extra:
                r.lost[node] = self.pending_faults.pop(node)
                await self._fence(node, r.lost[node])
                if node in self.world.spares:
                    self.world.spares.remove(node)
            r.lost_active = [n for n in r.lost if n in self.world.members]
            r.survivors = [c for c in r.survivors if c.node not in r.lost]
        r.rec.t_ready = time.time()
        # the newest step any rank of this generation completed: the restore step's distance
        # from it is the steps lost (recomputed)
        g = r.generation
        r.rec.newest_done = max((c.done_step for c in self.conns.values()
                                 if c.generation == g and c.done_generation == g), default=-1)

    async def _await_spares(self, lost_active: list[str], lost_spares: list[str]) -> None:
        """Short of ready spares for the lost members, with enough on their way (arrivals.py):
        wait for them, at most HPCT_SPARE_WAIT_S, before the round decides. A fault that
        arrives meanwhile waits for the next round, as during any round."""
        t0 = time.monotonic()
        said = False
        while True:
            ready = [s for s in self.world.spares if self._node_ready(s)]
            # a fault pending on a node rules it out, unless it is the same loss seen again
            faulty = {n for n in self.pending_faults if n not in lost_active}
            coming = arrivals(self.world.spares, ready,
                              self.dead_nodes | set(lost_spares) | faulty,
                              list(self.fencing), len(self.borrowed), len(self.pool_nodes))
            waited = time.monotonic() - t0
            if not should_wait(len(lost_active), len(ready), coming, waited,
                               self.spare_wait_s):
                break
            if not said:
                said = True
                self.events.emit(Ev.RECOVERY_SPARE_WAIT, lost=lost_active, ready=ready,
                                 bound_s=self.spare_wait_s, **coming.fields())
            await asyncio.sleep(0.05)
        if said:
            self.events.emit(Ev.RECOVERY_SPARE_WAIT_OVER, waited_s=round(waited, 3),
                             ready=ready, **coming.fields())

    async def _carry_out(self, r: Round, d: RecoveryDecision) -> None:
        """The decision: a shrink's new shards, an escalation (raised), or the new
        generation's layout, sources and assignment."""
        rec, lost, lost_active, survivors = r.rec, r.lost, r.lost_active, r.survivors
        if d.shrunk:
            assert d.replacement is not None
            self.shards = d.shards
            self.events.emit(Ev.RECOVERY_SHRINK, generation=d.replacement.generation,
                             lost=lost_active, members=d.replacement.members, shards=self.shards)
        if d.plan is not None:
            self.stalled_restarts = d.stalled_restarts
        if d.outside:
            self.events.emit(Ev.FORMATION_BROKEN, generation=self.world.generation,
                             errors=list(d.outside), stalled_restarts=d.stalled_restarts,
                             escalates=d.escalates)
        if d.escalates:
            # _faults reports it (recovery.failed) and escalates: requeue or fail
            raise (ScriptError if d.script else HpctError)(d.reason)
        assert d.replacement is not None and d.plan is not None
        rep, plan = d.replacement, d.plan
        self.shards = d.shards
        self.world.members, self.world.spares = rep.members, d.spares
        self.world.generation = rep.generation
        self.world.lost += lost_active
        restore = plan.step
        # shared state is identical on every survivor: the controller lists all that hold the
        # restore step, nearest first, so a corrupted or vanished source costs one retry, not
        # the recovery (a spare that took a position in a round cut short holds nothing yet:
        # asking it would cost a refused request)
        first = self.world.first_ranks()
        sources = {first[c.node] + c.local_rank: [(c.host_addr, c.transfer_port)]
                   for c in survivors if c.held is not None and restore in c.held.own}
        rec.generation, rec.restore_step = rep.generation, restore
        rec.lost, rec.taken = lost_active, rep.taken
        rec.reasons = {n: lost[n] for n in lost_active}
        rec.t_assigned = time.time()
        if self.recovery is not None:
            # the round before never saw its first step (this round's fault cut it short):
            # its faults and what took their places go on in this round's record
            fold(self.recovery, rec)
        self.recovery = rec
        self.events.emit(Ev.RECOVERY_ASSIGN, generation=rep.generation, restore_step=restore,
                         taken=rep.taken, members=rep.members,
                         newest_held=max((c.step for c in survivors), default=-1),
                         sources={str(rank): src for rank, src in sorted(plan.sources.items())})
        if plan.from_disk:
            # Memory could not serve a consistent state for every rank: say so, with the
            # steps this costs, instead of calling it an in-memory recovery.
            self.events.emit(Ev.RECOVERY_DISK_FALLBACK, generation=rep.generation,
                             restore_step=restore, ranks=plan.from_disk,
                             newest_held=max((c.step for c in survivors), default=-1))
        await self._assign(restore, sources)
        self._maybe_borrow()

    async def _decide(self, lost_active: list[str], survivors: list[Conn],
                      lost_spares: list[str], leaving: tuple[str, ...] = ()
                      ) -> RecoveryDecision:
        """What the round does (policy.decide_recovery), from what the controller knows now:
        the ready spares, the survivors' Holdings reports and the steps on disk. `leaving`:
        lost nodes whose ranks live on and serve their state (a planned move)."""
        reports = [SurvivorReport(c.node, c.local_rank, c.held, c.held_rank, c.mode,
                                  c.rank_state, tuple(c.shard_keys), c.error, not c.gone)
                   for c in survivors if c.held is not None]
        disk_shared, disk_rank = await asyncio.to_thread(self._persisted_steps)
        return decide_recovery(
            self.world, lost_active, [s for s in self.world.spares if self._node_ready(s)],
            self.shards, reports, on_no_spare=self.o.on_no_spare, disk_shared=disk_shared,
            disk_rank=disk_rank,
            previous_restore=self.recovery.restore_step if self.recovery else None,
            stalled_restarts=self.stalled_restarts,
            max_stalled_restarts=self.o.max_stalled_restarts,
            unusable=self.dead_nodes | set(lost_spares), leaving=frozenset(leaving))

    async def _wait_ready(self, survivors: list[Conn]) -> None:
        deadline = time.monotonic() + self.o.ready_timeout_s
        waiting = survivors
        while time.monotonic() < deadline:
            # ready counts once its Holdings report is in (it is sent just before); an answer
            # stays given until the next assignment, so each poll looks only at those still
            # waited for (every survivor every 20 ms made the wait O(world) per poll)
            waiting = [c for c in waiting if not (
                c.gone or c.state == RankState.UNHEALTHY
                or (c.state == RankState.READY and c.held is not None))]
            if not waiting:
                break
            if self.pending_faults:
                await asyncio.sleep(0.05)  # a second fault: keep waiting for the rest
            await asyncio.sleep(0.02)

    # ---- the steps on disk -------------------------------------------------------------------
    def _persisted_steps(self) -> tuple[dict[int, set[int]], dict[int, set[int]]]:
        """Steps on disk: shard key -> those of the shared state (key 0 alone for plain data
        parallelism), and rank -> those of its own state."""
        from ..recovery.persist import list_steps

        def by_index(root: Path) -> dict[int, set[int]]:
            return {int(d.name[4:]): set(list_steps(root, int(d.name[4:])))
                    for d in (root.glob("rank*") if root.is_dir() else [])
                    if RANK_DIR_RE.fullmatch(d.name)}

        return by_index(self.run_dir / "persist"), by_index(self.run_dir / "persist-rank")

    def _persisted_step(self) -> int:
        """The newest step on disk that every shard key's shared state (one key for plain
        data parallelism) and every rank's own state (a sampler position) has, intact."""
        from ..recovery.persist import load_latest

        shared, rank_steps = self._persisted_steps()
        if not shared:
            return -1
        common = set.intersection(*shared.values(), *rank_steps.values())
        for step in sorted(common, reverse=True):
            try:
                for k in sorted(shared):
                    got, _, _ = load_latest(self.run_dir / "persist", k, step, key=self.secret)
                    if got != step:
                        raise HpctError(f"shard key {k}'s file of step {step} is damaged")
            except HpctError as exc:
                self.events.emit(Ev.CONTROLLER_PERSISTED_STEP_INCOMPLETE, step=step,
                                 error=exc.message)
                continue
            self.events.emit(Ev.CONTROLLER_RESUME_FROM_DISK, step=step,
                             restart_count=os.environ.get("SLURM_RESTART_COUNT", "0"))
            return step
        return -1

    # ---- assignment ----------------------------------------------------------------------------
    def _maybe_start(self) -> None:
        # Once: the ranks get their numbers only when the task runs, so registrations that
        # arrive before it (spares registering with the last member) would each schedule
        # another generation 0, and a rank would find a stale Assign queued at its next fault.
        if self.world.generation == 0 and self.recovery is None and not self.recovering \
                and not self.gen0_scheduled \
                and len(self.conns) >= len(self.world.members) * self.o.tasks_per_node \
                and all(self._node_ready(n) for n in self.world.members) \
                and all(c.rank < 0 for n in self.world.members for c in self._live(n)):
            self.gen0_scheduled = True
            asyncio.create_task(self._assign(restore=self.initial_restore, sources={}))

    async def _assign(self, restore: int, sources: dict[int, list[tuple[str, int]]]) -> None:
        g = self.world.generation
        self.said_done.clear()
        self.events.emit(Ev.GENERATION_START, generation=g, members=self.world.members,
                         restore_step=restore)
        members = [c for node in self.world.members for c in self._live(node)]
        first = self.world.first_ranks()
        for c in members:
            c.rank = first[c.node] + c.local_rank
        peers = {c.rank: (c.host_addr, c.transfer_port) for c in members}
        # beyond pacing.FULL_VIEW_MAX ranks each rank gets only the peers and sources it uses
        # (a sharded job's ranks need every peer's address: they keep the full view)
        sharded = any(c.shard_keys for c in members)
        names, hostlist = compact_members(self.world.members, self.world.world_size)
        view = AssignView(self.world.world_size, len(self.world.members), sources, peers)
        for c in members:
            c.generation, c.state, c.role = g, RankState.ASSIGNED, Role.ACTIVE
            c.progress_at, c.reported_at = time.monotonic(), None
            c.held, c.error = None, ""
            src, prs = (sources, peers) if sharded else view(c.rank)
            await self._send(c, P.Assign(
                g, c.rank, self.world.world_size, names,
                self.o.tasks_per_node, restore, src,
                data_ranks(self.shards[c.node], c.local_rank, self.o.tasks_per_node),
                self.data_world, prs, hostlist))
        if g == 0:
            # The job's connections and their state now live as long as the job: out of the
            # collector's sight, a full collection during a later round scans only what the
            # rounds made (bench scale: ~110 ms per full collection at 8,192 ranks, landing in
            # the rounds). The cost: a cycle among them that becomes garbage later (a lost
            # node's connection objects) is never collected.
            gc.collect()
            gc.freeze()

    def _track_first_step(self, step: int) -> None:
        self.trained = True
        rec = self.recovery
        if not rec or step != rec.first_step:
            return
        # counted first: the full check below is O(world), and run for every rank's report it
        # made a round's end O(world^2) (53 s at 16,384 ranks, bench scale)
        seen = self.first_step_reports.get(rec.generation, 0) + 1
        self.first_step_reports[rec.generation] = seen
        if seen < self.world.world_size:
            return
        ranks = {c.rank for c in self.conns.values() if not c.gone and c.step >= step
                 and c.generation == rec.generation}
        if len(ranks) == self.world.world_size:
            self.recovery = None
            self.lifecycle.round_done(rec, time.time())  # its event, the Slurm comment
