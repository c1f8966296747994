"""Epilog (root, on every node of a job, after it ends): remove the job's shm dir."""
from __future__ import annotations

from ..events import EventLog
from .context import HookConfig, JobContext
from .shm import ShmRoot

EVENT_JOB_DIR_REMOVED = "hook_job_dir_removed"


def epilog(job: JobContext, cfg: HookConfig, log: EventLog) -> bool:
    """Remove the job's dir; True when there was one."""
    with ShmRoot(cfg.shm_root, create=True) as root, root.locked():  # not mid-sweep
        found = root.remove_job(job.job_id)
    log.emit(EVENT_JOB_DIR_REMOVED, node=job.node, job_id=job.job_id, found=found)
    return found
