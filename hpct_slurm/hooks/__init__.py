"""Slurm hook entry points: Prolog/Epilog (root, per node) and TaskProlog (per task).

slurm.conf points at small scripts written by `hpct-slurm hooks install DIR` (from the
package's hook.sh), which exec `python -m hpct_slurm.cli prolog|epilog|task-prolog` with the
absolute path of the python that has hpct_slurm installed: slurmd runs hooks with an almost
empty environment, so nothing may depend on PATH.
"""
