"""The cluster-level pool of hot-spare nodes, kept in Slurm itself.

How the pool lives in Slurm
---------------------------
The pool *is* the Slurm reservation `hpct_spares` (`scontrol show reservation hpct_spares`):
its node list is the membership. A reservation is what Slurm offers to keep nodes free for
someone: jobs that do not ask for `--reservation=hpct_spares` never land on those nodes, while
a job that does ask (the controller's companion spare job, or an admin's probe) starts on them
at once. It is kept in slurmctld's state, so it survives `scontrol reconfigure` and a
slurmctld restart.

Every member also carries the node feature `hpct_spare` (AvailableFeatures/ActiveFeatures), so
`sinfo -o "%N %f"` and `scontrol show node` show the pool at a glance and a job can add
`--constraint=hpct_spare`. The feature is only a label derived from the reservation: Slurm
22.05 resets scontrol-set features to slurm.conf's on `scontrol reconfigure` (measured), so
the feature alone would silently empty the pool. Every changing `spares` command puts the
labels back in line with the reservation; `spares list` shows where they drifted.

Every action writes a one-line record into the node's `Comment` (shown by
`scontrol show node`), e.g. `hpct: spare pool add by root at 2026-01-01T00:00:00Z`; Slurm
shows `Reason` only on drained or down nodes, where ours always starts with `hpct:`.

Health check of a drained node: slurmctld must still hear its slurmd (state not DOWN, no
NOT_RESPONDING flag), then the node is fenced into a reservation of its own (`hpct_check`),
resumed, and must run `srun -N1 -w NODE true` inside that reservation. Fencing first means no
user job can land on a node we have not yet proven healthy; a failed probe drains it again
with the reason `hpct: health check failed ...`.
"""
from __future__ import annotations

import os
import pwd
from dataclasses import asdict, dataclass
from datetime import datetime, timezone
from typing import Callable, Iterable, Sequence

from ..errors import HpctError
from ..slurm.client import JobInfo, NodeInfo, SlurmClient, SlurmCommandError
from ..slurm.hostlist import compress

POOL_RESERVATION = "hpct_spares"
CHECK_RESERVATION = "hpct_check"
FEATURE = "hpct_spare"
REASON_PREFIX = "hpct:"
# A healthy node runs `true` in well under a second; the slack covers a busy slurmctld.
PROBE_TIMEOUT_S = 60.0
PROBE_IMMEDIATE_S = 10


@dataclass(frozen=True)
class PoolNode:
    """One pool member as `spares list` shows it."""

    name: str
    state: str
    flags: list[str]
    reason: str | None
    comment: str | None
    labelled: bool  # carries the hpct_spare feature


@dataclass(frozen=True)
class Outcome:
    """What one command did to one node. `changed` is False for an idempotent no-op."""

    node: str
    action: str
    changed: bool
    detail: str = ""


# ---- pure decisions ----------------------------------------------------------------------

def record(action: str, by: str, at: datetime, detail: str = "") -> str:
    """The line Slurm keeps (Comment or Reason): `hpct: <action> by <user> at <UTC time>`."""
    text = f"{REASON_PREFIX} {action} by {by} at {at.strftime('%Y-%m-%dT%H:%M:%SZ')}"
    text = f"{text}: {detail}" if detail else text
    # scontrol takes the value as one argv word; a newline would end Slurm's record early.
    return " ".join(text.split())


def with_feature(features: Sequence[str], present: bool) -> tuple[str, ...]:
    """The node's features with the pool label added or taken away, the others kept."""
    kept = tuple(f for f in features if f != FEATURE)
    return (*kept, FEATURE) if present else kept


def blocking_jobs(node: str, jobs: Iterable[JobInfo]) -> list[JobInfo]:
    """Unfinished jobs placed on `node`: taking it into the pool would take it from them."""
    return [j for j in jobs if not j.finished and node in j.nodelist]


def refusal(node: str, jobs: Sequence[JobInfo]) -> str:
    running = ", ".join(f"{j.job_id} ({j.user or '?'})" for j in jobs)
    return (f"node {node!r} runs job(s) {running}: refusing to pull it into the spare pool; "
            f"wait for them to end, or drain it first "
            f"(scontrol update NodeName={node} State=DRAIN Reason=...)")


def drained_by_hpct(node: NodeInfo) -> bool:
    """Drained or down with a reason hpct-slurm wrote: what `spares check` looks at."""
    taken_out = "DRAIN" in node.flags or node.state == "DOWN" or "FAIL" in node.flags
    return taken_out and (node.reason or "").startswith(REASON_PREFIX)


# A node drained for slowness (controller/failslow.py): `spares check`'s probe (it runs `true`)
# says nothing about speed, so the sweep leaves it to the admin, who returns it by hand
# (`spares return NODE`) once it is fast again, or whose own health check resumes it.
FAIL_SLOW = "fail-slow:"


def slow_drained(node: NodeInfo) -> bool:
    return "DRAIN" in node.flags and FAIL_SLOW in (node.reason or "")


def passive_health(node: NodeInfo) -> str | None:
    """Why slurmctld's own view rules the node out, or None if it may be probed."""
    if node.lost:
        return (f"slurmd not responding (state {node.state}"
                f"{'+' + '+'.join(sorted(node.flags)) if node.flags else ''})")
    return None


# Where a node stands in the lifecycle drain -> move -> (fence) -> reboot -> health -> spare,
# as `spares loop` shows it, with the command that moves it on.
REBOOT_FLAGS = frozenset({"REBOOT_REQUESTED", "REBOOT_ISSUED", "REBOOT"})


def loop_stage(node: NodeInfo, in_pool: bool) -> tuple[str, str]:
    """(stage, next step) of one node: pure, from Slurm's own view of it."""
    reason = node.reason or ""
    ours = reason.startswith(REASON_PREFIX) or f"{REASON_PREFIX} job" in reason
    if node.flags & REBOOT_FLAGS or node.state == "REBOOT":
        return "rebooting", "wait: Slurm resumes it after the reboot; then `spares check`"
    if node.lost:
        return ("fenced: down" if ours else "down"), \
            "`scontrol reboot ASAP nextstate=RESUME reason=\"hpct: ...\" NODE` or repair it"
    if slow_drained(node):
        stage = "fail-slow: drained"
        if node.state in ("ALLOCATED", "MIXED"):
            return stage + " (jobs still running)", "wait for its jobs to end"
        return stage, ("find why it is slow; then `hpct-slurm spares return NODE` (`spares "
                       "check` leaves it drained)")
    if "DRAIN" in node.flags:
        if "moved its ranks to" in reason:
            stage = "moved off: drained"
        elif "health" in reason:
            stage = "health check failed: drained"
        else:
            stage = "drained"
        if node.state in ("ALLOCATED", "MIXED"):
            return stage + " (jobs still running)", "wait for its jobs to end"
        return stage, "`hpct-slurm spares return NODE --to-pool` (health check, then spare)"
    if node.state == "DOWN":
        return "down", "`hpct-slurm spares return NODE`"
    if in_pool:
        return "pool spare", "none: a job's controller may borrow it"
    return "in service", "none"


def pool_nodes(nodes: Sequence[NodeInfo], members: Sequence[str],
               comments: dict[str, str | None]) -> list[PoolNode]:
    by_name = {n.name: n for n in nodes}
    return [PoolNode(name=m, state=by_name[m].summary if m in by_name else "UNKNOWN",
                     flags=sorted(by_name[m].flags) if m in by_name else [],
                     reason=by_name[m].reason if m in by_name else None,
                     comment=comments.get(m),
                     labelled=m in by_name and FEATURE in by_name[m].features)
            for m in members]


def invoking_user() -> str:
    return pwd.getpwuid(os.geteuid()).pw_name


def utc_now() -> datetime:
    return datetime.now(timezone.utc)


# ---- the pool, through scontrol ----------------------------------------------------------

class SparePool:
    """Add, remove, list and health-check spare nodes. `users` may use the pool reservation
    (the job owners whose controllers draw spares from it); it is set when the reservation is
    created."""

    def __init__(self, client: SlurmClient, users: str = "root",
                 by: Callable[[], str] = invoking_user, clock: Callable[[], datetime] = utc_now):
        self.client = client
        self.users = users
        self._by = by
        self._clock = clock

    # -- reading --
    def snapshot(self) -> tuple[list[NodeInfo], dict[str, str | None]]:
        """Every node and its Comment, from one `sinfo --json`."""
        nodes = self.client.nodes()
        return nodes, {n.name: n.comment for n in nodes}

    def members(self) -> list[str]:
        return self.client.reservation_nodes(POOL_RESERVATION) or []

    def list(self) -> list[PoolNode]:
        nodes, comments = self.snapshot()
        return pool_nodes(nodes, self.members(), comments)

    # -- changing --
    def add(self, names: Sequence[str]) -> list[Outcome]:
        nodes, _ = self.snapshot()
        infos = self._known(nodes, names)
        members = self.members()
        new = [n for n in names if n not in members]
        jobs = self.client.jobs()
        for n in new:  # refuse all or nothing, before touching anything
            busy = blocking_jobs(n, jobs)
            if busy:
                raise HpctError(refusal(n, busy))
        if new:
            self._set_reservation(POOL_RESERVATION, members + new)
            # A job may have started between our look and the fence: look again.
            late = [(n, blocking_jobs(n, self.client.jobs())) for n in new]
            late = [(n, b) for n, b in late if b]
            if late:
                self._set_reservation(POOL_RESERVATION, members)
                raise HpctError(refusal(*late[0]))
        out = []
        for n in names:
            if n in new:
                self._label(infos[n], True, record("spare pool add", self._by(), self._clock()))
                out.append(Outcome(n, "added", True))
            else:
                out.append(Outcome(n, "already in pool", False))
        self._sync_labels(nodes, members + new, skip=new)
        return out

    def remove(self, names: Sequence[str]) -> list[Outcome]:
        nodes, _ = self.snapshot()
        infos = self._known(nodes, names)
        members = self.members()
        gone = [n for n in names if n in members]
        if gone:
            self._set_reservation(POOL_RESERVATION, [m for m in members if m not in gone])
        out = []
        for n in names:
            if n in gone:
                self._label(infos[n], False,
                            record("spare pool remove", self._by(), self._clock()))
                out.append(Outcome(n, "removed", True))
            else:
                out.append(Outcome(n, "not in pool", False))
        self._sync_labels(nodes, [m for m in members if m not in gone], skip=gone)
        return out

    def check(self, to_pool: bool = False) -> list[Outcome]:
        """Probe every node drained by hpct-slurm; return the healthy ones to service (pool
        members, and all of them with `to_pool`, to the pool)."""
        nodes, _ = self.snapshot()
        self._sync_labels(nodes, self.members())
        return [Outcome(n.name, "left drained", False, f"{n.reason}: a node drained for "
                        f"slowness returns by hand (`spares return {n.name}`)")
                if slow_drained(n) else self._check_one(n, to_pool)
                for n in nodes if drained_by_hpct(n)]

    def return_node(self, name: str, to_pool: bool = False) -> Outcome:
        """Probe one drained or down node, whatever wrote its reason, and return it."""
        nodes, _ = self.snapshot()
        node = self._known(nodes, [name])[name]
        if "DRAIN" not in node.flags and node.state != "DOWN" and "FAIL" not in node.flags:
            return Outcome(name, "in service", False, f"state {node.summary}: nothing to return")
        return self._check_one(node, to_pool)

    # -- internals --
    def _check_one(self, node: NodeInfo, to_pool: bool) -> Outcome:
        name, by, now = node.name, self._by(), self._clock()
        why = passive_health(node)
        if node.state in ("ALLOCATED", "MIXED"):
            return Outcome(name, "still draining", False, "jobs still run on it")
        if why is None:
            why = self._probe(node)
        members = self.members()
        if why is not None:
            self.client.update_node(name, "DRAIN",
                                    reason=record("health check failed", by, now, why))
            return Outcome(name, "unhealthy", True, why)
        if to_pool and name not in members:
            self._set_reservation(POOL_RESERVATION, members + [name])
            members = members + [name]
        into = "pool" if name in members else "service"
        self._label(node, name in members, record(f"returned to {into}", by, now,
                                                  f"was {node.reason or node.summary}"))
        return Outcome(name, f"returned to {into}", True, node.reason or "")

    def _probe(self, node: NodeInfo) -> str | None:
        """Fence, resume, run `true` there. None when healthy, else why not."""
        name = node.name
        in_pool = name in self.members()
        fence = POOL_RESERVATION if in_pool else CHECK_RESERVATION
        if not in_pool:
            self._set_reservation(CHECK_RESERVATION, [])  # a leftover of an interrupted check
            self._set_reservation(CHECK_RESERVATION, [name])
        try:
            if "DRAIN" in node.flags or node.state == "DOWN" or "FAIL" in node.flags:
                self.client.update_node(name, "RESUME")
            self.client.srun(name, ["true"], options=[
                f"--reservation={fence}", f"--immediate={PROBE_IMMEDIATE_S}",
                "--job-name=hpct-health"], timeout=PROBE_TIMEOUT_S)
            return None
        except SlurmCommandError as exc:
            lines = [ln.strip() for ln in exc.stderr.splitlines() if ln.strip()]
            return f"probe srun -w {name} true failed: {lines[-1] if lines else exc.message}"
        finally:
            if not in_pool:
                self._set_reservation(CHECK_RESERVATION, [])

    def _known(self, nodes: Sequence[NodeInfo], names: Sequence[str]) -> dict[str, NodeInfo]:
        by_name = {n.name: n for n in nodes}
        unknown = [n for n in names if n not in by_name]
        if unknown:
            raise HpctError(f"node(s) {compress(unknown)!r} are not in this cluster "
                            f"({compress(sorted(by_name)) or 'no nodes'})")
        return {n: by_name[n] for n in names}

    def _label(self, node: NodeInfo, present: bool, comment: str) -> None:
        self.client.set_node_features(node.name, with_feature(node.features, present), comment)

    def _sync_labels(self, nodes: Sequence[NodeInfo], members: Sequence[str],
                     skip: Sequence[str] = ()) -> None:
        """Put the feature back where `scontrol reconfigure` dropped it, and off non-members."""
        for n in nodes:
            if n.name in skip or (FEATURE in n.features) == (n.name in members):
                continue
            self.client.set_node_features(n.name, with_feature(n.features, n.name in members))

    def _set_reservation(self, name: str, nodes: Sequence[str]) -> None:
        """Make reservation `name` hold exactly `nodes` (none: delete it; Slurm has no empty
        reservation)."""
        current = self.client.reservation_nodes(name)
        if not nodes:
            if current is not None:
                self.client.delete_reservation(name)
            return
        if current is None:
            self.client.create_reservation(name, nodes, users=self.users)
        elif sorted(current) != sorted(set(nodes)):
            self.client.update_reservation(name, nodes)


def outcomes_json(outcomes: Sequence[Outcome]) -> list[dict]:
    return [asdict(o) for o in outcomes]
