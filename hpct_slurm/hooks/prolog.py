"""Prolog (root, on every node of a job, before any task): health check, stale-dir sweep,
the job's shm dir, and its share of the node's shm.

Budget: all jobs' caches on a node together may reserve `HPCT_SHM_FRACTION` of the shm
filesystem. A job asks for `--hpct-cache-mb` (SPANK_HPCT_CACHE_MB; HPCT_DEFAULT_CACHE_MB
without the plugin) and is granted what is left, recorded as `<root>/<jobid>.budget`; the task
prolog exports the grant as HPCT_CACHE_MB and the cache store refuses to build past it. A short
grant is not a node fault, so it never fails the prolog (which would drain the node).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from ..errors import HpctError, describe
from ..events import Ev, EventLog
from ..rendezvous.derive import resolve_host
from .context import HookConfig, JobContext
from .fence import FenceConfig
from .fence import install as install_fence
from .health import HealthConfig, default_checks, run_checks
from .node import NodeSlurm
from .shm import ShmRoot

EVENT_HEALTH_FAILED = Ev.HOOK_HEALTH_FAILED
EVENT_DRAIN_FAILED = Ev.HOOK_DRAIN_FAILED
EVENT_STALE_REMOVED = Ev.HOOK_STALE_REMOVED
EVENT_STALE_SKIPPED = Ev.HOOK_STALE_SKIPPED
EVENT_STALE_REMOVE_FAILED = Ev.HOOK_STALE_REMOVE_FAILED
EVENT_JOB_DIR = Ev.HOOK_JOB_DIR

DRAIN_PREFIX = "hpct: health: "


def grant_mb(requested_mb: int, capacity_mb: int, reserved_by_others_mb: int) -> int:
    """A job gets what it asked for, or what the other jobs' grants leave of the capacity."""
    return max(0, min(requested_mb, capacity_mb - reserved_by_others_mb))


@dataclass
class PrologResult:
    healthy: bool
    problems: list[str] = field(default_factory=list)
    job_dir: Path | None = None
    granted_mb: int = 0
    stale_removed: list[int] = field(default_factory=list)


def sweep_stale(root: ShmRoot, keep: set[int], slurm: NodeSlurm, log: EventLog) -> list[int]:
    """Remove dirs of jobs that no longer run (a crashed node never ran their epilog)."""
    present = root.job_ids() - keep
    if not present:
        return []
    try:
        active = slurm.active_job_ids()
        why = "slurm job list unavailable"
    except Exception as exc:  # noqa: BLE001 - any failure to read Slurm: no sweep, job runs
        active, why = None, f"slurm job list unavailable: {describe(exc)}"
    if active is None:
        log.emit(EVENT_STALE_SKIPPED, reason=why, present=sorted(present))
        return []
    removed = []
    for job_id in sorted(present - active):
        try:
            root.remove_job(job_id)
        except (HpctError, OSError) as exc:
            # What a job's user left behind must not fail this job's prolog (and drain the
            # node): the dir stays, the next sweep tries again.
            log.emit(EVENT_STALE_REMOVE_FAILED, job_id=job_id, error=describe(exc))
            continue
        removed.append(job_id)
    if removed:
        log.emit(EVENT_STALE_REMOVED, jobs=removed)
    return removed


def prolog(job: JobContext, cfg: HookConfig, slurm: NodeSlurm, log: EventLog,
           fence: FenceConfig = FenceConfig()) -> PrologResult:
    problems = run_checks(default_checks(HealthConfig(cfg.shm_root, cfg.min_free_shm_mb)))
    if problems:
        reason = DRAIN_PREFIX + "; ".join(problems)
        log.emit(EVENT_HEALTH_FAILED, node=job.node, job_id=job.job_id, reason=reason)
        try:
            slurm.drain(job.node, reason)
        except Exception as exc:  # noqa: BLE001 - whatever it was, the log keeps the reason
            # The failed prolog still makes Slurm drain the node ("Prolog error"); the event
            # log keeps the real reason.
            log.emit(EVENT_DRAIN_FAILED, node=job.node, job_id=job.job_id, error=describe(exc))
        return PrologResult(healthy=False, problems=problems)
    # Prologs of jobs starting together on this node run at the same time: without the lock
    # two of them could read the same budgets and both be granted the same MB.
    with ShmRoot(cfg.shm_root, create=True) as root, root.locked():
        stale = sweep_stale(root, {job.job_id}, slurm, log)
        info = root.create_job_dir(job.job_id, job.uid, job.gid)
        others = sum(mb for j, mb in root.budgets_mb().items() if j != job.job_id)
        requested = (job.requested_cache_mb if job.requested_cache_mb is not None
                     else cfg.default_cache_mb)
        granted = grant_mb(requested, int(root.capacity_mb() * cfg.shm_fraction), others)
        root.write_budget(job.job_id, granted)
    log.emit(EVENT_JOB_DIR, node=job.node, job_id=job.job_id, path=str(info.path),
             uid=info.uid, mode=f"{info.mode:o}", replaced=info.replaced,
             requested_mb=requested, granted_mb=granted)
    # After the health verdict: an unhealthy node runs no job to fence. Never fails.
    if fence.mode != "off":
        install_fence(job, job.nodelist, fence, log, slurm.controller_hosts, resolve_host,
                      active=slurm.active_job_ids)
    return PrologResult(healthy=True, job_dir=info.path, granted_mb=granted,
                        stale_removed=stale)
