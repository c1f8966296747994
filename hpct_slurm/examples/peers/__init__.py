"""torchrun_inline.py adopted for the peers that `hpct-slurm bench peers` compares hpct-slurm
with: torchft (torchft_ddp.py: a live spare group, or the lost group relaunched) and
nvidia-resiliency-ext (nvrx_inprocess.py: in-process restart with a reserve rank; nvrx_ddp.py:
in-job restart under ft_launcher). Lines ending in `# bench` are the benchmark's
instrumentation (bench/steplog.py's step record right after the optimizer step, the fault-free
start), not part of an adoption: `bench peers` leaves them out of the changed-line counts."""
