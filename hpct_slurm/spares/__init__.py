"""The cluster-level spare pool: a Slurm reservation plus a node label, driven by scontrol."""
from .pool import (CHECK_RESERVATION, FEATURE, POOL_RESERVATION, Outcome, PoolNode, SparePool,
                   record)

__all__ = ["CHECK_RESERVATION", "FEATURE", "POOL_RESERVATION", "Outcome", "PoolNode",
           "SparePool", "record"]
