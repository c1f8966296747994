"""A real Slurm cluster on one machine, for the demo, the benchmarks and the tests; `jobs` is
the job harness they share (submit, wait, read a run's events and results)."""
from .cluster import DEFAULT_ROOT, LocalCluster
from .layout import Hooks, Layout

__all__ = ["DEFAULT_ROOT", "Hooks", "Layout", "LocalCluster"]
