"""How the controller keeps its steady-state load bounded as the world grows (issue 16).

Pure functions, no I/O. At a few hundred ranks every rank heartbeats every 0.5 s and reports
every step; at thousands that is more authenticated messages per second than one Python event
loop on the batch host (itself a training node) should spend a core on. So the controller hands
every step a heartbeat interval and a step-report interval (HPCT_HEARTBEAT_S,
HPCT_STEP_REPORT_S) that keep the aggregate rate under MESSAGE_BUDGET_PER_S, and stretches its
own silence timeout with the interval. A crashed process or node is still seen at once (its
connection's EOF or reset, the first detector); only a silent-but-connected node waits for the
longer timeout.

And an assignment's per-rank view: at small worlds every Assign lists every peer and every
survivor as a restore source (unchanged); beyond FULL_VIEW_MAX ranks an Assign carrying
O(world) entries would make one assignment O(world^2) bytes (and overflow the 64 KiB header
limit at ~2,000 ranks), so each rank gets only the peers it uses (its ring replica holder) and
a few sources of its own shard key, rotated so that restore reads spread over the survivors.
"""
from __future__ import annotations

import bisect
from dataclasses import dataclass

from ..protocol import pacing as rank_side

# The rate the real ranks' defaults produce up to 1,000 ranks (0.5 s heartbeats).
BASE_HEARTBEAT_S = 0.5
# Heartbeats plus step reports per second the controller accepts in steady state. Measured
# by `hpct-slurm bench scale`: ~35 us of controller CPU each (read, HMAC, decode, bookkeeping),
# so 2,000/s is ~7% of one core, leaving room for the watchdog sweep and bursts.
MESSAGE_BUDGET_PER_S = 2000.0
# A silent rank is lost after this many missed intervals (3 s at 0.5 s: the old default).
MISSED_BEATS = 6
# Beyond the base rate the controller's connections carry TCP keepalives
# (protocol/pacing.py, set_keepalive): a node that died without a word stops answering them.
# Up to this many ranks an Assign carries the whole peer table and every source.
FULL_VIEW_MAX = 512
# Restore sources per rank beyond FULL_VIEW_MAX (a bad source costs one retry each).
SOURCES_PER_RANK = 4

# When a rank reports a step under the interval handed out here: the ranks apply it too, so it
# lives below both sides (protocol/pacing.py).
should_report = rank_side.should_report


@dataclass(frozen=True)
class Pacing:
    heartbeat_s: float      # each rank's heartbeat interval
    step_report_s: float    # 0: a StepDone every step; else at most one per this interval
    silence_timeout_s: float  # no message for this long: the rank is lost
    # how often the watchdog sweeps every connection (0.25 s; 1 s beyond the base rate, where
    # the sweep itself costs ~5% of a core at 16,384 ranks and the timeouts are long anyway)
    sweep_s: float = 0.25

    @property
    def keepalive(self) -> bool:
        return self.heartbeat_s > BASE_HEARTBEAT_S

    def env(self) -> dict[str, str]:
        """What a step's environment carries: nothing at the base rate (the ranks' defaults),
        so small jobs run exactly as before."""
        from .. import config as C
        if self.heartbeat_s == BASE_HEARTBEAT_S and not self.step_report_s:
            return {}
        return {C.HEARTBEAT_S: f"{self.heartbeat_s:g}",
                C.STEP_REPORT_S: f"{self.step_report_s:g}"}


def pace(ranks: int, heartbeat_timeout_s: float,
         budget_per_s: float = MESSAGE_BUDGET_PER_S) -> Pacing:
    """Intervals for `ranks` connected processes: half the budget to heartbeats, half to step
    reports. Below budget/2 * BASE_HEARTBEAT_S ranks nothing changes (0.5 s, every step, the
    configured timeout)."""
    if ranks < 1:
        raise ValueError(f"ranks {ranks} must be at least 1")
    hb = max(BASE_HEARTBEAT_S, ranks / (budget_per_s / 2))
    if hb == BASE_HEARTBEAT_S:
        return Pacing(BASE_HEARTBEAT_S, 0.0, heartbeat_timeout_s)
    hb = round(hb, 2)
    return Pacing(hb, hb, max(heartbeat_timeout_s, MISSED_BEATS * hb), sweep_s=1.0)


def relayed(tasks_per_node: int) -> bool:
    """Whether a node's ranks reach the controller through one relay (relay/node.py):
    whenever a node runs several ranks, so that a recovery round costs O(nodes) frames, not
    O(ranks). One rank per node keeps its own connection: there is nothing to aggregate."""
    return tasks_per_node > 1


class AssignView:
    """The sources and peers each rank's Assign carries (plain data parallelism: every source
    holds the same shared state), built once per assignment. Up to FULL_VIEW_MAX ranks, all of
    them; beyond, a rank's own transfer address and its ring replica holder's (the only peers a
    rank uses, recovery/job.py _ring/_holder), and SOURCES_PER_RANK sources starting at its own
    position, so that the replacements' reads spread over the survivors."""

    def __init__(self, world_size: int, nodes: int, sources: dict[int, list[tuple[str, int]]],
                 peers: dict[int, tuple[str, int]]):
        self.world_size, self.nodes, self.sources, self.peers = world_size, nodes, sources, peers
        self.ranks = sorted(sources)  # once: per rank it made an assignment O(world^2)

    def __call__(self, rank: int) -> tuple[dict[int, list[tuple[str, int]]],
                                           dict[int, tuple[str, int]]]:
        from ..recovery.ring import replica_peer_rank

        if self.world_size <= FULL_VIEW_MAX:
            return self.sources, self.peers
        ranks = self.ranks
        start = bisect.bisect_left(ranks, rank) % len(ranks) if ranks else 0
        chosen = [ranks[(start + i) % len(ranks)]
                  for i in range(min(SOURCES_PER_RANK, len(ranks)))]
        wanted = [rank]
        if self.nodes >= 2:
            wanted.append(replica_peer_rank(rank, self.nodes, self.world_size // self.nodes))
        return ({r: self.sources[r] for r in chosen},
                {r: self.peers[r] for r in wanted if r in self.peers})


def assign_view(rank: int, world_size: int, nodes: int,
                sources: dict[int, list[tuple[str, int]]], peers: dict[int, tuple[str, int]]
                ) -> tuple[dict[int, list[tuple[str, int]]], dict[int, tuple[str, int]]]:
    """One rank's view (AssignView, for a single rank)."""
    return AssignView(world_size, nodes, sources, peers)(rank)


def compact_members(members: list[str], world_size: int) -> tuple[list[str], str]:
    """(members, members_hostlist) for an Assign: the list as it is up to FULL_VIEW_MAX ranks,
    beyond it one hostlist expression (order kept: `sim[00001-00999,02049,01001-02047]`)."""
    if world_size <= FULL_VIEW_MAX:
        return list(members), ""
    from ..slurm.hostlist import compress
    return [], compress(members)

