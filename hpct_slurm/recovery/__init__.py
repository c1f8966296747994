"""Rank side of recovery: the in-process restart wrapper (`Job`), snapshots, peer transfer,
disk persistence, health checks and the coordination client."""
from .job import Job

__all__ = ["Job"]
