"""The node lifecycle around the recovery machinery (issue 17).

* Planned move: an admin drains an active node (`scontrol update nodename=nX state=drain
  reason=...`). Nothing has failed, so there is nothing to detect, fence or roll back: every
  rank leaves the step at its next boundary (STOP), the warm spare takes the node's position
  in a new generation and pulls the state from the leaving ranks themselves (still alive, they
  are its first sources), the group resumes at the step everyone completed, and only then the
  leaving ranks are told goodbye and exit cleanly; the node stays drained, our reason appended.
  A move whose round ends without it (another node's fault at its STOP, the spare gone) is
  asked again until it starts, whatever asked for it first (`_cut_short`).
* Grow back: after an elastic shrink, a spare that is ready again takes back a data shard a
  survivor took over (policy.decide_grow), restoring the world the job started with.
* The record in Slurm: after every round the job's own Comment carries a one-line summary
  (`scontrol show job`, `squeue -O comment`), and so does an escalation. A round cut short by
  another fault (before every rank completed its first step) is folded into the round that
  follows it (`fold`), so that every fault is in the record, with its cause.

The pure parts (what is drained, the summary text, the reason) are functions here and in
policy.py; `Lifecycle` does the I/O through the controller it belongs to, seen through
`Host` (what it uses of it).
"""
from __future__ import annotations

import asyncio
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Awaitable, Coroutine, Protocol, Sequence

from .. import config as C
from .. import protocol as P
from ..errors import HpctError, describe
from ..events import Ev, RankState
from ..fault_count import CountingLog
from ..move_requests import CORRUPTION, read_requests
from ..slurm.client import (NodeInfo, ReservationInfo, SlurmClient, SlurmCommandError,
                            printable_line, refused_for_now)
from .connections import Conn
from .options import Options
from .policy import (Action, RecoveryDecision, RecoveryRecord, SurvivorReport, World,
                     decide_grow)

# Reservations are read less often than nodes: maintenance is planned hours ahead.
RESERVATION_POLL_S = 60.0
COMMENT_MAX = 250  # Slurm keeps more, but the summary must fit a `squeue -O comment` column
# A comment refused with "try again in a bit" is tried again after a pause, at most so many
# times and for so long (slurmctld itself waits up to 5 s for a job's DB index before it says
# "try again", so a refused try takes that long).
COMMENT_TRIES = 10
COMMENT_RETRY_S = 60.0
COMMENT_PAUSE_S = 2.0
# How long an escalation waits for its record once the requeue is done, before the run ends:
# one scontrol update that Slurm answers at once. The requeue never waits for the record, and
# Slurm ends the job's processes within KillWait of the requeue anyway.
COMMENT_WAIT_S = 2.0
REASON_TAG = "hpct:"
MOVED = "planned move"  # a moved node's reason in its round's record


@dataclass
class Tally:
    """What the job went through so far, for its Slurm comment."""

    faults: int = 0
    moves: int = 0
    grows: int = 0
    replaced: list[str] = field(default_factory=list)  # "n3>n5": n5 took n3's place
    pause_s: float = 0.0
    lost_steps: int = 0


def summary(t: Tally, outcome: str = "") -> str:
    """The job's comment: one short line without '=' (scontrol prints Key=value records)."""
    parts = [f"hpct: {t.faults} fault(s)", f"{t.moves} move(s)"]
    if t.grows:
        parts.append(f"{t.grows} grow(s)")
    if t.replaced:
        parts.append("replaced " + " ".join(t.replaced))
    parts += [f"pause {t.pause_s:.2f}s", f"lost steps {t.lost_steps}"]
    if outcome:
        parts.append(outcome)
    # an outcome quotes errors: a tab, a newline or a bidi control in one is cleaned, so that
    # Slurm takes the line (set_job_comment refuses what does not print)
    text = printable_line(", ".join(parts).replace("=", ":"))
    return text if len(text) <= COMMENT_MAX else text[:COMMENT_MAX - 3] + "..."


def fold(earlier: RecoveryRecord, rec: RecoveryRecord) -> None:
    """`rec`, a round that began before every rank completed the first step of `earlier` (a
    fault cut `earlier` short), takes in `earlier`'s record: its lost nodes with their reasons,
    who took their places (`n3>n5` then `n5>n6`), the steps it lost, and its start (the job has
    not trained since). Its recovery.done and the job's comment then hold every fault."""
    rec.lost = earlier.lost + [n for n in rec.lost if n not in earlier.lost]
    rec.taken = {**earlier.taken, **rec.taken}
    rec.reasons = {**earlier.reasons, **rec.reasons}
    rec.newest_done = max(earlier.newest_done, rec.newest_done)
    rec.t_detect = min(earlier.t_detect, rec.t_detect)


def drained(nodes: Sequence[NodeInfo], members: Sequence[str]) -> list[tuple[str, str]]:
    """Active members an admin (or a health check) drained while they still run: (node,
    reason). A node that is also down or not responding is a fault, not a planned move."""
    return [(n.name, n.reason or "drained") for n in nodes
            if n.name in members and "DRAIN" in n.flags and not n.lost]


def in_maintenance(reservations: Sequence[ReservationInfo], members: Sequence[str],
                   job_end: str | None, now: str) -> list[tuple[str, str]]:
    """Active members in a maintenance reservation (MAINT flag) that starts before the job
    ends (an unknown end: any) and has not ended: (node, reason). Times are Slurm's ISO
    local times, which order as strings."""
    out: list[tuple[str, str]] = []
    for r in reservations:
        if not r.maintenance or (r.end and r.end <= now):
            continue
        if job_end and job_end not in ("Unknown", "NONE") and r.start >= job_end:
            continue
        out += [(n, f"maintenance reservation {r.name} from {r.start}") for n in r.nodes
                if n in members and n not in {m for m, _ in out}]
    return out


def moved_reason(admin_reason: str | None, spare: str, job_id: int) -> str:
    """The node's drain reason after the move: the admin's, with ours appended (once)."""
    ours = f"{REASON_TAG} job {job_id} moved its ranks to {spare}"
    base = (admin_reason or "drained").strip()
    return base if ours in base else f"{base}; {ours}"


class Host(Protocol):
    """What Lifecycle uses of the controller it belongs to (controller.Controller; this
    module does not import it): its state, and the round's steps that a planned round shares
    with a recovery (connections.py, detection.py, recovery_round.py, ending.py)."""

    o: Options
    slurm: SlurmClient
    events: CountingLog  # counts the faults as it writes them (fault_count.py)
    run_dir: Path
    world: World
    shards: dict[str, list[int]]
    data_world: int
    dead_nodes: set[str]
    steps: dict[str, Any]  # node -> its running step (pid)
    expected_exits: set[int]
    pending_faults: dict[str, str]
    fault_event: asyncio.Event
    finished: asyncio.Event
    recovering: bool
    recovery: RecoveryRecord | None
    trained: bool

    def _live(self, node: str) -> list[Conn]: ...

    def _node_ready(self, node: str) -> bool: ...

    async def _send(self, conn: Conn, msg: Any) -> None: ...

    def _fault(self, node: str, reason: str) -> None: ...

    async def _wait_ready(self, survivors: list[Conn]) -> None: ...

    async def _decide(self, lost_active: list[str], survivors: list[Conn],
                      lost_spares: list[str], leaving: tuple[str, ...] = ()
                      ) -> RecoveryDecision: ...

    def _persisted_steps(self) -> tuple[dict[int, set[int]], dict[int, set[int]]]: ...

    async def _assign(self, restore: int,
                      sources: dict[int, list[tuple[str, int]]]) -> None: ...

    async def _escalate(self, why: str, script: bool = False) -> None: ...

    async def _fence(self, node: str, reason: str) -> None: ...


class Lifecycle:
    def __init__(self, ctl: Host):
        self.ctl = ctl
        self.tally = Tally()
        self.requested: set[str] = set()   # nodes whose move is under way or done
        self.again: dict[str, str] = {}  # node -> why: a move cut short, asked again (_cut_short)
        self.skipped: set[str] = set()     # nodes whose move.skipped was said (once each)
        self.refused: set[str] = set()     # request entries refused that stay (said once)
        self.corrupt: set[str] = set()     # nodes drained for corruption (once each)
        self.drains: list[asyncio.Future] = []  # those drains, awaited at the run's end
        self.unreadable = ""  # why the requests dir cannot be listed, once said
        self.leaving: dict[str, list[Conn]] = {}  # moved node -> its ranks, until goodbye
        self.why: dict[str, str] = {}  # moved node -> why it was moved, for its release
        self.grow_refused = False
        self.task: asyncio.Task | None = None
        self.maintenance: list[tuple[str, str]] = []  # the last reservation poll's answer
        self.reservations_at = float("-inf")
        self.reservation_task: asyncio.Task | None = None
        self.comment_wanted = self.comment_written = ""
        self.comment_task: asyncio.Task | None = None

    # ---- triggers (the controller's Slurm poll) ---------------------------------------------
    def on_nodes(self, nodes: Sequence[NodeInfo]) -> None:
        # first, so that a move asked again keeps the reason it was first asked for
        for node, why in list(self.again.items()):
            if node not in self.ctl.world.members:
                del self.again[node]  # a fault took it out of the job meanwhile
            else:
                self.request_move(node, why)
        for node, reason in drained(nodes, self.ctl.world.members):
            self.request_move(node, reason)
        for node, reason in self.maintenance:
            self.request_move(node, reason)
        self._user_requests()
        self.maybe_grow()
        now = time.monotonic()
        if now - self.reservations_at >= RESERVATION_POLL_S and \
                (self.reservation_task is None or self.reservation_task.done()):
            self.reservations_at = now
            self.reservation_task = asyncio.create_task(self._poll_reservations())

    async def _poll_reservations(self) -> None:
        """Members in a maintenance reservation that starts before this job ends move off
        ahead of it (at the next poll that finds a spare ready)."""
        c = self.ctl
        try:
            resv = await asyncio.to_thread(c.slurm.reservations)
            if not any(r.maintenance for r in resv):
                self.maintenance = []
                return
            job = await asyncio.to_thread(c.slurm.show_job, c.o.job_id)
            now = time.strftime("%Y-%m-%dT%H:%M:%S")  # Slurm prints local time
            self.maintenance = in_maintenance(resv, c.world.members, job.end_time, now)
        except HpctError as exc:
            c.events.emit(Ev.SLURM_ERROR, error=describe(exc))

    def _user_requests(self) -> None:
        c = self.ctl
        try:
            requests = read_requests(c.run_dir)
        except HpctError as exc:
            if exc.message != self.unreadable:
                self.unreadable = exc.message
                c.events.emit(Ev.MOVE_REQUESTS_UNREADABLE, why=exc.message)
            return
        self.unreadable = ""
        for f, node, reason, refused in requests:
            if refused:
                if f.name not in self.refused:
                    c.events.emit(Ev.MOVE_REQUEST_REFUSED, file=f.name[:80], why=refused)
                try:
                    f.unlink(missing_ok=True)  # a link goes as the link it is
                except OSError:
                    self.refused.add(f.name)  # a directory stays: said once
                continue
            if not reason or node not in c.world.members:
                c.events.emit(Ev.MOVE_SKIPPED, node=node[:64], reason="user request",
                              why="not an active member of this job" if reason
                              else "malformed request")
                f.unlink(missing_ok=True)
                continue
            if CORRUPTION in reason and node not in self.corrupt:
                self._drain_soon(f, node, reason)
            if not self.request_move(node, f"user request: {reason}"):
                if node not in self.requested:
                    continue  # busy, or no spare yet: asked again at the next poll
            f.unlink(missing_ok=True)

    def _drain_soon(self, f: Path, node: str, why: str, at_end: bool = False) -> None:
        self.corrupt.add(node)
        self.drains.append(asyncio.ensure_future(self._drain_corrupt(f, node, why, at_end)))

    async def drain_corrupt_left(self) -> None:
        """At the run's end: a corruption request no poll read yet (the job's last comparison
        finds a flip moments before every rank is done) drains its node all the same, and
        the drains under way are waited for, before the node is free for the next job."""
        try:
            requests = read_requests(self.ctl.run_dir)
        except HpctError:
            requests = []  # an unreadable requests dir: the polls said so already
        for f, node, reason, refused in requests:
            if not refused and CORRUPTION in reason and node in self.ctl.world.members \
                    and node not in self.corrupt:
                self._drain_soon(f, node, reason, at_end=True)
        await asyncio.gather(*self.drains)

    async def _drain_corrupt(self, f: Path, node: str, why: str, at_end: bool) -> None:
        """A rank's replicas disagreed with it (recovery/crosscheck.py): its node is drained
        at once, spare or not, so that no other job starts on it and a move cut short leaves
        it drained. From then on the drain carries the move (a drained member moves once a
        spare is ready: on_nodes), so the request is done with."""
        c = self.ctl
        try:
            await asyncio.to_thread(c.slurm.update_node, node, "DRAIN",
                                    f"{REASON_TAG} {why[why.index(CORRUPTION):]}"[:200])
        except HpctError as exc:
            self.corrupt.discard(node)  # tried again at the next poll, the request kept
            c.events.emit(Ev.SLURM_ERROR, node=node, error=describe(exc))
            return
        if at_end:
            action = "drained at the run's end"
        elif node in self.requested or self._ready_spares():
            action = "drained; moving its ranks onto a warm spare"
        else:
            action = "drained; no warm spare ready: it trains on until one is"
        c.events.emit(Ev.NODE_CORRUPT, node=node, reason=why, action=action)
        f.unlink(missing_ok=True)

    def _busy(self) -> bool:
        c = self.ctl
        return (c.finished.is_set() or c.recovering or bool(c.pending_faults)
                or c.recovery is not None or (self.task is not None and not self.task.done())
                or c.world.generation == 0 and not c.trained)

    def _ready_spares(self) -> list[str]:
        return [s for s in self.ctl.world.spares if self.ctl._node_ready(s)]

    def request_move(self, node: str, why: str) -> bool:
        """Start moving `node`'s ranks to a warm spare, when one is ready and no other round
        runs (else the next poll asks again). True when the move started."""
        c = self.ctl
        if node in self.requested or node not in c.world.members or self._busy():
            return False
        if not self._ready_spares():
            if node not in self.skipped:
                self.skipped.add(node)
                c.events.emit(Ev.MOVE_SKIPPED, node=node, reason=why,
                              why="no warm spare ready: the node trains on until one is")
            return False
        self.requested.add(node)
        self.why[node] = why
        c.events.emit(Ev.MOVE_REQUESTED, node=node, reason=why,
                      generation=c.world.generation, again=self.again.pop(node, None) is not None)
        self._start(self._move(node, why))
        return True

    def maybe_grow(self) -> bool:
        c = self.ctl
        if self.grow_refused or c.world.world_size >= c.data_world or self._busy() \
                or not self._ready_spares():
            return False
        self._start(self._grow())
        return True

    # ---- rounds ------------------------------------------------------------------------------
    def _start(self, body: Coroutine[Any, Any, None]) -> None:
        # The round flag is taken here, synchronously: a fault arriving before the task first
        # runs must not start a recovery beside it.
        self.ctl.recovering = True
        self.task = asyncio.create_task(self._round(body))

    async def _round(self, body: Awaitable[None]) -> None:
        """A planned round holds the controller's round flag like a recovery: faults that come
        meanwhile wait and are handled right after it."""
        c = self.ctl
        try:
            await body
        except Exception as exc:
            # Stopped ranks wait for an assignment that would never come: rather than hang,
            # end the run the way a failed recovery does (requeue or fail, --on-no-spare).
            why = describe(exc) if isinstance(exc, HpctError) else f"{type(exc).__name__}: {exc}"
            c.events.emit(Ev.MOVE_FAILED, error=why)
            c.recovering = False
            await c._escalate(f"planned round failed: {why}")
        finally:
            c.recovering = False
            if c.pending_faults:
                c.fault_event.set()

    async def _stop_all(self, rec: RecoveryRecord, why: str) -> list[Conn] | None:
        """STOP every rank (nobody is lost: no addresses to cut) and wait for all to be ready.
        None when one is not: it is then a fault, and the fault loop takes over."""
        c = self.ctl
        everyone = [x for n in c.world.members for x in c._live(n)]
        for x in everyone:
            await c._send(x, P.Stop(c.world.generation, why, []))
        rec.t_stop = rec.t_fenced = time.time()
        await c._wait_ready(everyone)
        rec.t_ready = time.time()
        # after the stop: a rank in the middle of a step when it came completes it first
        rec.newest_done = max((x.done_step for x in everyone), default=-1)
        bad = [x for x in everyone if x.gone or x.state != RankState.READY]
        if bad:
            c.events.emit(Ev.MOVE_FAILED, error=f"{len(bad)} rank(s) not ready after the "
                                                f"planned stop: handled as a fault",
                          nodes=sorted({x.node for x in bad}))
            for x in bad:
                c._fault(x.node, f"not ready after a planned stop ({x.state})")
            return None
        return everyone

    async def _move(self, node: str, why: str) -> None:
        c = self.ctl
        rec = RecoveryRecord(t_detect=time.time(), kind="move")
        everyone = await self._stop_all(rec, f"planned move off {node}: {why}")
        if everyone is None:
            if node not in c.pending_faults:  # else its own fault's round replaces it
                self._cut_short(node, why, "a fault at its stop: the fault's round runs first")
            return
        d = await c._decide([node], everyone, [], leaving=(node,))
        if d.action != Action.REPLACE or not d.taken:
            # the spare went away meanwhile: everyone goes on where it stopped
            c.events.emit(Ev.MOVE_FAILED, node=node, error=d.reason)
            self._cut_short(node, why, "no spare to take its place")
            d = await c._decide([], everyone, [])
            rec.kind = "recovery"
            if d.escalates:
                raise HpctError(d.reason)
        leaving = [x for x in everyone if x.node == node] if d.taken else []
        if leaving:
            self.leaving[node] = leaving
        await self._carry(rec, d, everyone, first=leaving, event=Ev.MOVE_ASSIGN)

    def _cut_short(self, node: str, why: str, cause: str) -> None:
        """The move's round ended without it and the node is still in the job: whatever
        asked for it (a drain, a user, a slow or corrupt node) may never ask again (a user's
        request is read once, a drain Slurm refused is not seen), so the move is asked
        again here until it starts."""
        self.requested.discard(node)
        self.again[node] = why
        self.ctl.events.emit(Ev.MOVE_CUT_SHORT, node=node, reason=why, cause=cause,
                             why="asked again at the next poll that finds a spare ready")

    async def _grow(self) -> None:
        c = self.ctl
        rec = RecoveryRecord(t_detect=time.time(), kind="grow")
        everyone = await self._stop_all(rec, "growing back to the full world")
        if everyone is None:
            return
        reports = [SurvivorReport(x.node, x.local_rank, x.held, x.held_rank, x.mode,
                                  x.rank_state, tuple(x.shard_keys), x.error, not x.gone)
                   for x in everyone if x.held is not None]
        disk_shared, disk_rank = await asyncio.to_thread(c._persisted_steps)
        d = decide_grow(c.world, c.shards, self._ready_spares(), reports,
                        disk_shared=disk_shared, disk_rank=disk_rank)
        if d is None:
            self.grow_refused = True  # per-rank or sharded state: stay shrunk
            c.events.emit(Ev.MOVE_FAILED, error="cannot grow back (per-rank or sharded state, "
                                                "or no common step): the job stays shrunk")
            d = await c._decide([], everyone, [])
            rec.kind = "recovery"
            if d.escalates:
                raise HpctError(d.reason)
        await self._carry(rec, d, everyone, first=[], event=Ev.GROW_ASSIGN)

    async def _carry(self, rec: RecoveryRecord, d: RecoveryDecision, everyone: list[Conn],
                     first: list[Conn], event: Ev) -> None:
        """The new generation, as a recovery round carries out a decision: layout, sources (the
        leaving ranks first: they hold the newest state and are about to go), assignment."""
        c = self.ctl
        assert d.replacement is not None and d.plan is not None
        rep, plan = d.replacement, d.plan
        c.shards = d.shards
        c.world.members, c.world.spares = rep.members, d.spares
        c.world.generation = rep.generation
        staying = [x for x in everyone if x not in first]
        sources = {x.rank: [(x.host_addr, x.transfer_port)] for x in first}
        sources.update({c.world.rank_of(x.node, x.local_rank): [(x.host_addr, x.transfer_port)]
                        for x in staying})
        rec.generation, rec.restore_step = rep.generation, plan.step
        rec.lost, rec.taken = d.lost, rep.taken
        rec.reasons = {n: MOVED for n in d.lost}
        rec.t_assigned = time.time()
        c.recovery = rec
        c.events.emit(event, generation=rep.generation, restore_step=plan.step,
                      newest_done=rec.newest_done, taken=rep.taken, members=rep.members,
                      shards=c.shards, sources={str(r): s for r, s in sorted(plan.sources.items())})
        await c._assign(plan.step, sources)

    # ---- the end of a round ------------------------------------------------------------------
    def round_done(self, rec: RecoveryRecord, now: float) -> None:
        """Every rank completed the round's first step: its event, the leaving ranks' goodbye
        (a move), the tally and the job's Slurm comment."""
        c = self.ctl
        fields = rec.done_fields(now)
        if rec.kind == "move":
            c.events.emit(Ev.MOVE_DONE, **fields)
        else:
            c.events.emit(Ev.GROW_DONE if rec.kind == "grow" else Ev.RECOVERY_DONE, **fields)
        # Every leaving rank goes now, a move's own and one whose round a fault cut short and
        # folded into this one (which sources nothing from it): it sat idle until the job
        # ended before (issue 45).
        for node in list(self.leaving):
            asyncio.ensure_future(self._release(node, rec.taken.get(node, "")))
        self.count(rec, fields)
        self.record()

    def count(self, rec: RecoveryRecord, fields: dict) -> None:
        """A round in the tally: a done one (`fields`: its done_fields), or one the run ended
        before it was (an escalation)."""
        t = self.tally
        if rec.kind == "move":
            t.moves += 1
        elif rec.kind == "grow":
            t.grows += 1
        else:
            # a move cut short by this round's fault is in its record too (fold); its faults
            # are counted as they are written (record)
            t.moves += sum(1 for n in rec.lost if rec.reasons.get(n) == MOVED)
        t.replaced += [f"{a}>{b}" for a, b in rec.taken.items()]
        t.pause_s += fields["recovery_s"]
        t.lost_steps += fields["lost_steps"]

    def leaving_lost(self, node: str, reason: str) -> None:
        """A leaving node's ranks were lost before their goodbye (the node crashed right
        after the move's assignment): its successor already has its place, so there is no
        round; it is fenced like a lost node (DOWN when its slurmd is gone, so that its srun
        ends instead of holding the job's end for the step grace) and released."""
        if self.leaving.pop(node, None) is None:
            return
        c = self.ctl
        c.dead_nodes.add(node)  # never a spare again, whatever the fence finds
        c.events.emit(Ev.MOVE_LEAVING_LOST, node=node, reason=reason)
        spare = c.recovery.taken.get(node, "") if c.recovery is not None else ""

        async def fence_then_release() -> None:
            await c._fence(node, f"left in a planned move, then {reason}")
            await self._release(node, spare)
        asyncio.ensure_future(fence_then_release())

    async def _release(self, node: str, spare: str) -> None:
        """The moved node's ranks leave (their state is no longer needed); the node stays
        drained for the admin, with what we did appended to the reason."""
        c = self.ctl
        c.dead_nodes.add(node)  # never a spare or member again in this job
        if node in c.steps:
            c.expected_exits.add(c.steps[node].pid)
        for x in self.leaving.pop(node, []):
            await c._send(x, P.Goodbye(f"moved to {spare}"))
        try:
            info = await asyncio.to_thread(c.slurm.show_node, node)
            why = self.why.pop(node, "")
            if CORRUPTION in why and "DRAIN" not in info.flags:
                # its replicas disagreed with it (recovery/crosscheck.py): the site must see
                # the node before anyone runs on it again
                await asyncio.to_thread(c.slurm.update_node, node, "DRAIN",
                                        f"{REASON_TAG} {why[why.index(CORRUPTION):]}"[:200]
                                        + f"; job {c.o.job_id} moved its ranks to {spare}")
            elif "DRAIN" in info.flags:
                await asyncio.to_thread(c.slurm.update_node, node, "DRAIN",
                                        moved_reason(info.reason, spare, c.o.job_id))
        except HpctError as exc:
            c.events.emit(Ev.SLURM_ERROR, node=node, error=describe(exc))

    async def after_down(self, node: str, reason: str) -> None:
        """The admin's policy for a node we fenced DOWN (HPCT_ON_FENCED): leave it, or have
        Slurm reboot it once idle and bring it back RESUMEd, where the Prolog's health check
        guards its next job (a failed check drains it again) and `spares check --to-pool`
        re-admits it to the spare pool."""
        c = self.ctl
        try:
            policy = C.read(os.environ, C.ON_FENCED)
        except HpctError as exc:
            c.events.emit(Ev.SLURM_ERROR, node=node, error=describe(exc))
            return
        if policy != "reboot":
            return
        why = f"hpct: reboot after fence in job {c.o.job_id}: {reason}"[:200]
        try:
            await asyncio.to_thread(c.slurm.reboot_nodes, node, why, "RESUME")
        except HpctError as exc:
            c.events.emit(Ev.SLURM_ERROR, node=node, error=describe(exc))
            return
        c.events.emit(Ev.NODE_REBOOT, node=node, reason=why, next_state="RESUME")

    def record(self, outcome: str = "") -> None:
        """Write the summary into the job's Slurm Comment, in the background (best effort: a
        refused update is an event, never a failure of the job, and nothing waits for it but
        an escalation's end: `settle`). One writer at a time, always the newest text."""
        # one fault per fault: the rule `status` applies to the same records (fault_count.py)
        self.tally.faults = self.ctl.events.faults.count
        self.comment_wanted = summary(self.tally, outcome)
        if self.comment_task is None or self.comment_task.done():
            self.comment_task = asyncio.create_task(self._write_comment())

    async def settle(self, wait_s: float = COMMENT_WAIT_S) -> None:
        """Wait at most `wait_s` for the comment being written (the run is about to end)."""
        if self.comment_task is not None:
            await asyncio.wait([self.comment_task], timeout=wait_s)

    async def _write_comment(self) -> None:
        c = self.ctl
        deadline = time.monotonic() + COMMENT_RETRY_S
        tries = 0
        while self.comment_wanted != self.comment_written:
            text = self.comment_wanted
            tries += 1
            try:
                await asyncio.to_thread(c.slurm.set_job_comment, c.o.job_id, text)
            except HpctError as exc:
                # slurmctld refuses job updates until the job has its DB index ("try again
                # in a bit"); anything else will not get better by asking again
                again = (isinstance(exc, SlurmCommandError) and refused_for_now(exc)
                         and tries < COMMENT_TRIES
                         and time.monotonic() + COMMENT_PAUSE_S < deadline)
                c.events.emit(Ev.SLURM_ERROR, error=describe(exc), comment_try=tries,
                              again_in_s=COMMENT_PAUSE_S if again else None)
                if not again:
                    return
                await asyncio.sleep(COMMENT_PAUSE_S)
                continue
            self.comment_written = text
            c.events.emit(Ev.SLURM_COMMENT, comment=text)
