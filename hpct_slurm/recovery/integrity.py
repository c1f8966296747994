"""Never silently wrong, on one rank: what `Job` checks about the state it trains with.

- The proof of a restore (proof.py): at the first step boundary after it, every registered
  object holds exactly what was restored into it, or the rank does not train on.
- Late registrations: state the script registered after the restored step was held makes
  that step be held again (the held copy lacked it); per-rank state registered after
  `Job(...)` is refused, since this rank's own snapshots exist only where `Job` knew of some.
- The replicas' cross-check (crosscheck.py) at every full commit and at the job's last step,
  and its way out: a rollback to the last agreeing step, a blamed rank's request to move its
  node out, or, where a rollback did not cure it, the check turned off.

`Job` calls `restored` at every adoption, `before_step` at the earliest moment of every step,
`after_step` at its end; `SnapshotPolicy` calls `cross_check` at a full commit and at the
job's last step."""
from __future__ import annotations

import time
from pathlib import Path
from typing import TYPE_CHECKING, Callable

import torch.distributed as dist

from ..errors import HpctError, UsageError, describe
from ..events import Ev, EventLog
from ..move_requests import CORRUPTION, ask_move
from .crosscheck import Action, History, compare, exchange, judge, shared_digest
from .inject import flip_one_bit
from .proof import DIGEST_BYTES
from .state import TrainState

if TYPE_CHECKING:
    from .snapshot_policy import SnapshotPolicy
    from .standing import Standing


class Integrity:
    """One rank's checks (see the module docstring). `key(rank)`: a rank's shard key;
    `flip`: the test fault injection's (rank, step), HPCT_FAULT_FLIP_RANK/STEP."""

    def __init__(self, state: TrainState, policy: SnapshotPolicy, standing: Standing,
                 events: EventLog, key: Callable[[int], int], run_dir: Path, node: str,
                 flip: tuple[int | None, int | None] = (None, None)):
        self.state, self.policy, self.standing, self.events = state, policy, standing, events
        self.key, self.run_dir, self.node, self.flip = key, run_dir, node, flip
        self.proof_due = False  # a restore happened and the first step after it is to come
        self.agreed_at = -1  # the newest step the replicas agreed on (or restored to)
        self.history = History()  # what the group's comparisons said so far
        self._names_seen = -1  # the registrations last checked
        # The restored step held, until the next step ends, and the registrations then
        self._held_at: int | None = None
        self._held_names = -1
        policy.cross_check = self.cross_check

    def restored(self, step: int, proof_due: bool) -> None:
        """An adoption stands this rank at `step` (restored, if `proof_due`), held."""
        self.proof_due = proof_due
        self._held_at, self._held_names = step, self.state.version
        self.agreed_at = step  # restored, and proven before the next step

    def before_step(self) -> None:
        """The earliest moment of a step: the proof first, then the registrations."""
        if self.proof_due:
            self.prove()
        if self._held_at is not None and self.state.version != self._held_names:
            # registered since the restored step was held, which lacks them (the inline
            # form's job.state.register after Job(...)): held again, now that the proof
            # above says the live state is the restored one
            self.policy.hold_again(self._held_at)
            self._held_names = self.state.version
        if self.state.version != self._names_seen:
            self._names_seen = self.state.version
            if self.policy.rank_snaps is None and self.state.has_rank_state():
                late = [n for n in self.state.names() if self.state.scope(n) == "rank"]
                raise UsageError(
                    f"per-rank state {late or ['state.extras']} was registered after "
                    f"Job(...): this rank's own state is kept only when Job(...) knows of it. "
                    f"Pass it to Job(...) (or job.register) as a keyword argument; an object "
                    f"every rank holds alike (an EMA, a second model) goes in with "
                    f"scope='shared'")

    def after_step(self, step: int) -> None:
        self._held_at = None
        if self.flip == (self.standing.rank, step) and self.standing.generation == 0:
            flip_one_bit(self.state, self.events, self.standing.rank, step)

    def prove(self) -> None:
        """Every object this rank trains with holds the state it restored (proof.py), or
        the rank does not train on: the mismatch is named, and the step fails as a fault,
        so the group restores again."""
        self.proof_due = False
        t0 = time.perf_counter()
        problems = self.state.prove()
        took = time.perf_counter() - t0
        rank, generation = self.standing.rank, self.standing.generation
        if problems:
            self.events.emit(Ev.RESTORE_UNPROVEN, rank=rank, generation=generation,
                             step=self.agreed_at, problems=problems, proof_s=took)
            raise HpctError("the state this rank would train with is not the state it "
                            "restored: " + "; ".join(problems))
        self.events.emit(Ev.RESTORE_PROVEN, rank=rank, generation=generation,
                         step=self.agreed_at, names=self.state.names(), proof_s=took)

    def cross_check(self, step: int) -> None:
        """At a full commit: the replicas of each shared state compare digests (and what the
        group's comparisons said before: crosscheck.History). Where they disagree, every rank
        drops what it holds after the last agreeing step and the step fails in place, so the
        group restores that step; a blamed rank first asks the controller to move its node
        out. A disagreement that a rollback did not cure turns the check off instead."""
        # Once the check is off its digest is not worth making, but the exchange still runs:
        # a rank that joined later learns from it that the check is off, and every rank
        # calls the same collective.
        digest = bytes(DIGEST_BYTES) if self.history.off else shared_digest(self.state)
        got = exchange(digest + self.history.encode(), dist.get_world_size())
        history = History.merge([History.decode(g[-History.SIZE:]) for g in got])
        verdict = compare([g[:-History.SIZE] for g in got], self.key)
        j = judge(verdict, history)
        self.history = j.history
        if j.action == Action.IGNORED:
            return
        if j.action == Action.AGREED:
            self.agreed_at = step
            return
        rank, back_to = self.standing.rank, self.agreed_at
        diverging = rank in verdict.diverged
        if diverging or rank == 0:
            self.events.emit(Ev.REPLICA_DIVERGED, rank=rank, step=step,
                             diverged=list(verdict.diverged), undecided=list(verdict.undecided),
                             keys_compared=verdict.keys_compared, rollback_to=back_to,
                             this_rank=diverging, blamed=list(j.blamed), action=j.action)
        if rank in j.blamed:
            self._ask_move(step)
        if j.action == Action.OFF:
            if rank == 0:
                self.events.emit(Ev.REPLICA_CHECK_OFF, rank=rank, step=step, why=j.why,
                                 diverged=list(verdict.diverged),
                                 undecided=list(verdict.undecided))
            return
        self.policy.distrust_after(back_to)
        what = (f"ranks {list(verdict.diverged)} diverged" if verdict.diverged else
                f"the replicas of shard keys {list(verdict.undecided)} differ, no majority")
        raise HpctError(f"the replicas' cross-check at step {step}: {what}; the group rolls "
                        f"back to step {back_to}")

    def _ask_move(self, step: int) -> None:
        rank = self.standing.rank
        why = f"{CORRUPTION}: rank {rank}'s shared state at step {step} differed from " \
              f"its replicas'"
        try:
            ask_move(self.run_dir, self.node, why)
        except (HpctError, OSError) as exc:  # said, not fatal: the group goes on as judged
            self.events.emit(Ev.REPLICA_DIVERGED, rank=rank, step=step,
                             move_request_failed=describe(exc))
