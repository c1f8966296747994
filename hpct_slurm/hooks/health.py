"""Node health checks run by the prolog. A check returns None when fine or one line saying
what is wrong; the prolog drains the node with `hpct: health: <that line>`."""
from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from ..errors import HpctError
from .shm import ShmRoot

HealthCheck = Callable[[], "str | None"]


@dataclass(frozen=True)
class HealthConfig:
    shm_root: Path
    min_free_shm_mb: int


def shm_root_usable(cfg: HealthConfig) -> str | None:
    try:
        with ShmRoot(cfg.shm_root, create=True) as root:
            probe = f".health.{os.getpid()}"
            fd = os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600,
                         dir_fd=root.fd)
            os.close(fd)
            os.unlink(probe, dir_fd=root.fd)
    except HpctError as exc:
        return exc.message
    except OSError as exc:
        return f"shm root {cfg.shm_root} is not writable ({exc.strerror})"
    return None


def shm_free(cfg: HealthConfig) -> str | None:
    st = os.statvfs(cfg.shm_root.parent)
    free_mb = st.f_bavail * st.f_frsize // (1 << 20)
    if free_mb < cfg.min_free_shm_mb:
        return (f"{cfg.shm_root.parent} has {free_mb} MB free, below the "
                f"{cfg.min_free_shm_mb} MB minimum (HPCT_HEALTH_MIN_SHM_MB)")
    return None


def default_checks(cfg: HealthConfig) -> list[HealthCheck]:
    return [lambda: shm_root_usable(cfg), lambda: shm_free(cfg)]


def run_checks(checks: list[HealthCheck]) -> list[str]:
    """Every failing check's message (all of them, so one drain reason tells the whole story)."""
    return [msg for msg in (check() for check in checks) if msg]
