"""Task prolog (as the job's user, in every task before exec): the environment a task needs,
printed as `export NAME=VALUE` lines. Slurm's TaskProlog= applies them, and so does the SPANK
plugin when plugstack.conf names `hpct=` (then TaskProlog= is not needed).

HPCT_SHM_DIR is the job's dir; HPCT_CACHE_MB becomes the prolog's grant (what the store may
use), not the request. The rendezvous env comes from `hpct-slurm rendezvous env --format
export`, the one place it is derived.
"""
from __future__ import annotations

import importlib.util
import subprocess
import sys
from typing import Mapping

from .. import config as C
from ..errors import HpctError
from .shm import check_job_id, job_dir, read_budget, shm_root

RENDEZVOUS_CLI = "hpct_slurm.rendezvous.cli"


# Rank-side settings the controller hands to the ranks it launches (one writer: the
# controller). A task prolog run for such a rank must not overwrite them with the rendezvous
# derivation's defaults for steps nobody supervises (issue 14: with the SPANK plugin
# installed, ranks ran with a 120 s collective timeout, without it with 10 s).
CONTROLLER_OWNED = (C.COLLECTIVE_TIMEOUT_S, C.INIT_TIMEOUT_S)


def for_task(env: dict[str, str], environ: Mapping[str, str]) -> dict[str, str]:
    """`env` less what the controller owns, when the task is one the controller launched
    (it set HPCT_CONTROLLER in the step's environment)."""
    if not C.raw(environ, C.CONTROLLER_ADDR):
        return env
    return {k: v for k, v in env.items() if k not in CONTROLLER_OWNED}


def task_env(environ: Mapping[str, str]) -> dict[str, str]:
    """The hpct part of a task's environment (pure but for reading the grant file)."""
    out: dict[str, str] = {}
    if not environ.get("SLURM_JOB_ID"):
        return out
    job_id = check_job_id(environ["SLURM_JOB_ID"], "SLURM_JOB_ID")
    out[C.SHM_DIR] = str(job_dir(environ))
    granted = read_budget(shm_root(environ), job_id)
    if granted is not None:
        out[C.CACHE_MB] = str(granted)
    return out


def rendezvous_env(environ: Mapping[str, str]) -> dict[str, str]:
    """The derived rendezvous env, when the rendezvous CLI is installed."""
    if importlib.util.find_spec(RENDEZVOUS_CLI) is None:
        return {}
    proc = subprocess.run([sys.executable, "-m", "hpct_slurm.cli", "rendezvous", "env",
                           "--format", "export"], capture_output=True, text=True,
                          env=dict(environ), timeout=60)
    if proc.returncode != 0:
        msg = (proc.stderr or proc.stdout).strip().splitlines()
        raise HpctError(f"hpct-slurm rendezvous env failed: {msg[-1] if msg else 'no output'}")
    return parse_exports(proc.stdout)


def parse_exports(text: str) -> dict[str, str]:
    out = {}
    for line in text.splitlines():
        if not line.startswith("export "):
            continue
        name, sep, value = line[len("export "):].partition("=")
        if not sep or not name.isidentifier():
            raise HpctError(f"task env line {line!r} is not `export NAME=VALUE`")
        out[name] = value
    return out


def format_exports(env: Mapping[str, str]) -> str:
    """Slurm reads a TaskProlog's output line by line, taking the value verbatim."""
    lines = []
    for name, value in env.items():
        if not name.isidentifier() or "\n" in value or "\r" in value:
            raise HpctError(f"task env {name}={value!r} cannot be one `export` line")
        lines.append(f"export {name}={value}\n")
    return "".join(lines)
