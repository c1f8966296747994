"""The descriptor limit of a long-lived process (a rank, the controller, a node relay).

Linux starts processes with a soft RLIMIT_NOFILE of 1,024 on most distributions however high
the hard limit is. A rank holds gloo's listener and pairs, the transfer server, the relay and
the controller connection; gloo's listener is stock and unauthenticated, and it aborts the
process (`accept: Too many open files`, SIGABRT) once the table is full: at 1,024, 1,500 idle
connections from any user on the node killed a formed rank within a second (issue 45). The
soft limit may be raised to the hard one by any process, without privilege, so every such
process does so at start; what it ends with is recorded (`rank.registered`, `controller.start`)
with a warning when it stays below FLOOR, which only the site can raise (limits.conf,
slurm.conf's PropagateResourceLimits, the slurmd unit's LimitNOFILE).
"""
from __future__ import annotations

import resource
from typing import Any

# Below this a rank's own use (gloo pairs to every peer, the servers' connections) leaves
# little room, and a stranger's connections fill the table quickly: docs/admin.md says how a
# site raises the hard limit.
FLOOR = 4096


def raise_nofile() -> tuple[int, int, int]:
    """Raise the soft RLIMIT_NOFILE to the hard one; (soft before, soft now, hard). Never
    raises: a limit that cannot be changed is reported as it stands."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = hard
    if hard == resource.RLIM_INFINITY:
        # setrlimit refuses a soft limit of "unlimited" for descriptors (above fs.nr_open)
        target = _nr_open(default=soft)
    if target > soft:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
        except (ValueError, OSError):
            return soft, soft, hard
    return soft, resource.getrlimit(resource.RLIMIT_NOFILE)[0], hard


def _nr_open(default: int) -> int:
    try:
        with open("/proc/sys/fs/nr_open") as f:
            return int(f.read().strip())
    except (OSError, ValueError):
        return default


def nofile_fields(limits: tuple[int, int, int]) -> dict[str, Any]:
    """What an event says about the limit raise_nofile left: `fd_limit` {soft, hard, was},
    and `fd_limit_low` (a sentence for the operator) while the soft limit is below FLOOR."""
    was, soft, hard = limits
    fields: dict[str, Any] = {"fd_limit": {"soft": soft, "hard": hard, "was": was}}
    if soft < FLOOR:
        fields["fd_limit_low"] = (
            f"the descriptor limit is {soft} (hard limit {hard}), below {FLOOR}: a local user "
            f"can exhaust it through gloo's unauthenticated listener and abort this process; "
            f"raise the hard RLIMIT_NOFILE for jobs (docs/admin.md)")
    return fields
