#!/bin/sh
# hpct-slurm @COMMAND@ hook, written by `hpct-slurm hooks install`. slurmd runs hooks with an
# almost empty environment, so the python that has hpct_slurm is named by absolute path.
# A hook that cannot run lets the job run (a failed Prolog drains the node): a missing python
# is said on stderr, which slurmd logs, and the hook exits 0.
if [ ! -x @PYTHON@ ]; then
    echo "hpct: @COMMAND@ hook: @PYTHON@ is not there; the job runs without it" >&2
    exit 0
fi
@SETTINGS@exec @PYTHON@ -m hpct_slurm.cli @COMMAND@
