"""Benchmarks: `hpct-slurm bench NAME` runs `hpct_slurm.bench.NAME.run`."""
