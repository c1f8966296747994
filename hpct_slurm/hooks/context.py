"""What the hooks know: the admin's settings (HPCT_* baked into the hook scripts) and the job
(what slurmd puts in a Prolog/Epilog environment, SPANK_HPCT_* from the plugin)."""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Mapping

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
        raw = environ.get("HPCT_SHM_FRACTION", "0.5")
        try:
            fraction = float(raw)
        except ValueError:
            fraction = -1.0
        if not 0.0 < fraction <= 1.0:
            raise HpctError(f"HPCT_SHM_FRACTION {raw!r} is not a number in (0, 1]")
        return cls(shm_root=shm_root(environ), shm_fraction=fraction,
                   default_cache_mb=_env_int(environ, "HPCT_DEFAULT_CACHE_MB", 1024),
                   min_free_shm_mb=_env_int(environ, "HPCT_HEALTH_MIN_SHM_MB", 64))


@dataclass(frozen=True)
class JobContext:
    """What slurmd tells a prolog/epilog about the job."""

    job_id: int
    uid: int
    gid: int
    node: str
    requested_cache_mb: int | None = None

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
        requested = environ.get("SPANK_HPCT_CACHE_MB")
        return cls(job_id=check_job_id(job, "SLURM_JOB_ID"), uid=uid, gid=gid, node=node,
                   requested_cache_mb=(_env_int(environ, "SPANK_HPCT_CACHE_MB", 0)
                                       if requested else None))
