"""Every `HPCT_*` setting in one table: its name, type, default, bounds, who sets it and who
reads it. Reads of `HPCT_*` variables happen here and nowhere else (tests/test_config.py
checks it): a module asks `read(environ, NAME)` or a group's frozen settings object
(`JobSettings.from_environ`), and a bad value is always the same `SettingError`, naming the
variable, the value and what is allowed.

Precedence, one rule for every setting:

  1. an explicit argument (a command-line flag, a keyword argument such as
     `Job(recovery_mode=...)`) wins;
  2. else the variable in the environment: the user's sbatch option (`--hpct-spares` and
     friends, which the SPANK plugin exports) or the user's own `export` before sbatch;
  3. else the admin's default (plugstack.conf `default_*` for the SPANK options, which the
     plugin exports when the user gave none; the settings baked into the hook scripts);
  4. else the default in this table.

Rank-side settings (`set_by` "controller") are handed to ranks by the controller alone: it
writes them into every step it launches, and a task prolog leaves them alone for its ranks
(hooks/task_prolog.CONTROLLER_OWNED), so the value a rank runs with is the controller's.

Writers (the controller, the task prolog, the rendezvous env) use the name constants below,
not free strings. This module imports nothing heavy: the CLI imports it.
"""
from __future__ import annotations

import argparse
import dataclasses
import os
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .errors import HpctError, shown

# Who sets a setting: the admin (plugstack.conf, the hook scripts' settings), the user (an
# sbatch option, an `export` before sbatch), the controller (for the ranks it launches), a
# Slurm hook (the task prolog), a test (fault injection), the rendezvous (for the script).
ADMIN, USER, CONTROLLER, HOOK, TEST, RENDEZVOUS = (
    "admin", "user", "controller", "slurm-hook", "test", "rendezvous")
SET_BY = (ADMIN, USER, CONTROLLER, HOOK, TEST, RENDEZVOUS)

UINT32_MAX = 0xFFFFFFFF
# Every number in the table and on the command line goes through these: ASCII digits only
# (float() and int() also take '١٢', '１２', '1_000', 'inf', 'nan' and '1e309'), short enough that
# the value is finite and int() is cheap.
_INT_RE = re.compile(r"-?[0-9]{1,10}")
_DECIMAL_RE = re.compile(r"[0-9]{1,10}(?:\.[0-9]{0,20})?|\.[0-9]{1,20}")
# A seconds setting's upper bound where the table gives none: a week is past any timeout a job
# could want, and far inside what timedelta, socket and thread timeouts take (1e10 s is not).
SECONDS_MAX = 7 * 24 * 3600
# A ratio setting's upper bound (HPCT_SLOW_RATIO): a node 100 x slower than its peers has
# stopped, which the progress timeout finds.
RATIO_MAX = 100.0
_SPACE = " \t\r\n"


class SettingError(HpctError):
    """A setting's value cannot be used: the message names the variable, the value and what
    is allowed."""


class _Refused(ValueError):
    """What is wrong with a value, without the name it came under: `read` puts the variable
    in front (a SettingError), argparse the flag (`arg_type`)."""

    def __init__(self, value: str, what: str, sep: str = " ", hint: str = ""):
        super().__init__(f"{value} {what}")
        self.sep, self.hint = sep, hint

    def naming(self, name: str) -> SettingError:
        return SettingError(f"{name}{self.sep}{self}{self.hint}")


@dataclass(frozen=True)
class Setting:
    name: str
    kind: str             # int | seconds | fraction | ratio | choice | flag | str | path | ranks | job_id
    default: Any
    set_by: tuple[str, ...]
    read_by: tuple[str, ...]
    doc: str
    lo: int | None = None
    hi: int | None = None
    choices: tuple[str, ...] = ()
    scope: str = "job"    # the group it belongs to: settings_for(scope)
    shell_only: bool = False  # read by an sbatch template's shell, not by Python

    def allowed(self) -> str:
        """What a value may be, in words (the error message and the docs table)."""
        if self.kind == "int":
            if self.hi is None or (self.hi == UINT32_MAX and self.lo == 0):
                return f"an integer >= {self.lo}"
            return f"an integer in {self.lo}-{self.hi}"
        if self.kind == "seconds":
            lo = "> 0" if self.lo is None else f">= {self.lo}"
            return f"seconds {lo}, at most {self.seconds_max()}"
        if self.kind == "fraction":
            return "a number in (0, 1]"
        if self.kind == "ratio":
            return f"a number > 1, at most {RATIO_MAX:g}"
        if self.kind in ("choice", "flag"):
            return " \\| ".join(self.choices)
        if self.kind == "ranks":
            return "comma-separated ranks"
        if self.kind == "job_id":
            return "a Slurm job id"
        if self.kind == "path":
            return "a path"
        return "text"

    def seconds_max(self) -> int:
        return SECONDS_MAX if self.hi is None else self.hi


def _s(name: str, kind: str, default: Any, set_by: str | tuple[str, ...],
       read_by: str | tuple[str, ...], doc: str, **kw: Any) -> Setting:
    as_tuple = (lambda v: (v,) if isinstance(v, str) else tuple(v))
    return Setting(name, kind, default, as_tuple(set_by), as_tuple(read_by), doc, **kw)


# ---- names: writers use these, the table below describes them ---------------------------
# the ranks' contract with the controller
CONTROLLER_ADDR = "HPCT_CONTROLLER"
SECRET_FILE = "HPCT_SECRET_FILE"
RUN_DIR = "HPCT_RUN_DIR"
ROLE = "HPCT_ROLE"
STORE = "HPCT_STORE"
COLLECTIVE_TIMEOUT_S = "HPCT_COLLECTIVE_TIMEOUT_S"
INIT_TIMEOUT_S = "HPCT_INIT_TIMEOUT_S"
PERSIST_EVERY = "HPCT_PERSIST_EVERY"
HEARTBEAT_S = "HPCT_HEARTBEAT_S"
STEP_REPORT_S = "HPCT_STEP_REPORT_S"
RELAY = "HPCT_RELAY"
WORLD_SIZE = "HPCT_WORLD_SIZE"
JOB_ID = "HPCT_JOB_ID"
RECOVERY_MODE = "HPCT_RECOVERY_MODE"
SNAPSHOT_EVERY = "HPCT_SNAPSHOT_EVERY"
SNAPSHOT_OVERLAP = "HPCT_SNAPSHOT_OVERLAP"
SNAPSHOT_LAZY = "HPCT_SNAPSHOT_LAZY"
FAULT_CORRUPT_SERVE = "HPCT_FAULT_CORRUPT_SERVE"
FAULT_TAKER_DIES_AT = "HPCT_FAULT_TAKER_DIES_AT"
FAULT_FLIP_RANK = "HPCT_FAULT_FLIP_RANK"
FAULT_FLIP_STEP = "HPCT_FAULT_FLIP_STEP"
# the phases of an adoption a test can land a second fault in (recovery/inject.py)
TAKER_PHASES = ("assigned", "store", "connect", "pull", "first_step")
BACKEND = "HPCT_BACKEND"
ABORT_TIMEOUT_S = "HPCT_ABORT_TIMEOUT_S"
# rendezvous
MEMBERS = "HPCT_MEMBERS"
TASKS_PER_NODE = "HPCT_TASKS_PER_NODE"
GENERATION = "HPCT_GENERATION"
STORE_PORT = "HPCT_STORE_PORT"
PORT_BASE = "HPCT_PORT_BASE"
PORT_SPAN = "HPCT_PORT_SPAN"
NODES_PER_HOST = "HPCT_NODES_PER_HOST"
SOCKET_IFNAME = "HPCT_SOCKET_IFNAME"
GLOO_LAZY_INIT = "HPCT_GLOO_LAZY_INIT"
# controller
SPARES = "HPCT_SPARES"
PROGRESS_TIMEOUT_S = "HPCT_PROGRESS_TIMEOUT_S"
ON_FENCED = "HPCT_ON_FENCED"
SPARE_WAIT_S = "HPCT_SPARE_WAIT_S"
FAILSLOW = "HPCT_FAILSLOW"
SLOW_RATIO = "HPCT_SLOW_RATIO"
SLOW_WINDOW = "HPCT_SLOW_WINDOW"
# hooks and the node cache
SHM_ROOT = "HPCT_SHM_ROOT"
SHM_FRACTION = "HPCT_SHM_FRACTION"
DEFAULT_CACHE_MB = "HPCT_DEFAULT_CACHE_MB"
HEALTH_MIN_SHM_MB = "HPCT_HEALTH_MIN_SHM_MB"
HOOKS_LOG = "HPCT_HOOKS_LOG"
FENCE = "HPCT_FENCE"
FENCE_ALLOW = "HPCT_FENCE_ALLOW"
SPANK_CACHE_MB = "SPANK_HPCT_CACHE_MB"
SHM_DIR = "HPCT_SHM_DIR"
CACHE_MB = "HPCT_CACHE_MB"
# tools
LOCALCLUSTER_ROOT = "HPCT_LOCALCLUSTER_ROOT"
SPARE_USERS = "HPCT_SPARE_USERS"
# the sbatch templates' shell, which passes them to `controller` flags
ACTIVE_NODES = "HPCT_ACTIVE_NODES"
SPARE_NODES = "HPCT_SPARE_NODES"
ON_FEW_SPARES = "HPCT_ON_FEW_SPARES"
ON_NO_SPARE = "HPCT_ON_NO_SPARE"
POOL_SPARES = "HPCT_POOL_SPARES"
POOL_RESERVATION = "HPCT_POOL_RESERVATION"

_TEMPLATE = "sbatch templates"
_RANK = "ranks (recovery.Job)"

SETTINGS: tuple[Setting, ...] = (
    # ---- what the controller hands to every rank it launches -----------------------------
    _s(CONTROLLER_ADDR, "str", None, CONTROLLER, _RANK,
       "host:port of the job's controller", scope="job"),
    _s(SECRET_FILE, "path", None, CONTROLLER, (_RANK, "rendezvous store"),
       "the per-job secret file (control channel, transfers, rootless store)", scope="job"),
    _s(RUN_DIR, "path", None, (CONTROLLER, USER), (_RANK, "controller", "hpct-slurm report",
                                                  "hpct-slurm move"),
       "the job's run directory (events, logs, secret, persisted snapshots); default "
       "$SLURM_SUBMIT_DIR/hpct-JOBID", scope="job"),
    _s(ROLE, "choice", "active", CONTROLLER, _RANK, "what the controller launched this "
       "process as", choices=("active", "spare"), scope="job"),
    _s(STORE, "choice", "rootless", (USER, ADMIN, CONTROLLER),
       ("controller", _RANK, "rendezvous"),
       "rendezvous store; `sbatch --hpct-rendezvous=` (the SPANK plugin exports it, with "
       "plugstack.conf default_rendezvous), `controller --store`; the controller hands its "
       "choice to the ranks", choices=("rootless", "tcpstore"), scope="job"),
    # the controller's flag, not the variable: the SPANK plugin exports a plain srun step's
    # values (120 / 600) into every job, so a variable read by the controller would be those
    _s(COLLECTIVE_TIMEOUT_S, "seconds", 10.0, CONTROLLER, (_RANK, "rendezvous"),
       "a collective whose peer is gone fails after this long; `controller "
       "--collective-timeout` sets it for a job's ranks (a plain srun step's rendezvous "
       "env: 120)", scope="job"),
    _s(INIT_TIMEOUT_S, "seconds", 30.0, CONTROLLER, (_RANK, "rendezvous"),
       "forming a generation's process group gives up after this long; `controller "
       "--init-timeout` sets it for a job's ranks (raise it where thousands of ranks take "
       "longer to form a group; a plain srun step's rendezvous env: 600)", scope="job"),
    # on by default: a requeued job (no spare left, the batch host lost, the time limit) and a
    # shard whose every holder is lost resume from these files (the templates' --requeue).
    # 500 steps, a training framework's usual checkpoint interval (torchtitan's): a file of
    # the whole state costs one copy, one hash and one write, which every few steps would
    # cost more than the recovery state held in memory (docs/benchmarks.md, item 3); faults
    # of a node recover from memory, not from these files.
    _s(PERSIST_EVERY, "int", 500, CONTROLLER, _RANK, "steps between asynchronous disk "
       "snapshots, what a requeued job resumes from (`controller --persist-every`, or this "
       "variable exported before sbatch; 0: none, a requeued job starts over)", lo=0,
       hi=UINT32_MAX, scope="job"),
    _s(HEARTBEAT_S, "seconds", 0.5, CONTROLLER, _RANK,
       "a rank's heartbeat interval; the controller stretches it beyond 1,000 ranks so the "
       "aggregate stays within its message budget (controller/pacing.py)", scope="job"),
    _s(STEP_REPORT_S, "seconds", None, CONTROLLER, _RANK,
       "at most one StepDone per this many seconds after a generation's first step (unset: "
       "every step; set by the controller beyond 1,000 ranks, controller/pacing.py)",
       scope="job"),
    _s(RELAY, "flag", False, CONTROLLER, _RANK,
       "1: a node's ranks reach the controller through one relay in its first local rank "
       "(one connection per node; the controller sets it when a node runs several ranks, "
       "relay/node.py)", choices=("1", "0"), scope="job"),
    _s(WORLD_SIZE, "int", None, CONTROLLER, "recovery.DistributedSampler",
       "the job's data-parallel world size, known before job.run", lo=1, hi=UINT32_MAX,
       scope="job"),
    _s(JOB_ID, "job_id", None, CONTROLLER, (_RANK, "pool step script"),
       "the job a spare borrowed from the cluster pool serves (its ports, messages, secret)",
       scope="job"),
    _s(RECOVERY_MODE, "choice", "auto", USER, _RANK, "jit, replicated or auto "
       "(`Job(recovery_mode=)` wins)", choices=("auto", "jit", "replicated"), scope="job"),
    _s(SNAPSHOT_EVERY, "int", None, USER, _RANK, "steps between full snapshot commits "
       "(unset: every step, or every 64 when lazy)", lo=1, hi=UINT32_MAX, scope="job"),
    _s(SNAPSHOT_OVERLAP, "choice", "auto", USER, _RANK, "copy a step's state while the next "
       "computes (auto: where the state is on a GPU)", choices=("auto", "1", "0"),
       scope="job"),
    _s(SNAPSHOT_LAZY, "flag", True, USER, _RANK, "hold the steps between full commits where "
       "they lie (0: every step is a full commit)", choices=("1", "0"), scope="job"),
    _s(BACKEND, "choice", "auto", USER, _RANK, "the process group's backend (auto: nccl "
       "where the model is on a GPU, else gloo)", choices=("auto", "gloo", "nccl"),
       scope="job"),
    _s(ABORT_TIMEOUT_S, "seconds", 10.0, USER, _RANK, "a STOP's abort of an NCCL job's "
       "communicators must finish within this long, or the rank exits and is replaced",
       scope="job"),
    _s(FAULT_TAKER_DIES_AT, "choice", None, TEST, _RANK, "fault injection: the first spare "
       "that takes over a lost rank kills itself in this phase of its adoption "
       "(recovery/inject.py)", choices=TAKER_PHASES,
       scope="job"),
    _s(FAULT_CORRUPT_SERVE, "ranks", frozenset(), TEST, _RANK, "fault injection: these "
       "ranks serve rotten copies of their snapshots", scope="job"),
    _s(FAULT_FLIP_RANK, "int", None, TEST, _RANK, "fault injection: this rank flips one bit "
       "of its first parameter after step HPCT_FAULT_FLIP_STEP, in the job's first "
       "generation (silent data corruption: recovery/crosscheck.py)", lo=0, hi=UINT32_MAX,
       scope="job"),
    _s(FAULT_FLIP_STEP, "int", None, TEST, _RANK, "fault injection: the step after which "
       "HPCT_FAULT_FLIP_RANK flips its bit", lo=0, hi=UINT32_MAX, scope="job"),
    # ---- rendezvous ----------------------------------------------------------------------
    _s(MEMBERS, "str", None, CONTROLLER, "rendezvous", "hostlist of the generation's member "
       "nodes in rank order (unset: the step's own nodes)", scope="rendezvous"),
    _s(TASKS_PER_NODE, "int", None, (CONTROLLER, USER), ("rendezvous", _TEMPLATE),
       "tasks on each member (unset: the step's own; the templates pass it to "
       "`controller --tasks-per-node`)", lo=1, hi=UINT32_MAX, scope="rendezvous"),
    _s(GENERATION, "int", 0, (USER, RENDEZVOUS), ("rendezvous", "training script"),
       "generation for `hpct-slurm rendezvous env`; exported to the script after a formation",
       lo=0, hi=UINT32_MAX, scope="rendezvous"),
    _s(STORE_PORT, "int", None, RENDEZVOUS, "training script", "the generation's store "
       "port, exported to the script after a formation", lo=1, hi=65535, scope="rendezvous"),
    _s(PORT_BASE, "int", 20000, (ADMIN, USER), ("rendezvous", "hooks (fence)"), "first port "
       "of the rendezvous window", lo=1024, hi=65535, scope="rendezvous"),
    _s(PORT_SPAN, "int", 8192, (ADMIN, USER), ("rendezvous", "hooks (fence)"), "ports of the "
       "rendezvous window", lo=8, hi=65535 - 1024 + 1, scope="rendezvous"),
    _s(NODES_PER_HOST, "int", None, (ADMIN, USER), "rendezvous", "Slurm nodes sharing one "
       "host (multi-slurmd test clusters)", lo=1, hi=UINT32_MAX, scope="rendezvous"),
    _s(SOCKET_IFNAME, "str", None, (ADMIN, USER), "rendezvous", "network interface for "
       "gloo/NCCL (unset: the one holding the node's address)", scope="rendezvous"),
    _s(GLOO_LAZY_INIT, "flag", False, USER, "rendezvous", "gloo connects a pair of ranks on "
       "its first use instead of its full mesh at init (faster to form; a fault during a "
       "pair's first connect can leave a rank stuck)", choices=("0", "1"),
       scope="rendezvous"),
    # ---- the controller ------------------------------------------------------------------
    _s(SPARES, "int", 1, (USER, ADMIN), "controller", "nodes of the allocation kept as warm "
       "spares; `sbatch --hpct-spares=` (plugstack.conf default_spares), `controller "
       "--spares` wins", lo=0, hi=UINT32_MAX, scope="controller"),
    _s(PROGRESS_TIMEOUT_S, "seconds", 300.0, USER, ("controller", _RANK), "a running rank "
       "without a completed step this long counts as hung (`controller --progress-timeout` "
       "wins); the first step after each formation may wait this long in a collective (a "
       "first compile, on a spare too), as the controller hands it to the ranks",
       scope="controller"),
    _s(ON_FENCED, "choice", "leave", ADMIN, "controller", "a node the controller fenced "
       "DOWN: `leave` it for the admin, or `reboot` it (`scontrol reboot ASAP "
       "nextstate=RESUME reason=\"hpct: ...\"`; the Prolog's health check then guards its "
       "next job, `spares check --to-pool` re-admits it as a pool spare)",
       choices=("leave", "reboot"), scope="controller"),
    _s(SPARE_WAIT_S, "seconds", 60.0, (ADMIN, USER), "controller", "a round short of ready "
       "spares waits this long for one on its way (a spare step registering, a healthy node "
       "whose cancelled step is ending, a pool companion) before it requeues or shrinks: "
       "covers a spare's Python and torch start on a cold filesystem, a pool companion's "
       "scheduling and a stopped slurmstepd's 10 s cancel; a requeue costs far more (a "
       "restart from the last persisted snapshot). 0: never wait", lo=0, scope="controller"),
    # Fail-slow (issue 47, controller/slowness.py): 1.2 x over 50 steps, held 50 more. A
    # median over 50 steps ignores up to 24 slow ones (a checkpoint, a hiccup); 20 % is past
    # the step-to-step spread of a healthy job (a few %, docs/benchmarks.md) and costs a
    # 1,000-node job 200 node-equivalents while it lasts, against a planned move's second.
    # `report` by default: own time cannot tell a slower node from a rank the script gives
    # more to do before its step's last collective, and a drain outlives the job.
    _s(FAILSLOW, "choice", "report", (USER, ADMIN), "controller", "a node whose own time per "
       "step stays above HPCT_SLOW_RATIO x the other nodes' median over HPCT_SLOW_WINDOW "
       "steps, and holds over HPCT_SLOW_WINDOW more that the job's step rate shows: "
       "`report` says so (node.slow); `move` also drains it with what was measured and moves "
       "its ranks onto a ready warm spare (without one it trains on, drained); `off`: "
       "nothing. Not `move` by default: a rank that does more than its peers before its "
       "step's last collective (rank 0 evaluating or logging at the top of a step) reads as "
       "a slow node, and a drained node stays out of every later job until an admin returns "
       "it", choices=("move", "report", "off"), scope="controller"),
    _s(SLOW_RATIO, "ratio", 1.2, (USER, ADMIN), "controller", "how many times the other "
       "nodes' median a node's own time per step must be to count as slow", scope="controller"),
    _s(SLOW_WINDOW, "int", 50, (USER, ADMIN, CONTROLLER), ("controller", _RANK), "steps a "
       "rank's own time is the median over; a node is judged only on full windows of every "
       "rank (the controller hands its value to the steps it launches)",
       lo=5, hi=100_000, scope="controller"),
    # ---- the hooks (admin settings baked into the hook scripts) and the node cache -------
    _s(SHM_ROOT, "path", "/dev/shm/hpct", ADMIN, ("hooks", "cache"), "root of the jobs' shm "
       "dirs (absolute, root-owned)", scope="hooks"),
    _s(SHM_FRACTION, "fraction", 0.5, ADMIN, "hooks", "share of the shm filesystem all jobs' "
       "caches on a node may reserve", scope="hooks"),
    _s(DEFAULT_CACHE_MB, "int", 1024, ADMIN, "hooks", "cache grant of a job that asks for "
       "none", lo=0, hi=UINT32_MAX, scope="hooks"),
    _s(HEALTH_MIN_SHM_MB, "int", 64, ADMIN, "hooks", "free shm below this drains the node",
       lo=0, hi=UINT32_MAX, scope="hooks"),
    _s(HOOKS_LOG, "path", None, ADMIN, "hooks", "the hooks' event log (not in a directory "
       "other users can write)", scope="hooks"),
    _s(FENCE, "choice", "off", ADMIN, "hooks", "the Prolog's packet filter for the traffic "
       "no secret protects (gloo, NCCL's bootstrap, TCPStore): `nft` admits to the node's "
       "ephemeral ports and the rendezvous range only the allocation's nodes, loopback only "
       "from root and the job's user (to that user's listeners only from that user and root), "
       "the Epilog removes it (docs/admin.md); off: none", choices=("nft", "off"),
       scope="hooks"),
    _s(FENCE_ALLOW, "str", None, ADMIN, "hooks", "comma-separated IPv4 addresses or "
       "networks the fence admits besides the allocation and slurmctld (pool spares' nodes, "
       "NFS servers' callbacks)", scope="hooks"),
    _s(SPANK_CACHE_MB, "int", None, USER, "hooks (prolog)", "`sbatch --hpct-cache-mb=` as "
       "the prolog sees it (plugstack.conf default_cache_mb)", lo=0, hi=UINT32_MAX,
       scope="hooks"),
    _s(SHM_DIR, "path", None, HOOK, "cache", "the job's shm dir (the task prolog exports "
       "it)", scope="cache"),
    _s(CACHE_MB, "int", None, (HOOK, USER), "cache", "the job's cache grant (the task "
       "prolog exports it; the SPANK plugin exports the request)", lo=0, hi=UINT32_MAX,
       scope="cache"),
    # ---- tools ---------------------------------------------------------------------------
    _s(LOCALCLUSTER_ROOT, "path", "/tmp/hpct-localcluster", USER, "hpct-slurm localcluster",
       "state directory of the local test cluster", scope="tools"),
    _s(SPARE_USERS, "str", "root", ADMIN, "hpct-slurm spares", "users allowed into the spare "
       "pool reservation (`spares add --users` wins)", scope="tools"),
    # ---- read by the sbatch templates' shell (then passed as `controller` flags) ---------
    _s(ACTIVE_NODES, "int", 4, USER, _TEMPLATE, "active nodes (world size = active "
       "x tasks per node)", lo=1, hi=UINT32_MAX, scope="template", shell_only=True),
    _s(SPARE_NODES, "int", 1, USER, _TEMPLATE, "warm spares expected from the "
       "allocation", lo=0, hi=UINT32_MAX, scope="template", shell_only=True),
    _s(ON_FEW_SPARES, "choice", "warn", USER, _TEMPLATE, "fewer spares at the first "
       "start", choices=("warn", "refuse"), scope="template", shell_only=True),
    _s(ON_NO_SPARE, "choice", "requeue", USER, _TEMPLATE, "no warm spare left",
       choices=("requeue", "shrink", "fail"), scope="template", shell_only=True),
    _s(POOL_SPARES, "int", 0, USER, _TEMPLATE, "warm spares borrowed from the cluster "
       "pool (pool.sbatch: 2)", lo=0, hi=UINT32_MAX, scope="template", shell_only=True),
    _s(POOL_RESERVATION, "str", "hpct_spares", USER, _TEMPLATE, "the pool's "
       "reservation", scope="template", shell_only=True),
    _s("HPCT_BIN", "path", "hpct-slurm", USER, _TEMPLATE, "the hpct-slurm command (on the "
       "job's PATH, or its full path)", scope="template", shell_only=True),
    _s("HPCT_PYTHON", "path", "python3", USER, _TEMPLATE, "python of the example training",
       scope="template", shell_only=True),
)

BY_NAME: dict[str, Setting] = {s.name: s for s in SETTINGS}

# A setting renamed: the old name is taken, for one release, where the new one is not set
# (a SPANK plugin built before the rename still exports HPCT_RENDEZVOUS).
RENAMED: dict[str, str] = {"HPCT_RENDEZVOUS": STORE}

# HPCT_* words in the sources that are not settings (constants, C macros; HPCT_SLURM_CHROOT:
# where scripts/test-slurm.sh keeps a release's chroot, read by that script only).
NOT_SETTINGS = frozenset({"HPCT_PHASES", "HPCT_SPANK_H", "HPCT_PATH_MAX", "HPCT_SLURM",
                          "HPCT_TEST_DIR", "HPCT_SLURM_CHROOT"})


def _fail(raw: str, what: str) -> _Refused:
    return _Refused(shown(raw), f"is not {what}")


def _out_of_range(text: str, allowed: str) -> _Refused:
    return _Refused(text, f"is out of range: it must be {allowed}", sep="=",
                    hint=" (unset it for the default)")


# The rules below are the same for a setting's text and for a value given from Python
# (`check_value`: the controller's Options): a number is refused by `_int_refused` and
# `_decimal_refused`, whatever it came as.
def _int_refused(s: Setting, number: int, raw: str, text: str) -> _Refused | None:
    lo = 0 if s.lo is None else s.lo
    if number < lo or (s.hi is not None and number > s.hi):
        return _out_of_range(text, f"at least {lo}" if s.hi is None or s.hi == UINT32_MAX
                             else f"in {lo}-{s.hi}")
    return None


def _decimal_refused(s: Setting, value: float | None, raw: str, text: str) -> _Refused | None:
    if s.kind == "fraction":
        return _fail(raw, "a number in (0, 1]") if value is None or not 0.0 < value <= 1.0 \
            else None
    if s.kind == "ratio":
        return _fail(raw, f"a number > 1, at most {RATIO_MAX:g}") \
            if value is None or not 1.0 < value <= RATIO_MAX else None
    # (NaN compares false both ways: `not value > 0` refuses it)
    if value is None or (not value >= s.lo if s.lo is not None else not value > 0):
        return _fail(raw, "a positive number of seconds" if s.lo is None
                     else f"a number of seconds >= {s.lo}")
    if value > s.seconds_max():
        return _out_of_range(text, f"at most {s.seconds_max()} seconds")
    return None


def _parse_int(s: Setting, raw: str) -> int:
    text = raw.strip(_SPACE)
    if not _INT_RE.fullmatch(text):
        raise _fail(raw, "a positive integer" if s.lo == 1 else "a non-negative integer")
    number = int(text)
    if refused := _int_refused(s, number, raw, text):
        raise refused
    return number


def _parse_decimal(s: Setting, raw: str) -> float:
    text = raw.strip(_SPACE)
    value = float(text) if _DECIMAL_RE.fullmatch(text) else None
    if refused := _decimal_refused(s, value, raw, text):
        raise refused
    return value  # type: ignore[return-value]  # (None is refused above)


def check_value(s: Setting, value: Any, name: str) -> None:
    """`value`, given from Python rather than as text (the controller's Options), by the rules
    its text would meet (NaN, -1, 0 where the table says at least 1 are refused alike): a
    SettingError naming `name` and what is allowed otherwise. None is not checked (unset)."""
    if value is None:
        return
    refused: _Refused | None = None
    if s.kind == "int":
        if isinstance(value, bool) or not isinstance(value, int):
            refused = _fail(str(value), "an integer")
        else:
            refused = _int_refused(s, value, str(value), str(value))
    elif s.kind in ("seconds", "fraction", "ratio"):
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            refused = _fail(str(value), "a number")
        else:
            refused = _decimal_refused(s, float(value), str(value), str(value))
    elif s.kind in ("choice", "flag") and value not in s.choices:
        refused = _fail(str(value), f"one of {', '.join(s.choices)}")
    if refused is not None:
        raise SettingError(f"{name}{refused.sep}{refused}")


def _parse_choice(s: Setting, raw: str) -> Any:
    if raw not in s.choices:
        raise _fail(raw, f"one of {', '.join(s.choices)}")
    return raw == "1" if s.kind == "flag" else raw


def _parse_ranks(s: Setting, raw: str) -> frozenset[int]:
    items = [item.strip(_SPACE) for item in raw.split(",") if item.strip(_SPACE)]
    if not all(re.fullmatch(r"[0-9]{1,10}", item) for item in items):
        raise _fail(raw, "comma-separated rank numbers")
    return frozenset(int(item) for item in items)


def _parse_job_id(s: Setting, raw: str) -> int:
    from .slurm.env import check_job_id  # the one rule for job ids from outside

    try:
        return check_job_id(raw, s.name)
    except SettingError:
        raise
    except HpctError as exc:
        raise SettingError(exc.message) from None


_PARSERS: dict[str, Callable[[Setting, str], Any]] = {
    "int": _parse_int, "seconds": _parse_decimal, "fraction": _parse_decimal,
    "ratio": _parse_decimal,
    "choice": _parse_choice, "flag": _parse_choice, "ranks": _parse_ranks,
    "job_id": _parse_job_id, "str": lambda s, raw: raw, "path": lambda s, raw: raw,
}


def _lookup(environ: Mapping[str, str] | None, name: str) -> tuple[str, str] | None:
    """(the variable that holds setting `name`, its text), None when unset or empty; an old
    name from RENAMED stands in for its new one (and is the one an error names)."""
    if name not in BY_NAME:
        raise KeyError(f"{name} is not in hpct_slurm.config.SETTINGS")
    env = os.environ if environ is None else environ
    if env.get(name):
        return name, env[name]
    for old, new in RENAMED.items():
        if new == name and env.get(old):
            return old, env[old]
    return None


def raw(environ: Mapping[str, str] | None, name: str) -> str | None:
    """The text of setting `name` in `environ` (default os.environ), None when unset or
    empty."""
    found = _lookup(environ, name)
    return None if found is None else found[1]


def read(environ: Mapping[str, str] | None, name: str, default: Any = None) -> Any:
    """Setting `name` parsed from `environ` (default os.environ); unset or empty: `default`
    if given, else the table's default. A value that cannot be used is a SettingError, never
    a silent fall-back to the default."""
    found = _lookup(environ, name)
    setting = BY_NAME[name]
    if found is None:
        return setting.default if default is None else default
    var, text = found
    if var != name:
        setting = dataclasses.replace(setting, name=var)
    try:
        return _PARSERS[setting.kind](setting, text)
    except _Refused as exc:
        raise exc.naming(var) from None


def arg_type(name: str) -> Callable[[str], Any]:
    """argparse `type=` for a flag that mirrors setting `name`: the table's parser and bounds,
    so a flag takes nothing its variable refuses; argparse names the flag in the one error
    line (`argument --persist-every: -5 is out of range: it must be at least 0`)."""
    return _arg_type(BY_NAME[name])


def number_type(kind: str, lo: int | None = None, hi: int | None = None) -> Callable[[str], Any]:
    """argparse `type=` for a number flag that mirrors no setting (`--heartbeat-timeout`):
    the same parser and rules (`kind` "int", "seconds" or "fraction")."""
    return setting_type(number_rule(kind, lo, hi))


def number_rule(kind: str, lo: int | None = None, hi: int | None = None) -> Setting:
    """The rule for a number that is no setting of the table (`kind` "int", "seconds" or
    "fraction"): for `check_value`, or a flag's `setting_type`."""
    return Setting("", kind, None, (), (), "", lo=lo, hi=hi)


def setting_type(setting: Setting) -> Callable[[str], Any]:
    """argparse `type=` that parses and checks by `setting`'s rules."""
    return _arg_type(setting)


def _arg_type(setting: Setting) -> Callable[[str], Any]:
    def parse(text: str) -> Any:
        try:
            return _PARSERS[setting.kind](setting, text)
        except _Refused as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None

    parse.__name__ = setting.kind  # argparse names the type in some of its own messages
    parse.setting = setting  # the entry it checks by (tests: every number flag has one)
    return parse


def flag_help(name: str, lead: str | None = None, environ: bool = False,
              default: str | None = None) -> str:
    """The help of a flag that mirrors setting `name`: `lead` (else the table's text), then
    what the value may be and the default, from the table; `environ`: the flag's default is
    the variable, then the table's; `default`: a flag's own default, in words."""
    s = BY_NAME[name]
    default = default or _default_text(s)
    if environ:
        default = f"${name}, else {default}"
    allowed = f"{s.allowed()}; " if s.kind in ("int", "seconds", "fraction", "ratio") else ""
    return f"{lead or s.doc} ({allowed}default {default})".replace("%", "%%")


def require(environ: Mapping[str, str] | None, name: str, hint: str = "") -> Any:
    """Setting `name`, which must be set: unset is a SettingError saying who sets it."""
    if raw(environ, name) is None:
        who = hint or ("run the training script under `hpct-slurm controller` (it sets "
                       "HPCT_* for every step)" if CONTROLLER in BY_NAME[name].set_by
                       else f"it is set by: {', '.join(BY_NAME[name].set_by)}")
        raise SettingError(f"{name} is not set: {who}")
    return read(environ, name)


def settings_for(scope: str, environ: Mapping[str, str] | None = None) -> dict[str, Any]:
    """Every setting of `scope` ("job", "rendezvous", "controller", "hooks", "cache", "tools")
    parsed from `environ`: name -> value (the default where unset)."""
    found = {s.name: read(environ, s.name) for s in SETTINGS
             if s.scope == scope and not s.shell_only}
    if not found:
        raise KeyError(f"no settings of scope {scope!r}")
    return found


# ---- groups ------------------------------------------------------------------------------
@dataclass(frozen=True)
class JobSettings:
    """What a rank (`recovery.Job`) runs with; `from_environ` reads the controller's step
    environment. Tests build one directly."""

    controller: str
    secret_file: str
    run_dir: Path
    role: str = "active"
    store: str = "rootless"
    collective_timeout_s: float = 10.0
    progress_timeout_s: float = 300.0
    init_timeout_s: float = 30.0
    recovery_mode: str = "auto"
    snapshot_every: int | None = None
    snapshot_overlap: str = "auto"
    snapshot_lazy: bool = True
    persist_every: int = 0  # built directly (tests): no disk; a rank gets the controller's
    corrupt_serve: frozenset[int] = field(default_factory=frozenset)
    taker_dies_at: str | None = None  # test fault injection (recovery/inject.py)
    flip_rank: int | None = None  # test fault injection: a bit flipped (crosscheck.py)
    flip_step: int | None = None
    served_job_id: int | None = None  # a pool spare: the main job it serves
    relay: bool = False  # reach the controller through the node's relay (relay/node.py)
    backend: str = "auto"
    abort_timeout_s: float = 10.0

    @classmethod
    def from_environ(cls, environ: Mapping[str, str] | None = None) -> "JobSettings":
        env = os.environ if environ is None else environ
        return cls(controller=require(env, CONTROLLER_ADDR),
                   secret_file=require(env, SECRET_FILE),
                   run_dir=Path(require(env, RUN_DIR)),
                   role=read(env, ROLE), store=read(env, STORE),
                   collective_timeout_s=read(env, COLLECTIVE_TIMEOUT_S),
                   progress_timeout_s=read(env, PROGRESS_TIMEOUT_S),
                   init_timeout_s=read(env, INIT_TIMEOUT_S),
                   recovery_mode=read(env, RECOVERY_MODE),
                   snapshot_every=read(env, SNAPSHOT_EVERY),
                   snapshot_overlap=read(env, SNAPSHOT_OVERLAP),
                   snapshot_lazy=read(env, SNAPSHOT_LAZY),
                   persist_every=read(env, PERSIST_EVERY),
                   corrupt_serve=read(env, FAULT_CORRUPT_SERVE),
                   taker_dies_at=read(env, FAULT_TAKER_DIES_AT),
                   flip_rank=read(env, FAULT_FLIP_RANK), flip_step=read(env, FAULT_FLIP_STEP),
                   served_job_id=read(env, JOB_ID),
                   relay=read(env, RELAY),
                   backend=read(env, BACKEND),
                   abort_timeout_s=read(env, ABORT_TIMEOUT_S))


# ---- the docs table and `hpct-slurm settings` --------------------------------------------
def _default_text(s: Setting) -> str:
    if s.default is None or s.default == frozenset():
        return "unset"
    if isinstance(s.default, bool):
        return "1" if s.default else "0"
    if isinstance(s.default, float):
        return f"{s.default:g}"
    return str(s.default)


def as_records() -> list[dict[str, Any]]:
    return [{"name": s.name, "kind": s.kind, "default": _default_text(s),
             "allowed": s.allowed().replace("\\|", "|"), "set_by": list(s.set_by),
             "read_by": list(s.read_by), "scope": s.scope, "doc": s.doc} for s in SETTINGS]


def markdown_table() -> str:
    """The settings table of docs/admin.md (tests/test_config.py checks the two agree)."""
    lines = ["| variable | default | allowed | set by | read by | what |",
             "|---|---|---|---|---|---|"]
    for s in SETTINGS:
        lines.append(f"| `{s.name}` | {_default_text(s)} | {s.allowed()} | "
                     f"{', '.join(s.set_by)} | {', '.join(s.read_by)} | {s.doc} |")
    return "\n".join(lines) + "\n"


def register(sub: Any) -> None:
    p = sub.add_parser("settings", help="every HPCT_* setting: default, allowed values, who "
                                        "sets it and who reads it")
    fmt = p.add_mutually_exclusive_group()
    fmt.add_argument("--json", action="store_true", help="one JSON list")
    fmt.add_argument("--markdown", action="store_true",
                     help="the table of docs/admin.md")
    p.set_defaults(func=_settings_cli)


def _settings_cli(args: Any) -> int:
    import json
    import sys

    if args.json:
        json.dump(as_records(), sys.stdout, indent=1)
        sys.stdout.write("\n")
    elif args.markdown:
        sys.stdout.write(markdown_table())
    else:
        width = max(len(s.name) for s in SETTINGS)
        for s in SETTINGS:
            sys.stdout.write(f"{s.name:<{width}}  {_default_text(s):<22}  "
                             f"{', '.join(s.set_by)}\n")
    return 0
