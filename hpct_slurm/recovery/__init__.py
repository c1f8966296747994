"""Rank side of recovery: the in-process restart wrapper (`Job`), the drop-in
`DistributedSampler` for a script's own loop, snapshots, peer transfer, disk persistence,
health checks and the coordination client."""
from .job import Job
from .loop import DistributedSampler

__all__ = ["DistributedSampler", "Job"]
