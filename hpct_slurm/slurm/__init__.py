"""The one place that talks to Slurm: SLURM_* parsing, hostlists, and the Slurm commands."""
from .client import (BackendChoice, JobInfo, NodeInfo, SlurmClient, SlurmCommandError,
                     StepInfo, srun_argv)
from .env import SlurmEnv, parse_tasks_per_node
from .hostlist import compress, expand

__all__ = ["BackendChoice", "JobInfo", "NodeInfo", "SlurmClient", "SlurmCommandError",
           "SlurmEnv", "StepInfo", "compress", "expand", "parse_tasks_per_node", "srun_argv"]
