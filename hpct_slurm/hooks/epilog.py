"""Epilog (root, on every node of a job, after it ends): remove the job's shm dir."""
from __future__ import annotations

from ..errors import HpctError, describe
from ..events import Ev, EventLog
from .context import HookConfig, JobContext
from .fence import FenceConfig
from .fence import remove as remove_fence
from .shm import ShmRoot

EVENT_JOB_DIR_REMOVED = Ev.HOOK_JOB_DIR_REMOVED
EVENT_JOB_DIR_REMOVE_FAILED = Ev.HOOK_JOB_DIR_REMOVE_FAILED


def epilog(job: JobContext, cfg: HookConfig, log: EventLog,
           fence: FenceConfig = FenceConfig()) -> bool:
    """Remove the job's fence (never fails) and dir; True when there was a dir and it is
    gone. A dir that cannot be removed (its user made it a trap) is logged and left for the
    next prolog's sweep: a failed epilog would drain the node."""
    remove_fence(job, fence, log)
    with ShmRoot(cfg.shm_root, create=True) as root, root.locked():  # not mid-sweep
        try:
            found = root.remove_job(job.job_id)
        except (HpctError, OSError) as exc:
            log.emit(EVENT_JOB_DIR_REMOVE_FAILED, node=job.node, job_id=job.job_id,
                     error=describe(exc))
            return False
    log.emit(EVENT_JOB_DIR_REMOVED, node=job.node, job_id=job.job_id, found=found)
    return found
