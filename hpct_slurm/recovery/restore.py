"""Where a rank's state comes from after a fault: what it tells the controller it holds
(`holdings`), and at the next adoption the restore of the step the controller chose, from the
first source that has it: its own snapshot, a striped pull from its peers started while the
group forms, its ring replica (replicated mode), each survivor of its shard key in turn, disk.

`Job` (job.py) reports `holdings` when it is ready after a fault, starts `prefetch` before the
group forms and calls `restore` once it formed."""
from __future__ import annotations

import contextlib
from pathlib import Path
from typing import TYPE_CHECKING, Callable

from .. import protocol as P
from ..errors import HpctError
from ..events import Ev, EventLog
from .ring import replica_peer_rank
from .state import TrainState
from .striped import Prefetch
from .transfer import FetchResult, fetch_state

if TYPE_CHECKING:
    from .generation import Generation
    from .snapshot_policy import SnapshotPolicy
    from .standing import Standing


class Restorer:
    """The restore path of one rank. `policy` holds its snapshots and the recovery mode,
    `group` the shard keys (ranks of one key hold the same shared state); `fetch` and
    `prefetch` pull a state from other processes or disk (transfer.fetch_state,
    striped.Prefetch: the real ones unless a test passes fakes)."""

    def __init__(self, state: TrainState, policy: SnapshotPolicy, group: Generation,
                 standing: Standing, *, secret: bytes, job_id: str, events: EventLog,
                 run_dir: Path, timeout: float,
                 fetch: Callable[..., FetchResult] = fetch_state,
                 prefetch: Callable[..., Prefetch] = Prefetch):
        self.state, self.policy, self.group, self.standing = state, policy, group, standing
        self.secret, self.job_id, self.events = secret, job_id, events
        self.run_dir, self.timeout = run_dir, timeout
        self._fetch, self._prefetch = fetch, prefetch

    def holdings(self, error: str) -> P.Holdings:
        """What this process can restore from, for the controller's choice of restore step.
        Its snapshots always belong to the position it holds (a newcomer has none until its
        restore succeeded), so every step listed here is one it can really serve."""
        snaps, rank_snaps, replicas = (self.policy.snapshots, self.policy.rank_snaps,
                                       self.policy.replicas)
        rank_steps = rank_snaps.slots.steps() if rank_snaps is not None else []
        return P.Holdings(self.standing.rank, self.standing.generation, self.policy.mode,
                          rank_snaps is not None, snaps.slots.steps(), rank_steps,
                          {r: replicas.steps(r) for r in replicas.ranks()}, error,
                          self.group.shard_keys())

    @staticmethod
    def leaving(a: P.Assign) -> list[tuple[str, int]]:
        """The live process that held this rank's position before a planned move (the
        controller lists it as the source of that rank; a fault's sources are survivors
        only, none of them at a newcomer's position)."""
        return [(str(h), int(p)) for r, addrs in a.sources.items() if int(r) == a.rank
                for h, p in addrs[:1]]

    @staticmethod
    def holder(a: P.Assign) -> list[tuple[str, int]]:
        """Where this rank's ring replica lives: the neighbour in the (unchanged) ring."""
        if len(a.member_nodes()) < 2:
            return []
        peer = replica_peer_rank(a.rank, len(a.member_nodes()), a.tasks_per_node)
        return [(str(h), int(p)) for r, (h, p) in a.peers.items() if int(r) == peer]

    def prefetch(self, a: P.Assign, survivor: bool) -> Prefetch | None:
        """The striped pull of the shared state this process restores from its peers (a
        newcomer, or a survivor that does not hold the restore step: one that faulted a step
        behind the others), started now: it needs no process group. None where it restores
        otherwise (own copy, ring replica, creation) or no other source shares its key."""
        if a.restore_step < 0 or self.policy.mode != "jit" or \
                (survivor and a.restore_step in self.policy.snapshots.slots.steps()):
            return None
        key = self.group.key(a.rank)
        sources = [(int(r), (str(h), int(p))) for r, addrs in sorted(a.sources.items())
                   if int(r) != a.rank and self.group.key(int(r)) == key for h, p in addrs[:1]]
        if not sources:
            return None
        return self._prefetch(sources, a.rank, self.secret, self.job_id, a.restore_step,
                              events=self.events, timeout=self.timeout)

    def restore(self, a: P.Assign, survivor: bool, prefetch: Prefetch | None = None) -> str:
        """Restore step `a.restore_step`; where it came from (the adoption's `source`)."""
        step, snapshots = a.restore_step, self.policy.snapshots
        striped = prefetch.result() if prefetch is not None else None
        if striped is not None:
            self.state.restore_from(striped.layout, striped.data, scopes=("shared",))
            self.restore_rank_state(a, own=survivor)
            # The pulled bytes, checked on arrival, are the step this process now holds: its
            # snapshot as they are (SnapshotPolicy.hold_restored then copies nothing).
            snapshots.adopt(step, striped.layout, striped.data, striped.leaves)
            return striped.source
        if step == -1 and not survivor:
            # Never trained: this process stands at the state at creation (its script built
            # the same model from the same seed; nothing moved its per-rank state yet).
            return "creation"
        if survivor:
            with snapshots.lease(step) as snap:
                if snap is not None and snap.verify():
                    self.state.restore_from(snap.layout, snap.data)
                    self.restore_rank_state(a, own=True)
                    return "own"
        if self.policy.mode == "replicated":
            # exactly this rank's state, from the ring neighbour that holds its replica
            try:
                got = self._fetch(self.leaving(a) + self.holder(a), a.rank, self.secret,
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
        key = self.group.key(a.rank)
        for src_rank, addrs in a.sources.items():
            if self.group.key(int(src_rank)) != key:
                continue
            try:
                got = self._fetch(addrs, int(src_rank), self.secret, self.job_id,
                                  step=step, events=self.events)
            except HpctError:
                continue
            self.state.restore_from(got.layout, got.data, scopes=("shared",))
            self.restore_rank_state(a, own=survivor)
            return got.source
        got = self._fetch([], key, self.secret, self.job_id, step=step,
                          disk_dir=str(self.run_dir / "persist"), events=self.events)
        if got.step != step:
            raise HpctError(f"disk holds step {got.step}, the group restores step "
                            f"{step}: the job must restart from disk")
        self.state.restore_from(got.layout, got.data, scopes=("shared",))
        self.restore_rank_state(a, own=survivor, disk=True)
        return got.source

    def restore_rank_state(self, a: P.Assign, own: bool, disk: bool = False) -> None:
        """This rank's own small state at the restore step: from its own memory, else from the
        ring neighbour, else from disk. Nothing to do when none is registered."""
        rank_snaps = self.policy.rank_snaps
        if rank_snaps is None:
            return
        step = a.restore_step
        if own:
            with rank_snaps.lease(step) as snap:
                if snap is not None and snap.verify():
                    self.state.restore_from(snap.layout, snap.data, scopes=("rank",))
                    return
        got = None
        if not disk and (leaving := self.leaving(a)):
            # a planned move: the process leaving this position serves its own state first
            # (the ring holder may lack its last step: policy.plan_restore's `leaving`)
            with contextlib.suppress(HpctError):
                got = self._fetch(leaving, a.rank, self.secret, self.job_id, step=step,
                                  events=self.events, slot="rank")
        if got is None:
            got = self._fetch([] if disk else self.holder(a), a.rank, self.secret,
                              self.job_id, step=step,
                              disk_dir=str(self.run_dir / "persist-rank"), events=self.events)
        if got.step != step:
            raise HpctError(f"rank {a.rank}'s own state (sampler, extras) exists at step "
                            f"{got.step} at best, the group restores step {step}")
        self.state.restore_from(got.layout, got.data, scopes=("rank",))
