#!/bin/bash
# Record what the Slurm commands SlurmClient parses print, for the parser tests
# (tests/data/slurm/<release>/). Run against a local cluster of nodes n1 n2 n3, all idle, no
# jobs (`hpct-slurm localcluster up --nodes 3 --mode ports`, SLURM_CONF pointing at it):
#   scripts/record-slurm-output.sh tests/data/slurm/22.05
# It leaves: a failed job (exit 3), a running job with a step on n1, n2 drained, n3 down, a
# pending job, a MAINT reservation; records; then cancels, resumes and deletes what it made.
set -u
out=${1:?usage: record-slurm-output.sh OUTDIR}
mkdir -p "$out"
rec() {  # rec FILE CMD...: stdout to FILE; FILE.stderr when it wrote any, FILE.rc unless 0
    local file=$1; shift
    "$@" >"$out/$file" 2>"$out/$file.stderr"
    local rc=$?
    [ $rc -eq 0 ] || echo "$rc" >"$out/$file.rc"
    [ -s "$out/$file.stderr" ] || rm -f "$out/$file.stderr"
}
wait_state() {  # wait_state JOB STATE (STATE "": squeue no longer lists it)
    for _ in $(seq 100); do
        [ "$(squeue -h -j "$1" -o %T 2>/dev/null)" = "$2" ] && return 0
        sleep 0.2
    done
    echo "job $1 never reached $2" >&2; return 1
}
rec version.txt scontrol --version
failed=$(sbatch --parsable -o /dev/null -N1 -w n1 -J failing --wrap 'exit 3')
wait_state "$failed" ""
running=$(sbatch --parsable -o /dev/null -N1 -w n1 -J running --wrap 'srun -N1 sleep 600')
echo "$running" >"$out/sbatch-parsable.txt"
wait_state "$running" RUNNING
for _ in $(seq 50); do squeue -h -s -j "$running" -o %i | grep -q "^$running\.0$" && break; sleep 0.2; done
scontrol update NodeName=n2 State=DRAIN Reason='hpct: test drain x=1 [a]'
scontrol update NodeName=n3 State=DOWN Reason='hpct: test down'
scontrol update NodeName=n1 AvailableFeatures=a,hpct_spare ActiveFeatures=a Comment='hpct: spare pool add'
pending=$(sbatch --parsable -o /dev/null -N3 -J pending --wrap 'sleep 1')
scontrol create reservation ReservationName=hpct_rec StartTime=now+3600 Duration=60 \
    Users=root Nodes=n1 Flags=MAINT,IGNORE_JOBS >/dev/null
sleep 1
rec sinfo.json sinfo --json
rec squeue.json squeue --json --states=all   # as SlurmClient.jobs() asks (24.11 on hide finished jobs otherwise)
rec scontrol-show-node.txt scontrol show node -o
rec scontrol-show-job.txt scontrol show job -o
rec scontrol-show-nodes.json scontrol show nodes --json
rec squeue-steps.txt squeue -h -s -j "$running" -o '%i %N'
rec squeue-state-running.txt squeue -h -j "$running" -o %T
rec squeue-state-failed.txt squeue -h -j "$failed" -o %T
rec sinfo-states.txt sinfo -h -N -o '%N %T'
rec scontrol-show-reservation.txt scontrol show reservation -o
rec show-hostnames-suffix.txt scontrol show hostnames 'n[1-2]-ib'
echo "failed=$failed running=$running pending=$pending" >"$out/jobs.txt"
scancel "$running" "$pending"
scontrol delete ReservationName=hpct_rec
scontrol update NodeName=n1 AvailableFeatures= ActiveFeatures= Comment=
scontrol update NodeName=n2,n3 State=RESUME
echo "recorded into $out: $(ls "$out" | tr '\n' ' ')"
