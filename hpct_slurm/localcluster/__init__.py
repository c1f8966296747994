"""A real Slurm cluster on one machine, for the demo and the tests."""
from .cluster import DEFAULT_ROOT, LocalCluster
from .layout import Hooks, Layout

__all__ = ["DEFAULT_ROOT", "Hooks", "Layout", "LocalCluster"]
