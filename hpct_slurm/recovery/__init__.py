"""Rank side of recovery: the in-process restart wrapper (`Job`), the drop-in
`DistributedSampler` and `DistributedDataParallel` for a script's own loop, snapshots, peer
transfer, disk persistence, health checks and the coordination client."""
from .ddp import DistributedDataParallel
from .job import Job
from .loop import DistributedSampler

__all__ = ["DistributedDataParallel", "DistributedSampler", "Job"]
