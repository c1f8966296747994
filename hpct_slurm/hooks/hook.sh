#!/bin/sh
# hpct-slurm @COMMAND@ hook, written by `hpct-slurm hooks install`. slurmd runs hooks with an
# almost empty environment, so the python that has hpct_slurm is named by absolute path.
@SETTINGS@exec @PYTHON@ -m hpct_slurm.cli @COMMAND@
