"""torchrun_inline.py adopted for the peers that `hpct-slurm bench peers` compares hpct-slurm
with: torchft (torchft_ddp.py) and nvidia-resiliency-ext's in-job restart (nvrx_ddp.py). Lines
ending in `# bench` are the benchmark's instrumentation (step events, the fault-free start),
not part of an adoption: `bench peers` leaves them out of the changed-line counts."""
