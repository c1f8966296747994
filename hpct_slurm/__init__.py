"""hpct-slurm: checkpointless training on plain Slurm clusters."""

__version__ = "0.1.0"
