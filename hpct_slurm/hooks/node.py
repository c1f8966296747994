"""What the hooks ask of Slurm, behind a two-method interface so hook logic is testable
without a cluster (the cluster tests exercise the real one)."""
from __future__ import annotations

from typing import Protocol


class NodeSlurm(Protocol):
    def active_job_ids(self) -> set[int] | None:
        """Jobs that may still use a node's shm (not finished); None, or any exception (the
        caller logs it), when Slurm cannot say."""

    def drain(self, node: str, reason: str) -> None: ...

    def controller_hosts(self) -> list[str]:
        """slurmctld's hosts (`scontrol show config`): the fence admits them."""


class SlurmNode:
    """The real thing, through hpct_slurm.slurm.client (squeue --json, scontrol update)."""

    def __init__(self, timeout: float = 10.0):
        from ..slurm.client import SlurmClient

        self.client = SlurmClient(timeout=timeout)

    def active_job_ids(self) -> set[int] | None:
        """Raises (HpctError naming the command and field, or whatever a parser bug raises)
        when Slurm cannot say: unknown is not "none", a sweep on a wrong answer would delete
        live data. sweep_stale logs it and sweeps nothing."""
        return {j.job_id for j in self.client.jobs() if not j.finished}

    def drain(self, node: str, reason: str) -> None:
        self.client.update_node(node, "DRAIN", reason)

    def controller_hosts(self) -> list[str]:
        from .fence import controller_hosts

        return controller_hosts(self.client.config_text())
