"""What the hooks ask of Slurm, behind a two-method interface so hook logic is testable
without a cluster (the cluster tests exercise the real one)."""
from __future__ import annotations

from typing import Protocol

from ..errors import HpctError


class NodeSlurm(Protocol):
    def active_job_ids(self) -> set[int] | None:
        """Jobs that may still use a node's shm (not finished); None when Slurm cannot say."""

    def drain(self, node: str, reason: str) -> None: ...


class SlurmNode:
    """The real thing, through hpct_slurm.slurm.client (squeue --json, scontrol update)."""

    def __init__(self, timeout: float = 10.0):
        from ..slurm.client import SlurmClient

        self.client = SlurmClient(timeout=timeout)

    def active_job_ids(self) -> set[int] | None:
        try:
            return {j.job_id for j in self.client.jobs() if not j.finished}
        except HpctError:
            # Unknown is not "none": a stale-dir sweep on a wrong answer would delete live data.
            return None

    def drain(self, node: str, reason: str) -> None:
        self.client.update_node(node, "DRAIN", reason)
