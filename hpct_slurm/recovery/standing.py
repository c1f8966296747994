"""Where this process stands now (`Standing`): what the pieces of a `Job` read off the Job.

Its own module so that every piece (generation.py, snapshot_policy.py, restore.py,
integrity.py, controller_loss.py) can name it without importing another piece.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from .client import CoordinationClient


class Standing(Protocol):
    """Where this process stands now, as the pieces of a `Job` read it (the Job itself): the
    controller connection, set when it starts, and the rest, set at every adoption."""
    client: CoordinationClient
    rank: int
    world_size: int
    generation: int
    data_ranks: list[int]
    data_world: int
    step: int  # the step in progress
