"""What the hooks know: the admin's settings (HPCT_* baked into the hook scripts) and the job
(what slurmd puts in a Prolog/Epilog environment, SPANK_HPCT_* from the plugin)."""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Mapping

from .. import config as C
from ..errors import HpctError
from ..slurm.env import check_uint
from .shm import check_job_id, shm_root


def _env_int(environ: Mapping[str, str], name: str, default: int) -> int:
    raw = environ.get(name)
    if raw is None or raw == "":
        return default
    return check_uint(raw, name)


@dataclass(frozen=True)
class HookConfig:
    shm_root: Path
    shm_fraction: float = 0.5
    default_cache_mb: int = 1024
    min_free_shm_mb: int = 64

    @classmethod
    def from_env(cls, environ: Mapping[str, str]) -> "HookConfig":
        return cls(shm_root=shm_root(environ), shm_fraction=C.read(environ, C.SHM_FRACTION),
                   default_cache_mb=C.read(environ, C.DEFAULT_CACHE_MB),
                   min_free_shm_mb=C.read(environ, C.HEALTH_MIN_SHM_MB))


@dataclass(frozen=True)
class JobContext:
    """What slurmd tells a prolog/epilog about the job."""

    job_id: int
    uid: int
    gid: int
    node: str
    requested_cache_mb: int | None = None
    nodelist: str = ""  # the allocation (the fence admits its nodes)

    @classmethod
    def from_env(cls, environ: Mapping[str, str]) -> "JobContext":
        job = environ.get("SLURM_JOB_ID")
        if not job:
            raise HpctError("SLURM_JOB_ID is not set: the hooks run from slurmd's Prolog=/"
                            "Epilog=, not by hand")
        node = environ.get("SLURMD_NODENAME", "")
        if not node:
            raise HpctError("SLURMD_NODENAME is not set: the hooks run from slurmd")
        uid = _env_int(environ, "SLURM_JOB_UID", -1)
        gid = _env_int(environ, "SLURM_JOB_GID", -1)
        if uid < 0 or gid < 0:
            raise HpctError(f"SLURM_JOB_UID/SLURM_JOB_GID {environ.get('SLURM_JOB_UID')!r}/"
                            f"{environ.get('SLURM_JOB_GID')!r} are not set")
        return cls(job_id=check_job_id(job, "SLURM_JOB_ID"), uid=uid, gid=gid, node=node,
                   requested_cache_mb=C.read(environ, C.SPANK_CACHE_MB),
                   # Slurm 22.05 gives a Prolog only SLURM_NODELIST (measured)
                   nodelist=environ.get("SLURM_JOB_NODELIST") or environ.get("SLURM_NODELIST", ""))
